// The swap store's space: striping logical extents over the files, growing
// and reserving them, allocating (and reusing freed) extents, the cache of
// buffers it lends, and the test-only fault switches.
#include "core/store.h"

#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>

#include "core/errors.h"
#include "core/store_internal.h"
#include "core/workers.h"

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14
#endif

namespace zinfjax {

thread_local AioBackend* SwapStore::current_backend_ = nullptr;

std::vector<Block> SwapStore::BlocksFor(const ShardEntry& e) const {
  std::vector<Block> blocks;
  const uint64_t unit = config_.block_size, n = fds_.size();
  for (uint64_t pos = e.offset, end = e.offset + e.capacity; pos < end;) {
    uint64_t stripe = pos / unit, within = pos % unit;
    uint64_t len = std::min(unit - within, end - pos);
    uint64_t file = stripe % n;
    blocks.push_back({fds_[file], static_cast<off_t>((stripe / n) * unit + within),
                      static_cast<size_t>(len), static_cast<size_t>(pos - e.offset)});
    pos += len;
  }
  return blocks;
}

void SwapStore::EnsureAllocated(uint64_t logical_end) {
  const uint64_t unit = config_.block_size, n = fds_.size();
  uint64_t stripes = (logical_end + unit - 1) / unit;
  std::vector<uint64_t> need(n);
  uint64_t total = 0;
  for (uint64_t i = 0; i < n; ++i) {
    need[i] = ((stripes + n - 1 - i) / n) * unit;
    if (need[i] > file_sizes_[i]) total += need[i] - file_sizes_[i];
  }
  if (total == 0) return;
  if (config_.memory && need[0] > kMemoryMapBytes)
    throw NoSpace("the host-memory store is limited to " + std::to_string(kMemoryMapBytes) +
                  " bytes; it was asked for " + std::to_string(need[0]));
  if (fault_free_bytes_ >= 0 && total > static_cast<uint64_t>(fault_free_bytes_)) {
    throw NoSpace("no space left for the swap store in " + folders_[0] + ": it needs " +
                  std::to_string(total) + " more bytes, " + std::to_string(fault_free_bytes_) +
                  " are free; free space or point nvme_path at a larger drive");
  }
  for (uint64_t i = 0; i < n; ++i) {
    if (need[i] <= file_sizes_[i]) continue;
    uint64_t grow = need[i] - file_sizes_[i];
    int err = 0;
    if (config_.memory) {
      err = GrowMemory(file_sizes_[i], need[i]);
    } else if (fallocate(fds_[i], 0, static_cast<off_t>(file_sizes_[i]),
                         static_cast<off_t>(grow)) != 0 &&
               (errno != EOPNOTSUPP || ftruncate(fds_[i], static_cast<off_t>(need[i])) != 0)) {
      err = errno;
    }
    if (err != 0) {
      std::string file = folders_[i] + "/swap.bin";
      if (config_.memory && (err == ENOSPC || err == ENOMEM))
        throw NoSpace("host memory cannot hold " + std::to_string(grow) + " more bytes of "
                      "states: place fewer on the host (offload_optimizer / offload_param)");
      if (err == ENOSPC || err == EDQUOT)
        throw NoSpace("no space left on the device of " + file + ": the swap store needs " +
                      std::to_string(grow) + " more bytes there, " +
                      std::to_string(FreeBytes(folders_[i])) +
                      " are free; free space or point nvme_path at a larger drive");
      throw EngineError(SysError("cannot allocate " + std::to_string(grow) + " bytes in " + file, err));
    }
    if (fault_free_bytes_ >= 0) fault_free_bytes_ -= static_cast<int64_t>(grow);
    file_sizes_[i] = need[i];
  }
}

int SwapStore::GrowMemory(uint64_t from, uint64_t to) {
  constexpr size_t kPiece = size_t{64} << 20, kShare = size_t{256} << 20;
  if (ftruncate(fds_[0], static_cast<off_t>(to)) != 0) return errno;
  std::atomic<int> failed{0};
  ParallelBlocks(to - from, kPiece, kShare, /*threads=*/0, [&](size_t begin, size_t end) {
    if (failed.load(std::memory_order_relaxed) == 0 &&
        madvise(map_ + from + begin, end - begin, MADV_POPULATE_WRITE) != 0) {
      int none = 0;
      failed.compare_exchange_strong(none, errno);
    }
  });
  int err = failed.load();
  if (err == EINVAL)  // a kernel without MADV_POPULATE_WRITE (5.14): fallocate, on one thread
    err = fallocate(fds_[0], 0, static_cast<off_t>(from), static_cast<off_t>(to - from)) == 0
              ? 0 : errno;
  if (err != 0) {  // the pages made are given back
    int shrunk = ftruncate(fds_[0], static_cast<off_t>(from));
    (void)shrunk;
  }
  return err;
}

void SwapStore::Reserve(uint64_t bytes, bool exact) {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t end = next_offset_ + AlignUp(bytes);
  EnsureAllocated(end);
  if (!exact) return;
  const uint64_t unit = config_.block_size, n = fds_.size();
  uint64_t stripes = (end + unit - 1) / unit;
  for (uint64_t i = 0; i < n; ++i) {
    uint64_t need = ((stripes + n - 1 - i) / n) * unit;
    if (file_sizes_[i] <= need) continue;
    if (ftruncate(fds_[i], static_cast<off_t>(need)) != 0)
      throw EngineError(SysError("cannot shrink swap file " + folders_[i] + "/swap.bin", errno));
    file_sizes_[i] = need;
  }
  zero_from_ = std::min(zero_from_, stripes * unit);  // every file now ends at or before it
}

uint64_t SwapStore::allocated_bytes() const {
  uint64_t total = 0;
  for (int fd : fds_) {
    struct stat st;
    if (fstat(fd, &st) == 0) total += static_cast<uint64_t>(st.st_blocks) * 512;
  }
  return total;
}

ShardEntry SwapStore::Allocate(const std::string& key, size_t nbytes, const std::string& dtype,
                               const std::vector<int64_t>& shape) {
  if (key.empty() || key.find_first_of("\t\n") != std::string::npos)
    throw EngineError("swap key must be non-empty and hold no tab or newline: '" + key + "'");
  std::lock_guard<std::mutex> lock(mu_);
  ShardEntry e;
  const uint64_t capacity = AlignUp(nbytes);
  auto it = manifest_.find(key);
  bool versioned = txn_ && std::any_of(txn_prefixes_.begin(), txn_prefixes_.end(),
                                       [&](const std::string& p) { return key.rfind(p, 0) == 0; });
  auto pending = txn_pending_.find(key);
  if (versioned && pending != txn_pending_.end() && pending->second.capacity == capacity) {
    e = pending->second;  // written before in this transaction: again in place
  } else if (versioned) {
    if (pending != txn_pending_.end()) free_.emplace(pending->second.capacity, pending->second.offset);
    if (it != manifest_.end() && !txn_old_.count(key) && pending == txn_pending_.end())
      txn_old_[key] = it->second;  // the committed entry, for Rollback
    e.offset = TakeExtent(capacity);
    e.capacity = capacity;
    txn_pending_[key] = e;
  } else if (it != manifest_.end() && it->second.capacity == capacity) {
    e = it->second;  // same size: rewrite in place
  } else {
    e.offset = TakeExtent(capacity);
    e.capacity = capacity;
  }
  e.dtype = dtype;
  e.shape = shape;
  e.nbytes = nbytes;
  return e;
}

uint64_t SwapStore::TakeExtent(uint64_t capacity) {
  auto it = free_.find(capacity);
  if (it != free_.end()) {
    uint64_t offset = it->second;
    free_.erase(it);
    return offset;
  }
  EnsureAllocated(next_offset_ + capacity);  // throws NoSpace before anything is written
  uint64_t offset = next_offset_;
  next_offset_ += capacity;
  return offset;
}

void SwapStore::SetPinHooks(PinHook pin, AlignedBuffer::FreeHook unpin) {
  std::lock_guard<std::mutex> lock(spare_mu_);
  if (pin_.load() == pin) return;
  unpin_ = unpin;
  pin_ = pin;
  for (auto& [size, b] : spare_)  // the spares made before: pinned now
    if (pin(b->data(), b->capacity())) b->set_on_free(unpin_);
}

bool SwapStore::PinExtents(const std::vector<ShardEntry>& entries) {
  PinHook pin = pin_.load();
  if (pin == nullptr) return true;
  std::lock_guard<std::mutex> lock(pin_mu_);
  for (const ShardEntry& e : entries) {
    // extents are page-aligned and never split or merged (a freed one is only taken again
    // whole), so an offset locked before is this extent, locked whole
    if (map_pins_.count(e.offset)) continue;
    if (!pin(map_ + e.offset, e.capacity)) {
      pin_refused_ = true;  // buffers are borrowed from now on
      return false;
    }
    map_pins_[e.offset] = e.capacity;
    map_pinned_bytes_ += e.capacity;
  }
  return true;
}

std::unique_ptr<AlignedBuffer> SwapStore::TakeBuffer(size_t bytes) {
  {
    std::lock_guard<std::mutex> lock(spare_mu_);
    auto it = spare_.find(bytes);
    if (it != spare_.end()) {
      std::unique_ptr<AlignedBuffer> b = std::move(it->second);
      spare_.erase(it);
      spare_bytes_ -= b->capacity();
      return b;
    }
  }
  auto b = std::make_unique<AlignedBuffer>(bytes);
  std::lock_guard<std::mutex> lock(spare_mu_);
  ++buffers_made_;
  buffer_bytes_made_ += b->capacity();
  if (PinHook pin = pin_.load(); pin != nullptr && pin(b->data(), b->capacity()))
    b->set_on_free(unpin_);  // unlocked only where locked
  return b;
}

void SwapStore::GiveBuffer(std::unique_ptr<AlignedBuffer> buffer) {
  if (!buffer) return;
  std::lock_guard<std::mutex> lock(spare_mu_);
  if (spare_bytes_ + buffer->capacity() > config_.pinned_budget) return;  // freed here
  spare_bytes_ += buffer->capacity();
  size_t size = buffer->size();
  spare_.emplace(size, std::move(buffer));
}

void SwapStore::SetFaultAfterWrites(int64_t writes) {
  std::lock_guard<std::mutex> lock(mu_);
  fault_writes_ = writes;
}

void SwapStore::SetFaultFreeBytes(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  fault_free_bytes_ = bytes;
}

}  // namespace zinfjax
