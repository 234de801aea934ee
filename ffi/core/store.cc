#include "core/store.h"

#include <algorithm>

#include <fcntl.h>
#include <pthread.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <climits>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>

#include "core/errors.h"

namespace zinfjax {

struct SwapStore::Job {
  std::function<void(Job&, AioBackend&)> work;
  bool done = false;
  std::exception_ptr error;
  std::unique_ptr<AlignedBuffer> result;  // a read's own buffer, or a detached write's copy
  bool detached = false;                  // nobody waits: the store finishes it itself
  bool write = false;                     // completing it bumps a generation
  std::condition_variable cv;             // its own waiter: a read wakes only its caller
  uint64_t ticket = 0;
  std::vector<std::string> keys;
  std::vector<ShardEntry> entries;  // what a read expects
};

namespace {

// Where each shard of a job lies in the job's own buffer: 4 KiB-aligned, so
// reads into it skip the staging copy.
std::vector<size_t> Offsets(const std::vector<ShardEntry>& entries, size_t* total) {
  std::vector<size_t> at;
  size_t pos = 0;
  for (const ShardEntry& e : entries) {
    at.push_back(pos);
    pos += AlignUp(e.nbytes);
  }
  *total = pos;
  return at;
}

void MakeDirs(const std::string& path) {
  std::string partial;
  std::stringstream ss(path);
  std::string part;
  if (!path.empty() && path[0] == '/') partial = "/";
  while (std::getline(ss, part, '/')) {
    if (part.empty()) continue;
    partial += part + "/";
    if (mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST)
      throw EngineError(SysError("cannot create nvme_path folder " + partial +
                                 " (choose a writable nvme_path)", errno));
  }
}

std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s;
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s;
}

std::string Describe(const std::string& dtype, const std::vector<int64_t>& shape) {
  return dtype + "[" + ShapeString(shape) + "]";
}

uint64_t FreeBytes(const std::string& folder) {
  struct statvfs s;
  if (statvfs(folder.c_str(), &s) != 0) return 0;
  return static_cast<uint64_t>(s.f_bavail) * s.f_frsize;
}

std::mutex registry_mu;
// Weak: the table finds a store while its owner (Python's AioStore) keeps it, never keeps it.
std::map<int64_t, std::weak_ptr<SwapStore>>& Registry() {
  static auto* registry = new std::map<int64_t, std::weak_ptr<SwapStore>>();
  return *registry;
}
int64_t next_handle = 1;

}  // namespace

// The stripe files and the manifest (or an empty one for a fresh store).
void SwapStore::OpenFiles() {
  direct_ = config_.direct;
  for (const auto& folder : folders_) {
    std::string file = folder + "/swap.bin";
    int flags = O_RDWR | O_CREAT | O_CLOEXEC;
    int fd = direct_ ? open(file.c_str(), flags | O_DIRECT, 0644) : -1;
    if (fd < 0 && direct_ && errno == EINVAL) direct_ = false;  // e.g. tmpfs: no O_DIRECT
    if (fd < 0) fd = open(file.c_str(), flags, 0644);
    if (fd < 0) throw EngineError(SysError("cannot open swap file " + file, errno));
    struct stat st;
    fstat(fd, &st);
    fds_.push_back(fd);
    file_sizes_.push_back(static_cast<uint64_t>(st.st_size));
  }
  if (!direct_) {  // all files buffered if any must be
    for (size_t i = 0; i < fds_.size(); ++i) fcntl(fds_[i], F_SETFL, fcntl(fds_[i], F_GETFL) & ~O_DIRECT);
  }
  pool_ = std::make_unique<PinnedPool>(std::max(config_.pinned_budget, config_.block_size),
                                       config_.block_size);
  if (config_.fresh) {
    WriteManifestLocked();  // an empty manifest: the old shards are gone from now on
  } else {
    LoadManifest();
  }
}

SwapStore::SwapStore(StoreConfig config) : config_(std::move(config)) {
  if (config_.paths.empty()) throw EngineError("the swap store needs at least one nvme_path");
  if (config_.block_size < kAlignment || config_.block_size % kAlignment)
    throw EngineError("block_size must be a multiple of " + std::to_string(kAlignment) +
                      " bytes, got " + std::to_string(config_.block_size));
  if (config_.queue_depth < 1 || config_.io_threads < 1)
    throw EngineError("queue_depth and io_threads must be >= 1");
  for (const auto& p : config_.paths) {
    std::string folder = p + "/rank" + std::to_string(config_.rank);
    MakeDirs(folder);
    if (access(folder.c_str(), W_OK) != 0)
      throw EngineError(SysError("nvme_path folder " + folder +
                                 " is not writable (choose a writable nvme_path)", errno));
    folders_.push_back(folder);
  }
  // every stripe folder is this store's alone: refuse one named twice, lock each
  std::map<std::string, std::string> real;
  for (const auto& folder : folders_) {
    char buf[PATH_MAX];
    std::string r = realpath(folder.c_str(), buf) ? std::string(buf) : folder;
    auto [it, fresh] = real.emplace(r, folder);
    if (!fresh)
      throw EngineError("nvme_path names the folder " + r + " twice (as " + it->second + " and " +
                        folder + "); give each stripe its own folder, ideally on its own drive");
  }
  for (const auto& folder : folders_) {
    std::string lock_path = folder + "/.lock";
    int fd = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    int err = errno;
    if (fd >= 0 && flock(fd, LOCK_EX | LOCK_NB) == 0) {
      std::string pid = std::to_string(getpid());
      if (ftruncate(fd, 0) == 0 && pwrite(fd, pid.data(), pid.size(), 0) < 0) {
        // the pid is only informative
      }
      lock_fds_.push_back(fd);
      continue;
    }
    char owner[32] = {0};
    ssize_t n = fd >= 0 ? pread(fd, owner, sizeof(owner) - 1, 0) : -1;
    if (fd >= 0) close(fd);
    for (int held : lock_fds_) close(held);  // the constructor fails: release what it took
    lock_fds_.clear();
    if (fd < 0) throw EngineError(SysError("cannot open lock file " + lock_path, err));
    std::string pid = n > 0 ? std::string(owner) : std::string("unknown");
    while (!pid.empty() && (pid.back() == '\n' || pid.back() == ' ')) pid.pop_back();
    if (pid == std::to_string(getpid()))
      throw StoreLocked("swap folder " + folder + " is in use by this process (pid " + pid +
                        "): another swap store on it is still open; close it (or the "
                        "TrainState holding it: state.close()) first, or give this one its "
                        "own nvme_path");
    throw StoreLocked("swap folder " + folder + " is in use by another process (pid " + pid +
                      "); give each process its own nvme_path or rank");
  }

  std::vector<std::unique_ptr<AioBackend>> backends;
  try {
    OpenFiles();
    for (unsigned i = 0; i < config_.io_threads; ++i)
      backends.push_back(MakeBackend(config_.backend, config_.queue_depth, config_.fallback_threads));
  } catch (...) {  // the constructor fails: no destructor runs, so release files and locks here
    for (int fd : fds_) close(fd);
    for (int fd : lock_fds_) close(fd);
    throw;
  }
  backend_name_ = backends[0]->name();
  for (unsigned i = 0; i < config_.io_threads; ++i) {
    drivers_.emplace_back([this, b = std::shared_ptr<AioBackend>(std::move(backends[i]))] {
      pthread_setname_np(pthread_self(), "zinfjax-io");  // visible in top -H and /proc
      if (config_.io_nice > 0) {  // Linux: per thread; raising it needs no privilege
        id_t tid = static_cast<id_t>(syscall(SYS_gettid));
        errno = 0;
        int now = getpriority(PRIO_PROCESS, tid);
        if (errno == 0) setpriority(PRIO_PROCESS, tid, std::min(19, now + config_.io_nice));
      }
      for (;;) {
        std::shared_ptr<Job> job;
        {
          std::unique_lock<std::mutex> lock(mu_);
          work_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
          if (queue_.empty()) return;
          job = queue_.front();
          queue_.pop_front();
        }
        try {
          job->work(*job, *b);
        } catch (...) {
          job->error = std::current_exception();
        }
        {
          std::lock_guard<std::mutex> lock(mu_);
          job->done = true;
          if (job->detached) {
            if (job->error && !deferred_) deferred_ = job->error;
            for (const std::string& key : job->keys)
              if (--detached_[key] == 0) detached_.erase(key);
            detached_bytes_ -= job->result ? job->result->size() : 0;
            GiveBuffer(std::move(job->result));
            jobs_.erase(job->ticket);
          }
        }
        job->cv.notify_all();
        // writes change what the generation, detached-write and Sync waiters wait for
        if (job->write) done_cv_.notify_all();
      }
    });
  }
}

SwapStore::~SwapStore() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : drivers_) t.join();
  try {
    Sync();
  } catch (...) {
  }
  for (int fd : fds_) close(fd);
  for (int fd : lock_fds_) {
    flock(fd, LOCK_UN);
    close(fd);
  }
}

uint64_t SwapStore::Enqueue(std::function<void(Job&)> work, std::vector<std::string> keys,
                            std::vector<ShardEntry> entries, bool write,
                            std::unique_ptr<AlignedBuffer> owned, bool urgent) {
  auto job = std::make_shared<Job>();
  job->keys = std::move(keys);
  job->write = write;
  job->entries = std::move(entries);
  job->detached = owned != nullptr;
  job->result = std::move(owned);
  job->work = [w = std::move(work), this](Job& j, AioBackend& b) {
    current_backend_ = &b;
    w(j);
  };
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t ticket = next_ticket_++;
  job->ticket = ticket;
  jobs_[ticket] = job;
  if (urgent) {
    queue_.push_front(job);  // a read the running program waits on: ahead of bulk transfers
  } else {
    queue_.push_back(job);
  }
  work_cv_.notify_one();
  return ticket;
}

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
  if (fault_free_bytes_ >= 0 && total > static_cast<uint64_t>(fault_free_bytes_)) {
    throw NoSpace("no space left for the swap store in " + folders_[0] + ": it needs " +
                  std::to_string(total) + " more bytes, " + std::to_string(fault_free_bytes_) +
                  " are free; free space or point nvme_path at a larger drive");
  }
  for (uint64_t i = 0; i < n; ++i) {
    if (need[i] <= file_sizes_[i]) continue;
    uint64_t grow = need[i] - file_sizes_[i];
    int rc = fallocate(fds_[i], 0, static_cast<off_t>(file_sizes_[i]), static_cast<off_t>(grow));
    if (rc != 0 && errno == EOPNOTSUPP) rc = ftruncate(fds_[i], static_cast<off_t>(need[i]));
    if (rc != 0) {
      int err = errno;
      std::string file = folders_[i] + "/swap.bin";
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

void SwapStore::Begin(const std::vector<std::string>& prefixes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (txn_) throw EngineError("swap store: Begin inside a transaction (Commit or Rollback first)");
  txn_ = true;
  txn_prefixes_ = prefixes;
}

void SwapStore::Commit() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [key, old] : txn_old_) free_.emplace(old.capacity, old.offset);
  txn_old_.clear();
  txn_pending_.clear();
  txn_ = false;
}

void SwapStore::Rollback() {
  std::unique_lock<std::mutex> lock(mu_);
  // the writes in flight land before their extents are given back
  done_cv_.wait(lock, [&] {
    for (const auto& [ticket, job] : jobs_)
      if (job->write && !job->done) return false;
    return true;
  });
  for (const auto& [key, e] : txn_pending_) {
    free_.emplace(e.capacity, e.offset);
    auto old = txn_old_.find(key);
    if (old != txn_old_.end()) {
      manifest_[key] = old->second;
    } else {
      manifest_.erase(key);
    }
  }
  txn_old_.clear();
  txn_pending_.clear();
  txn_ = false;
}

bool SwapStore::in_transaction() const {
  std::lock_guard<std::mutex> lock(mu_);
  return txn_;
}

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

std::function<void(SwapStore::Job&)> SwapStore::WriteWork(std::vector<std::string> keys,
                                                          std::vector<ShardEntry> entries,
                                                          std::vector<const uint8_t*> srcs) {
  return [this, keys = std::move(keys), entries = std::move(entries),
          srcs = std::move(srcs)](Job&) mutable {
    TransferOptions options{config_.queue_depth, std::chrono::milliseconds(config_.pool_timeout_ms)};
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (fault_writes_ >= 0 && fault_writes_-- == 0)
        throw EngineError("injected write fault (test switch) writing '" + keys[0] + "'");
    }
    std::vector<Extent> extents;
    for (size_t i = 0; i < keys.size(); ++i)
      extents.push_back({BlocksFor(entries[i]), const_cast<uint8_t*>(srcs[i]), entries[i].nbytes, ""});
    std::vector<uint64_t> sums = WriteExtents(*current_backend_, *pool_, extents, options);
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < keys.size(); ++i) {
      bytes_written_ += entries[i].nbytes;
      entries[i].checksum = sums[i];
      manifest_[keys[i]] = entries[i];
      ++generations_[keys[i]];  // waiters are woken when the job is marked done
    }
  };
}

void SwapStore::WriteDetached(const std::string& key, const void* src, size_t nbytes,
                              const std::string& dtype, const std::vector<int64_t>& shape) {
  WriteDetachedMany({{key, const_cast<void*>(src), nbytes, dtype, shape}});
}

void SwapStore::WriteDetachedMany(const std::vector<ShardIo>& shards) {
  DetachedWrite write = BeginDetached(shards);
  for (size_t i = 0; i < shards.size(); ++i)
    std::memcpy(write.buffer->data() + write.at[i], shards[i].data, shards[i].nbytes);
  FinishDetached(std::move(write));
}

SwapStore::DetachedWrite SwapStore::BeginDetached(const std::vector<ShardIo>& shards) {
  if (shards.empty()) throw EngineError("a detached write needs at least one shard");
  size_t nbytes = 0;
  for (const ShardIo& s : shards) nbytes += AlignUp(s.nbytes);
  auto pending = [&] {
    for (const ShardIo& s : shards)
      if (detached_.count(s.key)) return true;
    return false;
  };
  {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] {
      return !pending() && (detached_bytes_ == 0 || detached_bytes_ + nbytes <= config_.pinned_budget);
    });
    for (const ShardIo& s : shards) ++detached_[s.key];
    detached_bytes_ += nbytes;
  }
  DetachedWrite write;
  try {
    write.buffer = TakeBuffer(nbytes);
    size_t at = 0;
    for (const ShardIo& s : shards) {
      write.keys.push_back(s.key);
      write.entries.push_back(Allocate(s.key, s.nbytes, s.dtype, s.shape));
      write.at.push_back(at);
      at += AlignUp(s.nbytes);
    }
  } catch (...) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const ShardIo& s : shards)
        if (--detached_[s.key] == 0) detached_.erase(s.key);
      detached_bytes_ -= nbytes;
    }
    done_cv_.notify_all();
    throw;
  }
  return write;
}

void SwapStore::FinishDetached(DetachedWrite write) noexcept {
  std::vector<const uint8_t*> srcs;
  for (size_t offset : write.at) srcs.push_back(write.buffer->data() + offset);
  const size_t nbytes = write.buffer->size();
  try {
    Enqueue(WriteWork(write.keys, write.entries, std::move(srcs)), write.keys, write.entries,
            /*write=*/true, std::move(write.buffer));
  } catch (...) {  // only allocation can fail here: release the keys, keep the error
    std::lock_guard<std::mutex> lock(mu_);
    if (!deferred_) deferred_ = std::current_exception();
    for (const std::string& key : write.keys)
      if (--detached_[key] == 0) detached_.erase(key);
    detached_bytes_ -= nbytes;
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

void SwapStore::CheckReadable(const std::string& key, const ShardEntry& e,
                              const std::string& dtype, const std::vector<int64_t>& shape,
                              size_t nbytes) const {
  if (e.dtype != dtype || e.shape != shape || e.nbytes != nbytes)
    throw ShardMismatch("shard '" + key + "' was written as " + Describe(e.dtype, e.shape) + " (" +
                        std::to_string(e.nbytes) + " bytes) but is read as " +
                        Describe(dtype, shape) + " (" + std::to_string(nbytes) + " bytes)");
  for (const Block& b : BlocksFor(e)) {
    struct stat st;
    if (fstat(b.fd, &st) != 0) throw EngineError(SysError("fstat swap file", errno));
    uint64_t need = static_cast<uint64_t>(b.file_offset) + b.length;
    if (static_cast<uint64_t>(st.st_size) < need) {
      size_t i = 0;
      while (fds_[i] != b.fd) ++i;
      throw CorruptShard("swap file " + folders_[i] + "/swap.bin is " + std::to_string(st.st_size) +
                         " bytes, shorter than the " + std::to_string(need) + " bytes shard '" +
                         key + "' needs: the file was truncated; restore it from a checkpoint");
    }
  }
}

ShardEntry SwapStore::ReadableEntry(const std::string& key, const std::string& dtype,
                                   const std::vector<int64_t>& shape, size_t nbytes) {
  ShardEntry e = Entry(key);  // waits for its detached writes
  CheckReadable(key, e, dtype, shape, nbytes);
  return e;
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
    for (size_t i = 0; i < keys.size(); ++i) {
      uint8_t* out = dsts[i];
      extents.push_back({BlocksFor(entries[i]), out, entries[i].nbytes,
                         "swap file " + folders_[0] + "/swap.bin (shard '" + keys[i] + "')"});
    }
    std::vector<uint64_t> sums = ReadExtents(*current_backend_, *pool_, extents, options);
    for (size_t i = 0; i < keys.size(); ++i) {
      const ShardEntry& e = entries[i];
      bytes_read_ += e.nbytes;
      if (sums[i] != e.checksum)
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

uint64_t SwapStore::ReadOwnedAsync(const std::vector<std::string>& keys, bool urgent) {
  if (keys.empty()) throw EngineError("ReadOwnedAsync needs at least one shard");
  std::vector<ShardEntry> entries;
  for (const std::string& key : keys) {
    ShardEntry e = Entry(key);  // waits for its detached writes
    CheckReadable(key, e, e.dtype, e.shape, e.nbytes);
    entries.push_back(e);
  }
  return Enqueue(ReadWork(keys, entries, {}), keys, entries, /*write=*/false, nullptr, urgent);
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

std::shared_ptr<SwapStore::Job> SwapStore::FindJob(uint64_t ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = jobs_.find(ticket);
  if (it == jobs_.end()) throw EngineError("unknown or already awaited ticket " + std::to_string(ticket));
  return it->second;
}

void SwapStore::Wait(uint64_t ticket) {
  std::shared_ptr<Job> job = FindJob(ticket);
  {
    std::unique_lock<std::mutex> lock(mu_);
    job->cv.wait(lock, [&] { return job->done; });
    jobs_.erase(ticket);
  }
  if (job->error) std::rethrow_exception(job->error);
}

std::unique_ptr<AlignedBuffer> SwapStore::TakeOwned(uint64_t ticket, const std::vector<ShardIo>& outs,
                                                    std::vector<size_t>* at) {
  std::shared_ptr<Job> job = FindJob(ticket);
  Wait(ticket);
  if (!job->result || outs.size() != job->entries.size())
    throw EngineError("ticket " + std::to_string(ticket) + " holds " +
                      std::to_string(job->result ? job->entries.size() : 0) + " read shards, not " +
                      std::to_string(outs.size()));
  for (size_t i = 0; i < outs.size(); ++i) {
    const ShardEntry& e = job->entries[i];
    if (e.dtype != outs[i].dtype || e.shape != outs[i].shape || e.nbytes != outs[i].nbytes) {
      GiveBuffer(std::move(job->result));
      throw ShardMismatch("shard '" + job->keys[i] + "' was written as " + Describe(e.dtype, e.shape) +
                          " but is read as " + Describe(outs[i].dtype, outs[i].shape));
    }
  }
  size_t total = 0;
  *at = Offsets(job->entries, &total);
  return std::move(job->result);
}

void SwapStore::TakeResults(uint64_t ticket, const std::vector<ShardIo>& outs) {
  std::vector<size_t> at;
  std::unique_ptr<AlignedBuffer> buffer = TakeOwned(ticket, outs, &at);
  for (size_t i = 0; i < outs.size(); ++i) std::memcpy(outs[i].data, buffer->data() + at[i], outs[i].nbytes);
  GiveBuffer(std::move(buffer));
}

void SwapStore::SetPinHooks(void (*pin)(void*, size_t), AlignedBuffer::FreeHook unpin) {
  std::lock_guard<std::mutex> lock(spare_mu_);
  if (pin_ == pin) return;
  pin_ = pin;
  unpin_ = unpin;
  for (auto& [size, b] : spare_) {  // the spares made before: pinned now
    pin_(b->data(), b->capacity());
    b->set_on_free(unpin_);
  }
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
  if (pin_) {
    pin_(b->data(), b->capacity());
    b->set_on_free(unpin_);
  }
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

void SwapStore::LoadManifest() {
  std::ifstream in(folders_[0] + "/manifest.tsv");
  if (!in) return;
  std::string line;
  std::getline(in, line);
  std::istringstream header(line);
  std::string magic;
  int version = 0;
  uint64_t block = 0, files = 0;
  header >> magic >> version >> block >> files;
  if (magic != "zinfjax-swap" || version != 1)
    throw CorruptShard("swap manifest " + folders_[0] + "/manifest.tsv is not a zinfjax v1 manifest");
  if (block != config_.block_size || files != fds_.size())
    throw CorruptShard("swap manifest " + folders_[0] + "/manifest.tsv was written with block size " +
                       std::to_string(block) + " over " + std::to_string(files) +
                       " nvme paths; reopen it with the same nvme paths and block size");
  while (std::getline(in, line)) {
    std::istringstream row(line);
    std::string key, dtype, shape;
    ShardEntry e;
    if (!std::getline(row, key, '\t') || !std::getline(row, e.dtype, '\t') ||
        !std::getline(row, shape, '\t') || !(row >> e.offset >> e.nbytes >> e.capacity >> std::hex >> e.checksum))
      throw CorruptShard("swap manifest " + folders_[0] + "/manifest.tsv has a malformed line: " + line);
    std::stringstream dims(shape);
    std::string d;
    while (std::getline(dims, d, ',')) e.shape.push_back(std::stoll(d));
    manifest_[key] = e;
    next_offset_ = std::max(next_offset_, e.offset + e.capacity);
  }
}

void SwapStore::WriteManifestLocked() {
  std::string path = folders_[0] + "/manifest.tsv", tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << "zinfjax-swap 1 " << config_.block_size << " " << fds_.size() << "\n";
    for (const auto& [key, e] : manifest_)
      out << key << '\t' << e.dtype << '\t' << ShapeString(e.shape) << '\t' << e.offset << ' '
          << e.nbytes << ' ' << e.capacity << ' ' << std::hex << e.checksum << std::dec << "\n";
    if (!out) throw NoSpace("cannot write swap manifest " + tmp + " (disk full?)");
  }
  int fd = open(tmp.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    fsync(fd);
    close(fd);
  }
  if (rename(tmp.c_str(), path.c_str()) != 0)
    throw EngineError(SysError("cannot replace swap manifest " + path, errno));
}

void SwapStore::Sync() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return detached_.empty(); });
  }
  for (int fd : fds_) fdatasync(fd);
  std::lock_guard<std::mutex> lock(mu_);
  WriteManifestLocked();
}

bool SwapStore::Has(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  return manifest_.count(key) > 0;
}

ShardEntry SwapStore::Entry(const std::string& key) const {
  std::unique_lock<std::mutex> lock(mu_);
  WaitWritten(lock, key);
  auto it = manifest_.find(key);
  if (it == manifest_.end())
    throw MissingShard("no shard '" + key + "' in the swap manifest of " + folders_[0] +
                       ": it was never written there (or the manifest belongs to another run)");
  return it->second;
}

std::vector<std::string> SwapStore::Keys() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> keys;
  for (const auto& kv : manifest_) keys.push_back(kv.first);
  return keys;
}

std::vector<std::string> SwapStore::files() const {
  std::vector<std::string> out;
  for (const auto& f : folders_) out.push_back(f + "/swap.bin");
  return out;
}

uint64_t SwapStore::bytes_used() const {
  std::lock_guard<std::mutex> lock(mu_);
  return next_offset_;
}

void SwapStore::SetFaultAfterWrites(int64_t writes) {
  std::lock_guard<std::mutex> lock(mu_);
  fault_writes_ = writes;
}

void SwapStore::SetFaultFreeBytes(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  fault_free_bytes_ = bytes;
}

void SwapStore::DeferError(std::exception_ptr error) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!deferred_) deferred_ = error;
}

void SwapStore::RaiseDeferred() {
  std::exception_ptr error;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::swap(error, deferred_);
  }
  if (error) std::rethrow_exception(error);
}

int64_t RegisterStore(std::shared_ptr<SwapStore> store) {
  std::lock_guard<std::mutex> lock(registry_mu);
  int64_t handle = next_handle++;
  for (auto it = Registry().begin(); it != Registry().end();)  // forget stores that are gone
    it = it->second.expired() ? Registry().erase(it) : std::next(it);
  Registry()[handle] = store;
  return handle;
}

std::shared_ptr<SwapStore> LookupStore(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = Registry().find(handle);
  return it == Registry().end() ? nullptr : it->second.lock();
}

void UnregisterStore(int64_t handle) {
  std::lock_guard<std::mutex> lock(registry_mu);
  Registry().erase(handle);
}

}  // namespace zinfjax
