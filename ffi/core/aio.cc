#include "core/aio.h"

#include <linux/io_uring.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "core/errors.h"
#include "core/hash.h"

namespace zinfjax {

std::string SysError(const std::string& what, int err) {
  return what + ": " + std::strerror(err);
}

namespace {

// ---------------------------------------------------------------- io_uring
class UringBackend final : public AioBackend {
 public:
  explicit UringBackend(unsigned entries) {
    io_uring_params p;
    std::memset(&p, 0, sizeof(p));
    fd_ = static_cast<int>(syscall(__NR_io_uring_setup, entries, &p));
    if (fd_ < 0) throw BackendUnavailable(SysError("io_uring_setup", errno));
    sq_len_ = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    cq_len_ = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    bool single = p.features & IORING_FEAT_SINGLE_MMAP;
    if (single) sq_len_ = cq_len_ = std::max(sq_len_, cq_len_);
    sq_ptr_ = Map(sq_len_, IORING_OFF_SQ_RING);
    cq_ptr_ = single ? sq_ptr_ : Map(cq_len_, IORING_OFF_CQ_RING);
    sqes_len_ = p.sq_entries * sizeof(io_uring_sqe);
    sqes_ = static_cast<io_uring_sqe*>(Map(sqes_len_, IORING_OFF_SQES));
    auto* sq = static_cast<uint8_t*>(sq_ptr_);
    auto* cq = static_cast<uint8_t*>(cq_ptr_);
    sq_tail_ = reinterpret_cast<unsigned*>(sq + p.sq_off.tail);
    sq_mask_ = *reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
    sq_array_ = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
    cq_head_ = reinterpret_cast<unsigned*>(cq + p.cq_off.head);
    cq_tail_ = reinterpret_cast<unsigned*>(cq + p.cq_off.tail);
    cq_mask_ = *reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
    cqes_ = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
    CheckOpsSupported();
  }

  ~UringBackend() override {
    if (sqes_) munmap(sqes_, sqes_len_);
    if (cq_ptr_ && cq_ptr_ != sq_ptr_) munmap(cq_ptr_, cq_len_);
    if (sq_ptr_) munmap(sq_ptr_, sq_len_);
    if (fd_ >= 0) close(fd_);
  }

  void Submit(const IoRequest& r) override {
    unsigned tail = *sq_tail_;
    unsigned index = tail & sq_mask_;
    io_uring_sqe* sqe = &sqes_[index];
    std::memset(sqe, 0, sizeof(*sqe));
    sqe->opcode = r.write ? IORING_OP_WRITE : IORING_OP_READ;
    sqe->fd = r.fd;
    sqe->off = static_cast<uint64_t>(r.offset);
    sqe->addr = reinterpret_cast<uint64_t>(r.buf);
    sqe->len = static_cast<uint32_t>(r.len);
    sqe->user_data = r.tag;
    sq_array_[index] = index;
    __atomic_store_n(sq_tail_, tail + 1, __ATOMIC_RELEASE);
    ++unsubmitted_;
  }

  void Reap(std::vector<IoCompletion>* out, size_t min) override {
    size_t got = Drain(out);
    while (unsubmitted_ > 0 || got < min) {
      unsigned flags = got < min ? IORING_ENTER_GETEVENTS : 0;
      unsigned want = got < min ? static_cast<unsigned>(min - got) : 0;
      long ret = syscall(__NR_io_uring_enter, fd_, unsubmitted_, want, flags, nullptr, 0);
      if (ret < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == EBUSY) continue;
        throw EngineError(SysError("io_uring_enter", errno));
      }
      unsubmitted_ -= static_cast<unsigned>(ret);
      got += Drain(out);
    }
  }

  std::string name() const override { return "io_uring"; }

 private:
  void* Map(size_t len, off_t offset) {
    void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd_, offset);
    if (p == MAP_FAILED) {
      int err = errno;
      close(fd_);
      fd_ = -1;
      throw BackendUnavailable(SysError("io_uring mmap", err));
    }
    return p;
  }

  void CheckOpsSupported() {
    // IORING_OP_READ/WRITE need Linux 5.6; ask the kernel instead of guessing.
    size_t len = sizeof(io_uring_probe) + 256 * sizeof(io_uring_probe_op);
    std::vector<uint8_t> storage(len, 0);
    auto* probe = reinterpret_cast<io_uring_probe*>(storage.data());
    long ret = syscall(__NR_io_uring_register, fd_, IORING_REGISTER_PROBE, probe, 256);
    bool ok = ret >= 0 && probe->last_op >= IORING_OP_WRITE &&
              (probe->ops[IORING_OP_READ].flags & IO_URING_OP_SUPPORTED) &&
              (probe->ops[IORING_OP_WRITE].flags & IO_URING_OP_SUPPORTED);
    if (!ok) throw BackendUnavailable("io_uring lacks IORING_OP_READ/WRITE (Linux < 5.6)");
  }

  size_t Drain(std::vector<IoCompletion>* out) {
    unsigned head = *cq_head_;
    unsigned tail = __atomic_load_n(cq_tail_, __ATOMIC_ACQUIRE);
    size_t n = 0;
    while (head != tail) {
      const io_uring_cqe& cqe = cqes_[head & cq_mask_];
      out->push_back({cqe.user_data, cqe.res});
      ++head;
      ++n;
    }
    __atomic_store_n(cq_head_, head, __ATOMIC_RELEASE);
    return n;
  }

  int fd_ = -1;
  void* sq_ptr_ = nullptr;
  void* cq_ptr_ = nullptr;
  size_t sq_len_ = 0, cq_len_ = 0, sqes_len_ = 0;
  io_uring_sqe* sqes_ = nullptr;
  io_uring_cqe* cqes_ = nullptr;
  unsigned *sq_tail_ = nullptr, *sq_array_ = nullptr, *cq_head_ = nullptr, *cq_tail_ = nullptr;
  unsigned sq_mask_ = 0, cq_mask_ = 0;
  unsigned unsubmitted_ = 0;
};

// ------------------------------------------------------ pread/pwrite threads
class ThreadBackend final : public AioBackend {
 public:
  explicit ThreadBackend(unsigned threads) {
    for (unsigned i = 0; i < std::max(1u, threads); ++i) workers_.emplace_back([this] { Run(); });
  }

  ~ThreadBackend() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    work_cv_.notify_all();
    for (auto& t : workers_) t.join();
  }

  void Submit(const IoRequest& r) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(r);
    }
    work_cv_.notify_one();
  }

  void Reap(std::vector<IoCompletion>* out, size_t min) override {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return done_.size() >= min; });
    for (auto& c : done_) out->push_back(c);
    done_.clear();
  }

  std::string name() const override { return "threads"; }

 private:
  void Run() {
    for (;;) {
      IoRequest r;
      {
        std::unique_lock<std::mutex> lock(mu_);
        work_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (stop_ && queue_.empty()) return;
        r = queue_.front();
        queue_.pop_front();
      }
      int64_t moved = 0;
      while (static_cast<size_t>(moved) < r.len) {
        ssize_t n = r.write ? pwrite(r.fd, r.buf + moved, r.len - moved, r.offset + moved)
                            : pread(r.fd, r.buf + moved, r.len - moved, r.offset + moved);
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) {
          moved = -errno;
          break;
        }
        if (n == 0) break;  // end of file: a short read
        moved += n;
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        done_.push_back({r.tag, moved});
      }
      done_cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  std::deque<IoRequest> queue_;
  std::vector<IoCompletion> done_;
  std::vector<std::thread> workers_;
  bool stop_ = false;
};

void CheckCompletion(const IoCompletion& c, size_t expected, bool write, const std::string& what) {
  if (c.result < 0) {
    int err = static_cast<int>(-c.result);
    if (err == ENOSPC) throw NoSpace(SysError("writing " + what, err));
    throw EngineError(SysError(std::string(write ? "writing " : "reading ") + what, err));
  }
  if (static_cast<size_t>(c.result) != expected) {
    if (write) throw NoSpace("short write to " + what + " (" + std::to_string(c.result) + " of " +
                             std::to_string(expected) + " bytes): the disk is probably full");
    throw CorruptShard("short read from " + what + " (" + std::to_string(c.result) + " of " +
                       std::to_string(expected) + " bytes): the swap file is truncated");
  }
}

}  // namespace

std::unique_ptr<AioBackend> MakeBackend(const std::string& kind, unsigned queue_depth,
                                        unsigned threads) {
  if (kind == "threads") return std::make_unique<ThreadBackend>(threads);
  if (kind != "auto" && kind != "io_uring")
    throw EngineError("unknown aio backend '" + kind + "': use auto, io_uring or threads");
  try {
    return std::make_unique<UringBackend>(std::max(queue_depth, 1u));
  } catch (const BackendUnavailable&) {
    if (kind == "io_uring") throw;
    return std::make_unique<ThreadBackend>(threads);
  }
}

namespace {

// A block can skip the staging buffer when the caller's bytes for it are
// already what O_DIRECT needs: 4 KiB-aligned and a whole block of data.
bool ZeroCopy(const uint8_t* base, const Block& b, size_t nbytes) {
  return reinterpret_cast<uintptr_t>(base + b.extent_offset) % kAlignment == 0 &&
         b.extent_offset + b.length <= nbytes;
}

// Staging for one block: a pool lease, or none for a zero-copy block.
// Waits (reaping completions through `reap`) while the pool or queue is full.
template <typename Reap>
std::optional<Lease> Stage(PinnedPool& pool, const Block& b, bool zero_copy, size_t busy,
                           const TransferOptions& options, Reap&& reap, size_t* in_flight) {
  if (b.length > pool.buffer_bytes()) throw EngineError("block larger than the pool's buffers");
  while (*in_flight >= options.queue_depth) reap();
  if (zero_copy) return std::nullopt;
  for (;;) {
    if (busy == 0) return pool.Acquire(options.pool_timeout);
    if (auto lease = pool.TryAcquire()) return lease;
    reap();
    busy = *in_flight;
  }
}

}  // namespace

std::vector<uint64_t> WriteExtents(AioBackend& backend, PinnedPool& pool,
                                   const std::vector<Extent>& extents, const TransferOptions& options) {
  std::vector<uint64_t> sums;
  std::vector<std::pair<size_t, size_t>> where;  // tag -> (extent, block)
  std::map<uint64_t, std::optional<Lease>> in_flight;
  std::vector<IoCompletion> done;
  std::exception_ptr failure;
  size_t count = 0;
  auto reap = [&] {
    done.clear();
    backend.Reap(&done, 1);
    for (const auto& c : done) {
      auto [x, i] = where[c.tag];
      try {
        CheckCompletion(c, extents[x].blocks[i].length, true, "swap file");
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
      in_flight.erase(c.tag);
    }
    count = in_flight.size();
  };
  for (size_t x = 0; x < extents.size() && !failure; ++x) {
    const Extent& ext = extents[x];
    const uint8_t* src = ext.data;
    Hasher hasher;
    for (size_t i = 0; i < ext.blocks.size() && !failure; ++i) {
      const Block& b = ext.blocks[i];
      bool zero_copy = ZeroCopy(src, b, ext.nbytes);
      std::optional<Lease> lease = Stage(pool, b, zero_copy, in_flight.size(), options, reap, &count);
      uint8_t* buf = const_cast<uint8_t*>(src) + b.extent_offset;
      size_t data = b.extent_offset < ext.nbytes ? std::min(b.length, ext.nbytes - b.extent_offset) : 0;
      if (lease) {
        std::memcpy(lease->data(), src + b.extent_offset, data);
        if (data < b.length) std::memset(lease->data() + data, 0, b.length - data);
        buf = lease->data();
      }
      hasher.Update(src + b.extent_offset, data);
      uint64_t tag = where.size();
      where.emplace_back(x, i);
      backend.Submit({b.fd, true, buf, b.length, b.file_offset, tag});
      in_flight.emplace(tag, std::move(lease));
      count = in_flight.size();
    }
    sums.push_back(hasher.Digest());
  }
  while (!in_flight.empty()) reap();
  if (failure) std::rethrow_exception(failure);
  return sums;
}

std::vector<uint64_t> ReadExtents(AioBackend& backend, PinnedPool& pool,
                                  const std::vector<Extent>& extents, const TransferOptions& options) {
  std::vector<Hasher> hashers(extents.size());
  std::vector<std::pair<size_t, size_t>> where;  // tag -> (extent, block), in submission order
  std::map<uint64_t, std::optional<Lease>> in_flight, arrived;
  std::vector<IoCompletion> done;
  std::exception_ptr failure;
  uint64_t next = 0;  // next block to hand over (copy out, hash): in tag order, so in order per extent
  size_t count = 0;
  auto reap = [&] {
    done.clear();
    backend.Reap(&done, 1);
    for (const auto& c : done) {
      auto it = in_flight.find(c.tag);
      auto [x, i] = where[c.tag];
      try {
        CheckCompletion(c, extents[x].blocks[i].length, false, extents[x].what);
        arrived.emplace(c.tag, std::move(it->second));
      } catch (...) {
        if (!failure) failure = std::current_exception();
      }
      in_flight.erase(it);
    }
    for (auto it = arrived.find(next); it != arrived.end(); it = arrived.find(next)) {
      auto [x, i] = where[next];
      const Extent& ext = extents[x];
      const Block& b = ext.blocks[i];
      size_t data = b.extent_offset < ext.nbytes ? std::min(b.length, ext.nbytes - b.extent_offset) : 0;
      if (it->second) std::memcpy(ext.data + b.extent_offset, it->second->data(), data);
      hashers[x].Update(ext.data + b.extent_offset, data);
      arrived.erase(it);
      ++next;
    }
    count = in_flight.size();
  };
  for (size_t x = 0; x < extents.size() && !failure; ++x) {
    const Extent& ext = extents[x];
    for (size_t i = 0; i < ext.blocks.size() && !failure; ++i) {
      const Block& b = ext.blocks[i];
      bool zero_copy = ZeroCopy(ext.data, b, ext.nbytes);
      std::optional<Lease> lease =
          Stage(pool, b, zero_copy, in_flight.size() + arrived.size(), options, reap, &count);
      uint8_t* buf = lease ? lease->data() : ext.data + b.extent_offset;
      uint64_t tag = where.size();
      where.emplace_back(x, i);
      backend.Submit({b.fd, false, buf, b.length, b.file_offset, tag});
      in_flight.emplace(tag, std::move(lease));
      count = in_flight.size();
    }
  }
  while (!in_flight.empty()) reap();
  if (failure) std::rethrow_exception(failure);
  std::vector<uint64_t> sums;
  for (const Hasher& h : hashers) sums.push_back(h.Digest());
  return sums;
}

uint64_t WriteExtent(AioBackend& backend, PinnedPool& pool, const std::vector<Block>& blocks,
                     const uint8_t* src, size_t nbytes, const TransferOptions& options) {
  return WriteExtents(backend, pool, {{blocks, const_cast<uint8_t*>(src), nbytes, ""}}, options)[0];
}

uint64_t ReadExtent(AioBackend& backend, PinnedPool& pool, const std::vector<Block>& blocks,
                    uint8_t* dst, size_t nbytes, const TransferOptions& options,
                    const std::string& what) {
  return ReadExtents(backend, pool, {{blocks, dst, nbytes, what}}, options)[0];
}

}  // namespace zinfjax
