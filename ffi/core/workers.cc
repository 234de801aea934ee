#include "core/workers.h"

#include <pthread.h>
#include <sys/resource.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>

namespace zinfjax {
namespace {

// One call's pieces. Shared by the caller and the workers that join it, so a worker that
// ends last may still touch it after the caller has returned.
struct Job {
  const std::function<void(size_t, size_t)>* body;
  size_t n, block, pieces;
  std::atomic<size_t> next{0};  // the next piece to claim
  std::atomic<size_t> done{0};  // pieces finished
  int seats;                    // workers that may still join (guarded by the pool's mutex)
  std::mutex mu;
  std::condition_variable finished;
};

// Claims and runs pieces until none is left; the thread that finishes the last one wakes the
// caller.
void Work(Job& job) {
  size_t mine = 0;
  for (size_t i; (i = job.next.fetch_add(1, std::memory_order_relaxed)) < job.pieces; ++mine) {
    size_t begin = i * job.block;
    (*job.body)(begin, std::min(job.n, begin + job.block));
  }
  if (mine && job.done.fetch_add(mine, std::memory_order_acq_rel) + mine == job.pieces) {
    std::lock_guard<std::mutex> lock(job.mu);
    job.finished.notify_all();
  }
}

class Pool {
 public:
  void Run(size_t n, size_t block, size_t threads,
           const std::function<void(size_t, size_t)>& body) {
    auto job = std::make_shared<Job>();
    job->body = &body;
    job->n = n;
    job->block = block;
    job->pieces = (n + block - 1) / block;
    job->seats = static_cast<int>(std::min(threads, job->pieces) - 1);
    {
      std::lock_guard<std::mutex> lock(mu_);
      while (workers_ < static_cast<size_t>(job->seats)) {
        std::thread([this] { Loop(); }).detach();  // kept for the life of the process
        ++workers_;
      }
      jobs_.push_back(job);
    }
    for (int i = 0; i < job->seats; ++i) wake_.notify_one();
    Work(*job);
    if (job->done.load(std::memory_order_acquire) != job->pieces) {
      std::unique_lock<std::mutex> lock(job->mu);
      job->finished.wait(lock, [&] {
        return job->done.load(std::memory_order_acquire) == job->pieces;
      });
    }
    std::lock_guard<std::mutex> lock(mu_);  // seats no worker took: the job leaves the queue
    auto it = std::find(jobs_.begin(), jobs_.end(), job);
    if (it != jobs_.end()) jobs_.erase(it);
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      wake_.wait(lock, [&] { return !jobs_.empty(); });
      std::shared_ptr<Job> job = jobs_.front();
      if (--job->seats <= 0) jobs_.pop_front();
      lock.unlock();
      Work(*job);
      job.reset();
      lock.lock();
    }
  }

  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<std::shared_ptr<Job>> jobs_;
  size_t workers_ = 0;
};

// A pool per nice value of the callers (Linux keeps nice per thread), made on first use by a
// caller of that value, whose workers inherit it: a call from a thread zinfjax runs at a lower
// priority (ZeroConfig.host_nice) is done at that priority, as with threads it started
// itself. A child of fork() has none of the parent's worker threads (and maybe a mutex one of
// them held): it drops the parent's pools, leaked, and makes its own.
constexpr int kNiceMin = -20, kNiceMax = 19;
std::atomic<Pool*> g_pools[kNiceMax - kNiceMin + 1];

int CallerNice() {
  errno = 0;
  int nice = getpriority(PRIO_PROCESS, 0);  // Linux: the calling thread's
  if (errno != 0) nice = 0;
  return std::min(kNiceMax, std::max(kNiceMin, nice));
}

Pool& SharedPool() {
  static const int registered = pthread_atfork(nullptr, nullptr, [] {
    for (auto& pool : g_pools) pool.store(nullptr);
  });
  (void)registered;
  std::atomic<Pool*>& slot = g_pools[CallerNice() - kNiceMin];
  Pool* pool = slot.load(std::memory_order_acquire);
  if (pool) return *pool;
  Pool* fresh = new Pool();
  if (slot.compare_exchange_strong(pool, fresh, std::memory_order_acq_rel)) return *fresh;
  delete fresh;
  return *pool;
}

}  // namespace

void ParallelBlocks(size_t n, size_t block, size_t min_share, int threads,
                    const std::function<void(size_t, size_t)>& body) {
  if (n == 0) return;
  block = std::max<size_t>(block, 1);
  size_t want = threads > 0 ? static_cast<size_t>(threads)
                            : std::max(1u, std::thread::hardware_concurrency());
  want = std::min(want, std::max<size_t>(1, n / std::max<size_t>(min_share, 1)));
  if (want == 1 || n <= block) {
    for (size_t begin = 0; begin < n; begin += block) body(begin, std::min(n, begin + block));
    return;
  }
  SharedPool().Run(n, block, want, body);
}

void ParallelCopy(void* dst, const void* src, size_t n, int threads) {
  constexpr size_t kPiece = size_t{4} << 20, kShare = size_t{32} << 20;
  auto* out = static_cast<uint8_t*>(dst);
  const auto* in = static_cast<const uint8_t*>(src);
  ParallelBlocks(n, kPiece, kShare, threads, [&](size_t begin, size_t end) {
    std::memcpy(out + begin, in + begin, end - begin);
  });
}

}  // namespace zinfjax
