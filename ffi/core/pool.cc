#include "core/pool.h"

#include <sys/mman.h>

#include <algorithm>
#include <string>

#include "core/errors.h"

namespace zinfjax {

Lease& Lease::operator=(Lease&& other) noexcept {
  if (this != &other) {
    Release();
    pool_ = other.pool_;
    buffer_ = other.buffer_;
    other.pool_ = nullptr;
    other.buffer_ = nullptr;
  }
  return *this;
}

void Lease::Release() {
  if (pool_ && buffer_) pool_->Return(buffer_);
  pool_ = nullptr;
  buffer_ = nullptr;
}

PinnedPool::PinnedPool(size_t budget_bytes, size_t buffer_bytes, bool lock_memory)
    : buffer_bytes_(AlignUp(std::max<size_t>(buffer_bytes, 1))),
      max_buffers_(std::max<size_t>(1, budget_bytes / AlignUp(std::max<size_t>(buffer_bytes, 1)))),
      lock_memory_(lock_memory) {
  stats_.budget_bytes = max_buffers_ * buffer_bytes_;
  stats_.buffer_bytes = buffer_bytes_;
}

PinnedPool::~PinnedPool() {
  for (auto& b : owned_) {
    if (lock_memory_) munlock(b->data(), b->capacity());
  }
}

AlignedBuffer* PinnedPool::TakeLocked() {
  AlignedBuffer* b = nullptr;
  if (!free_.empty()) {
    b = free_.back();
    free_.pop_back();
  } else if (owned_.size() < max_buffers_) {
    owned_.push_back(std::make_unique<AlignedBuffer>(buffer_bytes_));
    b = owned_.back().get();
    stats_.allocated_bytes += buffer_bytes_;
    if (lock_memory_ && mlock(b->data(), b->capacity()) == 0) stats_.locked_bytes += buffer_bytes_;
  }
  if (b) {
    stats_.acquires++;
    stats_.in_use_bytes += buffer_bytes_;
    stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
  }
  return b;
}

Lease PinnedPool::Acquire(std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  AlignedBuffer* b = TakeLocked();
  if (!b) {
    stats_.waits++;
    bool ok = cv_.wait_for(lock, timeout, [&] { return (b = TakeLocked()) != nullptr; });
    if (!ok) {
      stats_.timeouts++;
      throw PoolExhausted(
          "pinned buffer pool exhausted: all " + std::to_string(max_buffers_) + " buffers of " +
          std::to_string(buffer_bytes_) + " bytes (budget " + std::to_string(stats_.budget_bytes) +
          " bytes) stayed in use for " + std::to_string(timeout.count()) +
          " ms; raise the pinned buffer budget or lower the queue depth / transfers in flight");
    }
  }
  return Lease(this, b);
}

std::optional<Lease> PinnedPool::TryAcquire() {
  std::lock_guard<std::mutex> lock(mu_);
  AlignedBuffer* b = TakeLocked();
  if (!b) return std::nullopt;
  return Lease(this, b);
}

void PinnedPool::Return(AlignedBuffer* buffer) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    free_.push_back(buffer);
    stats_.in_use_bytes -= buffer_bytes_;
  }
  cv_.notify_one();
}

PoolStats PinnedPool::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

}  // namespace zinfjax
