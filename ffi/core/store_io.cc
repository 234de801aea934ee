// The swap store's reads and writes: the jobs that move shards, detached
// writes, owned reads and the generations readers on other threads wait for.
#include "core/store.h"

#include <algorithm>
#include <cstring>

#include "core/errors.h"
#include "core/hash.h"
#include "core/store_internal.h"
#include "core/workers.h"

namespace zinfjax {

uint64_t SwapStore::WriteAsync(const std::string& key, const void* src, size_t nbytes,
                               const std::string& dtype, const std::vector<int64_t>& shape) {
  ShardEntry e = Allocate(key, nbytes, dtype, shape);
  return Enqueue(WriteWork({key}, {e}, {static_cast<const uint8_t*>(src)}), {key}, {e}, /*write=*/true);
}

uint64_t SwapStore::WriteManyAsync(const std::vector<ShardIo>& shards) {
  if (shards.empty()) throw EngineError("WriteManyAsync needs at least one shard");
  std::vector<std::string> keys;
  std::vector<ShardEntry> entries;
  std::vector<const uint8_t*> srcs;
  for (const ShardIo& s : shards) {
    keys.push_back(s.key);
    entries.push_back(Allocate(s.key, s.nbytes, s.dtype, s.shape));
    srcs.push_back(static_cast<const uint8_t*>(s.data));
  }
  return Enqueue(WriteWork(keys, entries, std::move(srcs)), keys, entries, /*write=*/true);
}

uint64_t SwapStore::WriteZerosAsync(const std::string& key, const void* src, size_t nbytes,
                                    const std::string& dtype, const std::vector<int64_t>& shape) {
  uint64_t fresh_from;
  {
    std::lock_guard<std::mutex> lock(mu_);
    fresh_from = std::max(next_offset_, zero_from_);
  }
  ShardEntry e = Allocate(key, nbytes, dtype, shape);
  // at or past the bump offset read before: taken from it just now, never written since
  const uint8_t* data = e.offset >= fresh_from ? nullptr : static_cast<const uint8_t*>(src);
  return Enqueue(WriteWork({key}, {e}, {data}, static_cast<const uint8_t*>(src)), {key}, {e},
                 /*write=*/true);
}

uint64_t SwapStore::ZeroChecksum(const uint8_t* zeros, size_t nbytes) {
  {
    std::lock_guard<std::mutex> lock(zero_sums_mu_);
    auto it = zero_sums_.find(nbytes);
    if (it != zero_sums_.end()) return it->second;
  }
  Hasher hasher;
  hasher.Update(zeros, nbytes);
  std::lock_guard<std::mutex> lock(zero_sums_mu_);
  return zero_sums_[nbytes] = hasher.Digest();
}

std::function<void(SwapStore::Job&)> SwapStore::WriteWork(std::vector<std::string> keys,
                                                          std::vector<ShardEntry> entries,
                                                          std::vector<const uint8_t*> srcs,
                                                          const uint8_t* zeros) {
  return [this, keys = std::move(keys), entries = std::move(entries), srcs = std::move(srcs),
          zeros](Job&) mutable {
    TransferOptions options{config_.queue_depth, std::chrono::milliseconds(config_.pool_timeout_ms)};
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (fault_writes_ >= 0 && fault_writes_-- == 0)
        throw EngineError("injected write fault (test switch) writing '" + keys[0] + "'");
    }
    // a null source: zeros already there (WriteZerosAsync), only their checksum to make
    std::vector<uint64_t> sums(keys.size(), 0);
    uint64_t left = 0;
    if (config_.memory) {  // host RAM: into the mapping; no checksum (its reads check none)
      for (size_t i = 0; i < keys.size(); ++i) {
        if (srcs[i] != nullptr) ParallelCopy(map_ + entries[i].offset, srcs[i], entries[i].nbytes);
        else left += entries[i].nbytes;
      }
    } else {
      std::vector<Extent> extents;
      std::vector<size_t> at;
      for (size_t i = 0; i < keys.size(); ++i) {
        if (srcs[i] == nullptr) {
          sums[i] = ZeroChecksum(zeros, entries[i].nbytes);
          left += entries[i].nbytes;
          continue;
        }
        at.push_back(i);
        extents.push_back({BlocksFor(entries[i]), const_cast<uint8_t*>(srcs[i]), entries[i].nbytes, ""});
      }
      std::vector<uint64_t> written = WriteExtents(*current_backend_, *pool_, extents, options);
      for (size_t j = 0; j < at.size(); ++j) sums[at[j]] = written[j];
    }
    std::lock_guard<std::mutex> lock(mu_);
    PublishLocked(keys, entries, sums, left);  // waiters are woken when the job is marked done
  };
}

void SwapStore::PublishLocked(const std::vector<std::string>& keys, std::vector<ShardEntry>& entries,
                              const std::vector<uint64_t>& sums, uint64_t left_zero) {
  uint64_t nbytes = 0;
  for (size_t i = 0; i < keys.size(); ++i) {
    nbytes += entries[i].nbytes;
    entries[i].checksum = sums[i];
    manifest_[keys[i]] = entries[i];
    ++generations_[keys[i]];
  }
  bytes_written_ += nbytes - left_zero;
  bytes_left_zero_ += left_zero;
}

void SwapStore::ReleaseDetachedLocked(const std::vector<std::string>& keys, size_t nbytes) {
  for (const std::string& key : keys)
    if (--detached_[key] == 0) detached_.erase(key);
  detached_bytes_ -= nbytes;
}

void SwapStore::WriteDetached(const std::string& key, const void* src, size_t nbytes,
                              const std::string& dtype, const std::vector<int64_t>& shape) {
  WriteDetachedMany({{key, const_cast<void*>(src), nbytes, dtype, shape}});
}

void SwapStore::WriteDetachedMany(const std::vector<ShardIo>& shards, bool in_place) {
  DetachedWrite write = BeginDetached(shards, in_place);
  for (size_t i = 0; i < shards.size(); ++i)
    std::memcpy(write.base + write.at[i], shards[i].data, shards[i].nbytes);
  FinishDetached(std::move(write));
}

SwapStore::DetachedWrite SwapStore::BeginDetached(const std::vector<ShardIo>& shards,
                                                  bool in_place) {
  if (shards.empty()) throw EngineError("a detached write needs at least one shard");
  bool lent = in_place && LendsMapping();
  size_t nbytes = 0;  // of a buffer, where the mapping is not lent (it takes no room)
  for (const ShardIo& s : shards) nbytes += AlignUp(s.nbytes);
  size_t held = lent ? 0 : nbytes;
  auto pending = [&] {
    for (const ShardIo& s : shards)
      if (detached_.count(s.key)) return true;
    return false;
  };
  {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] {
      return !pending() && (detached_bytes_ == 0 || detached_bytes_ + held <= config_.pinned_budget);
    });
    for (const ShardIo& s : shards) ++detached_[s.key];
    detached_bytes_ += held;
  }
  DetachedWrite write;
  try {
    for (const ShardIo& s : shards) {
      write.keys.push_back(s.key);
      write.entries.push_back(Allocate(s.key, s.nbytes, s.dtype, s.shape));
    }
    if (lent && !PinExtents(write.entries)) {  // refused: a buffer after all, this once
      lent = false;
      std::lock_guard<std::mutex> lock(mu_);
      detached_bytes_ += nbytes;
      held = nbytes;
    }
    if (!lent) {
      write.buffer = TakeBuffer(nbytes);
      write.base = write.buffer->data();
    } else {
      write.base = map_;
    }
    size_t at = 0;
    for (size_t i = 0; i < shards.size(); ++i) {
      write.at.push_back(lent ? write.entries[i].offset : at);
      at += AlignUp(shards[i].nbytes);
    }
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const ShardIo& s : shards)
        if (--detached_[s.key] == 0) detached_.erase(s.key);
      detached_bytes_ -= held;
    }
    done_cv_.notify_all();
    throw;
  }
  return write;
}

void SwapStore::FinishDetached(DetachedWrite write) noexcept {
  if (!write.buffer) {  // the mapping was lent: the shards are in place, published here
    {
      std::lock_guard<std::mutex> lock(mu_);
      PublishLocked(write.keys, write.entries, std::vector<uint64_t>(write.keys.size(), 0));
      ReleaseDetachedLocked(write.keys, 0);
    }
    done_cv_.notify_all();
    return;
  }
  std::vector<const uint8_t*> srcs;
  for (size_t offset : write.at) srcs.push_back(write.base + offset);
  const size_t nbytes = write.buffer->size();
  try {
    Enqueue(WriteWork(write.keys, write.entries, std::move(srcs)), write.keys, write.entries,
            /*write=*/true, std::move(write.buffer));
  } catch (...) {  // only allocation can fail here: release the keys, keep the error
    std::lock_guard<std::mutex> lock(mu_);
    if (!deferred_) deferred_ = std::current_exception();
    ReleaseDetachedLocked(write.keys, nbytes);
  }
  done_cv_.notify_all();
}

void SwapStore::WaitWritten(std::unique_lock<std::mutex>& lock, const std::string& key) const {
  done_cv_.wait(lock, [&] { return !detached_.count(key); });
}

uint64_t SwapStore::Generation(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = generations_.find(key);
  return it == generations_.end() ? 0 : it->second;
}

bool SwapStore::WaitGeneration(const std::string& key, uint64_t generation, int timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  return done_cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] {
    auto it = generations_.find(key);
    return it != generations_.end() && it->second >= generation;
  });
}

std::function<void(SwapStore::Job&)> SwapStore::ReadWork(std::vector<std::string> keys,
                                                         std::vector<ShardEntry> entries,
                                                         std::vector<uint8_t*> dsts) {
  return [this, keys = std::move(keys), entries = std::move(entries),
          dsts = std::move(dsts)](Job& job) mutable {
    TransferOptions options{config_.queue_depth, std::chrono::milliseconds(config_.pool_timeout_ms)};
    std::vector<Extent> extents;
    if (dsts.empty()) {  // into the job's own buffer (TakeResults copies the shards out)
      size_t total = 0;
      std::vector<size_t> at = Offsets(entries, &total);
      job.result = TakeBuffer(total);
      for (size_t offset : at) dsts.push_back(job.result->data() + offset);
    }
    if (config_.memory) {  // host RAM: out of the mapping (updated in place by View: no checksum)
      for (size_t i = 0; i < keys.size(); ++i) {
        ParallelCopy(dsts[i], map_ + entries[i].offset, entries[i].nbytes);
        bytes_read_ += entries[i].nbytes;
      }
      return;
    }
    for (size_t i = 0; i < keys.size(); ++i) {
      uint8_t* out = dsts[i];
      extents.push_back({BlocksFor(entries[i]), out, entries[i].nbytes,
                         "swap file " + folders_[0] + "/swap.bin (shard '" + keys[i] + "')"});
    }
    std::vector<uint64_t> sums = ReadExtents(*current_backend_, *pool_, extents, options);
    for (size_t i = 0; i < keys.size(); ++i) {
      const ShardEntry& e = entries[i];
      bytes_read_ += e.nbytes;
      if (sums[i] != e.checksum && !config_.memory)  // memory: updated in place (View)
        throw CorruptShard("checksum mismatch for shard '" + keys[i] + "' (" +
                           std::to_string(e.nbytes) + " bytes at offset " +
                           std::to_string(e.offset) + ") in " +
                           (fds_.size() > 1 ? "the swap files under " : "") + folders_[0] +
                           "/swap.bin: the swap file is corrupted; restore it from a checkpoint");
    }
  };
}

uint64_t SwapStore::ReadAsync(const std::string& key, void* dst, size_t nbytes,
                              const std::string& dtype, const std::vector<int64_t>& shape,
                              bool urgent) {
  if (dst == nullptr) throw EngineError("ReadAsync needs a destination for '" + key + "'");
  ShardEntry e = ReadableEntry(key, dtype, shape, nbytes);
  return Enqueue(ReadWork({key}, {e}, {static_cast<uint8_t*>(dst)}), {key}, {e}, /*write=*/false,
                 nullptr, urgent);
}

uint64_t SwapStore::ReadOwnedAsync(const std::vector<std::string>& keys, bool urgent,
                                   bool in_place) {
  if (keys.empty()) throw EngineError("ReadOwnedAsync needs at least one shard");
  std::vector<ShardEntry> entries;
  for (const std::string& key : keys) {
    ShardEntry e = Entry(key);  // waits for its detached writes
    CheckReadable(key, e, e.dtype, e.shape, e.nbytes);
    entries.push_back(e);
  }
  if (!(in_place && LendsMapping() && PinExtents(entries)))
    return Enqueue(ReadWork(keys, entries, {}), keys, entries, /*write=*/false, nullptr, urgent);
  auto job = std::make_shared<Job>();  // nothing to move: a finished job that lends the mapping
  job->keys = keys;
  job->entries = std::move(entries);
  job->lent = job->done = true;
  for (const ShardEntry& e : job->entries) bytes_read_ += e.nbytes;
  std::lock_guard<std::mutex> lock(mu_);
  job->ticket = next_ticket_++;
  jobs_[job->ticket] = job;
  return job->ticket;
}

uint64_t SwapStore::ReadManyAsync(const std::vector<ShardIo>& shards, bool urgent) {
  if (shards.empty()) throw EngineError("ReadManyAsync needs at least one shard");
  std::vector<std::string> keys;
  std::vector<ShardEntry> entries;
  std::vector<uint8_t*> dsts;
  for (const ShardIo& s : shards) {
    if (s.data == nullptr) throw EngineError("ReadManyAsync needs a destination for '" + s.key + "'");
    keys.push_back(s.key);
    entries.push_back(ReadableEntry(s.key, s.dtype, s.shape, s.nbytes));
    dsts.push_back(static_cast<uint8_t*>(s.data));
  }
  return Enqueue(ReadWork(keys, entries, std::move(dsts)), keys, entries, /*write=*/false, nullptr,
                 urgent);
}

SwapStore::OwnedRead SwapStore::TakeRead(uint64_t ticket) {
  std::shared_ptr<Job> job = FindJob(ticket);
  Wait(ticket);
  OwnedRead read{job->keys, job->entries, {}, std::move(job->result)};
  if (job->lent) {
    read.base = map_;
    for (const ShardEntry& e : read.entries) read.at.push_back(e.offset);
    return read;
  }
  if (!read.buffer) throw EngineError("ticket " + std::to_string(ticket) + " holds no owned read");
  read.base = read.buffer->data();
  size_t total = 0;
  read.at = Offsets(read.entries, &total);
  return read;
}

void SwapStore::CheckRead(const OwnedRead& read, const std::vector<ShardIo>& outs) {
  if (outs.size() != read.entries.size())
    throw EngineError("a read of " + std::to_string(read.entries.size()) + " shards is taken as " +
                      std::to_string(outs.size()));
  for (size_t i = 0; i < outs.size(); ++i) {
    const ShardEntry& e = read.entries[i];
    if (e.dtype != outs[i].dtype || e.shape != outs[i].shape || e.nbytes != outs[i].nbytes)
      throw ShardMismatch("shard '" + read.keys[i] + "' was written as " + Describe(e.dtype, e.shape) +
                          " but is read as " + Describe(outs[i].dtype, outs[i].shape));
  }
}

bool SwapStore::Done(uint64_t ticket) {
  std::shared_ptr<Job> job = FindJob(ticket);
  std::lock_guard<std::mutex> lock(mu_);
  return job->done;
}

void SwapStore::TakeResults(uint64_t ticket, const std::vector<ShardIo>& outs) {
  OwnedRead read = TakeRead(ticket);
  try {
    CheckRead(read, outs);
  } catch (...) {
    GiveBuffer(std::move(read.buffer));
    throw;
  }
  for (size_t i = 0; i < outs.size(); ++i)
    std::memcpy(outs[i].data, read.base + read.at[i], outs[i].nbytes);
  GiveBuffer(std::move(read.buffer));
}

}  // namespace zinfjax
