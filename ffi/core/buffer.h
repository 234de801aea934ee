// Aligned host buffers: the unit every zinfjax I/O path moves.
//
// O_DIRECT needs addresses, sizes and offsets aligned to the device block
// (4 KiB is safe everywhere), so every buffer the engine owns is allocated
// with that alignment and its size rounded up to it.
#ifndef ZINFJAX_CORE_BUFFER_H_
#define ZINFJAX_CORE_BUFFER_H_

#include <cstddef>
#include <cstdint>
#include <memory>

namespace zinfjax {

constexpr size_t kAlignment = 4096;

// Rounds `n` up to a multiple of `align` (a power of two).
constexpr size_t AlignUp(size_t n, size_t align = kAlignment) {
  return (n + align - 1) & ~(align - 1);
}

// An owned, zero-initialised, `kAlignment`-aligned host buffer.
class AlignedBuffer {
 public:
  using FreeHook = void (*)(void*);

  explicit AlignedBuffer(size_t bytes);
  AlignedBuffer(AlignedBuffer&&) noexcept = default;
  AlignedBuffer& operator=(AlignedBuffer&&) noexcept = default;
  ~AlignedBuffer() {
    if (on_free_ && data_) on_free_(data_.get());
  }

  // Called with data() just before the memory is freed (e.g. to unpin it for CUDA).
  void set_on_free(FreeHook hook) { on_free_ = hook; }

  uint8_t* data() { return data_.get(); }
  const uint8_t* data() const { return data_.get(); }
  size_t size() const { return size_; }      // bytes asked for
  size_t capacity() const { return capacity_; }  // size rounded up to kAlignment

 private:
  struct Free {
    void operator()(uint8_t* p) const;
  };
  std::unique_ptr<uint8_t, Free> data_;
  FreeHook on_free_ = nullptr;
  size_t size_ = 0;
  size_t capacity_ = 0;
};

}  // namespace zinfjax

#endif  // ZINFJAX_CORE_BUFFER_H_
