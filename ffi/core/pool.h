// A pinned host buffer pool with a fixed byte budget.
//
// Every staging buffer of the I/O paths comes from here: fixed-size,
// 4 KiB-aligned buffers, page-locked (mlock) where the process may, created
// lazily and reused. The pool never holds more than its budget; an Acquire
// that no buffer frees up for within the timeout fails with an error that
// names the budget, instead of growing memory without bound.
#ifndef ZINFJAX_CORE_POOL_H_
#define ZINFJAX_CORE_POOL_H_

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "core/buffer.h"

namespace zinfjax {

struct PoolStats {
  size_t budget_bytes = 0;
  size_t buffer_bytes = 0;
  size_t allocated_bytes = 0;  // buffers created so far (never above the budget)
  size_t in_use_bytes = 0;
  size_t peak_in_use_bytes = 0;
  size_t locked_bytes = 0;     // of allocated, page-locked
  uint64_t acquires = 0;
  uint64_t waits = 0;          // acquires that had to wait for a release
  uint64_t timeouts = 0;
};

class PinnedPool;

// A buffer on loan from the pool; returned when the lease is destroyed.
class Lease {
 public:
  Lease() = default;
  Lease(PinnedPool* pool, AlignedBuffer* buffer) : pool_(pool), buffer_(buffer) {}
  Lease(Lease&& other) noexcept { *this = std::move(other); }
  Lease& operator=(Lease&& other) noexcept;
  ~Lease() { Release(); }
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;

  uint8_t* data() const { return buffer_->data(); }
  size_t size() const { return buffer_->capacity(); }
  explicit operator bool() const { return buffer_ != nullptr; }
  void Release();

 private:
  PinnedPool* pool_ = nullptr;
  AlignedBuffer* buffer_ = nullptr;
};

class PinnedPool {
 public:
  // `buffer_bytes` is rounded up to kAlignment; the budget holds at least one buffer.
  PinnedPool(size_t budget_bytes, size_t buffer_bytes, bool lock_memory = true);
  ~PinnedPool();

  // Waits up to `timeout` for a free buffer; throws PoolExhausted past it.
  Lease Acquire(std::chrono::milliseconds timeout);
  // A free buffer now, or none.
  std::optional<Lease> TryAcquire();

  size_t buffer_bytes() const { return buffer_bytes_; }
  size_t capacity() const { return max_buffers_; }
  PoolStats Stats() const;

 private:
  friend class Lease;
  void Return(AlignedBuffer* buffer);
  AlignedBuffer* TakeLocked();  // mu_ held; nullptr when none free and none creatable

  const size_t buffer_bytes_;
  const size_t max_buffers_;
  const bool lock_memory_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::unique_ptr<AlignedBuffer>> owned_;
  std::vector<AlignedBuffer*> free_;
  PoolStats stats_;
};

}  // namespace zinfjax

#endif  // ZINFJAX_CORE_POOL_H_
