#include "core/buffer.h"

#include <cstdlib>
#include <cstring>
#include <new>

namespace zinfjax {

AlignedBuffer::AlignedBuffer(size_t bytes)
    : size_(bytes), capacity_(AlignUp(bytes == 0 ? 1 : bytes)) {
  void* p = std::aligned_alloc(kAlignment, capacity_);
  if (p == nullptr) throw std::bad_alloc();
  std::memset(p, 0, capacity_);
  data_.reset(static_cast<uint8_t*>(p));
}

void AlignedBuffer::Free::operator()(uint8_t* p) const { std::free(p); }

}  // namespace zinfjax
