#include "core/workers.h"

#include <pthread.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

namespace zinfjax {
namespace {

// One call's slices: how many workers have yet to finish, and the caller waiting for them.
struct Batch {
  const std::function<void(size_t)>* task;
  size_t left;
  std::mutex mu;
  std::condition_variable done;
};

struct Slice {
  Batch* batch;
  size_t index;
};

// The workers of one nice value and their queue. Never freed: workers wait on it until the
// process ends.
class Crew {
 public:
  // Starts workers up to `n` from the calling thread (which gives them its nice value);
  // returns how many it started.
  size_t Grow(size_t n) {
    size_t made = 0;
    for (; size_ < n; ++size_, ++made) std::thread([this] { Work(); }).detach();
    return made;
  }

  void Push(Batch* batch, size_t from, size_t to) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (size_t i = from; i < to; ++i) queue_.push_back({batch, i});
    }
    ready_.notify_all();
  }

 private:
  void Work() {
    for (;;) {
      Slice s;
      {
        std::unique_lock<std::mutex> lock(mu_);
        ready_.wait(lock, [this] { return !queue_.empty(); });
        s = queue_.front();
        queue_.pop_front();
      }
      (*s.batch->task)(s.index);
      std::lock_guard<std::mutex> lock(s.batch->mu);  // the caller frees the batch after this
      if (--s.batch->left == 0) s.batch->done.notify_one();
    }
  }

  size_t size_ = 0;  // guarded by the registry's mutex
  std::mutex mu_;
  std::condition_variable ready_;
  std::deque<Slice> queue_;
};

struct Registry {
  std::mutex mu;
  std::map<int, Crew*> crews;  // by nice value
  size_t workers = 0;
};

// A forked child has none of its parent's threads: it starts afresh (the old crews are left).
void ForgetInChild();

Registry*& registry() {
  static Registry* r = [] {
    pthread_atfork(nullptr, nullptr, &ForgetInChild);
    return new Registry();
  }();
  return r;
}

void ForgetInChild() { registry() = new Registry(); }

int CallerNice() {
  errno = 0;
  int nice = getpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)));
  return errno == 0 ? nice : 0;
}

}  // namespace

void RunSlices(size_t n, const std::function<void(size_t)>& task) {
  if (n == 0) return;
  if (n == 1) {
    task(0);
    return;
  }
  Crew* crew;
  {
    Registry* r = registry();
    std::lock_guard<std::mutex> lock(r->mu);
    Crew*& c = r->crews[CallerNice()];
    if (c == nullptr) c = new Crew();
    crew = c;
    r->workers += crew->Grow(n - 1);
  }
  Batch batch{&task, n - 1, {}, {}};
  crew->Push(&batch, 1, n);
  task(0);
  std::unique_lock<std::mutex> lock(batch.mu);
  batch.done.wait(lock, [&batch] { return batch.left == 0; });
}

size_t WorkerCount() {
  Registry* r = registry();
  std::lock_guard<std::mutex> lock(r->mu);
  return r->workers;
}

}  // namespace zinfjax
