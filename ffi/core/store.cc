// The swap store's life and I/O queue: opening the stripe files, the driver
// threads that run queued jobs, waiting on tickets, deferred errors, and the
// engine's handle table. Allocation is in store_extents.cc, transactions in
// store_txn.cc, the manifest in store_manifest.cc, reads and writes in
// store_io.cc.
#include "core/store.h"

#include <pthread.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>

#include <algorithm>
#include <climits>
#include <cstdlib>
#include <cstring>

#include "core/errors.h"
#include "core/store_internal.h"

namespace zinfjax {

namespace {

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
  pool_ = std::make_unique<PinnedPool>(std::max(config_.pinned_budget, config_.block_size),
                                       config_.block_size);
  if (config_.memory) {  // one anonymous file in RAM, mapped once: nothing to load or lock
    direct_ = false;
    int fd = memfd_create("zinfjax-host-store", MFD_CLOEXEC);
    if (fd < 0) throw EngineError(SysError("cannot create the host-memory store", errno));
    fds_.push_back(fd);
    file_sizes_.push_back(0);
    void* map = mmap(nullptr, kMemoryMapBytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE,
                     fd, 0);
    if (map == MAP_FAILED) throw EngineError(SysError("cannot map the host-memory store", errno));
    map_ = static_cast<uint8_t*>(map);
    return;
  }
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
  // a logical stripe k lies in file k % n at (k / n) * unit: past the largest file's size
  // from n times it on (what those files held before may be anything)
  uint64_t largest = *std::max_element(file_sizes_.begin(), file_sizes_.end());
  zero_from_ = AlignUp(largest, config_.block_size) * fds_.size();
  if (config_.fresh) {
    WriteManifestLocked();  // an empty manifest: the old shards are gone from now on
  } else {
    LoadManifest();
  }
}

SwapStore::SwapStore(StoreConfig config) : config_(std::move(config)) {
  const char* lend = std::getenv("ZINFJAX_LEND_MAPPING");
  lend_mapping_ = lend == nullptr || std::string(lend) != "0";
  if (config_.memory) config_.paths.clear();  // no folders: see OpenFiles
  if (config_.paths.empty() && !config_.memory)
    throw EngineError("the swap store needs at least one nvme_path");
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

  if (config_.memory) folders_.push_back("(host memory)");  // names it in messages
  std::vector<std::unique_ptr<AioBackend>> backends;
  try {
    OpenFiles();
    for (unsigned i = 0; i < config_.io_threads; ++i)
      backends.push_back(MakeBackend(config_.backend, config_.queue_depth, config_.fallback_threads));
  } catch (...) {  // the constructor fails: no destructor runs, so release files and locks here
    if (map_) munmap(map_, kMemoryMapBytes);
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
            ReleaseDetachedLocked(job->keys, job->result ? job->result->size() : 0);
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
  for (const auto& [offset, bytes] : map_pins_) unpin_(map_ + offset);  // before the pages go
  if (map_) munmap(map_, kMemoryMapBytes);
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
