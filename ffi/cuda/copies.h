// The CUDA swap handlers' copies between the store's page-locked buffers and
// device memory, and what outlives a handler call: buffers handed back to
// their store once their copies are done, and a device's copy stream with its
// staging buffers in device memory (on unless ZINFJAX_COPY_STREAM=0).
//
// With the copy stream, no host<->device copy runs on XLA's stream:
//
//   * grads (write_many): XLA's stream copies the shards device to device
//     into a staging buffer (fast), and the copy stream, after an event, copies
//     that buffer to the host in one transfer and hands it to the store;
//   * params (read_start / read_wait): once a started read is in host memory,
//     the next handler call on that device copies it to a staging buffer on the
//     copy stream; read_wait makes XLA's stream wait for that copy (long done,
//     when the read started layers ahead) and copies device to device into
//     its outputs. A read not staged yet is staged by its read_wait (waiting
//     for the drive, as without the copy stream); one that finds no free
//     staging buffer is copied on XLA's stream as before.
//
// A memory store that lends its (page-locked) mapping is copied from and to in
// place here too: one copy per shard between its extent and the staging buffer,
// where the shards sit packed; a buffer the store lends is copied whole.
//
// A staging buffer is refilled only after its last contents were drained
// (stream-ordered by events); each ring holds ZINFJAX_COPY_STAGING buffers
// (default 2) as large as the largest transfer: HBM outside XLA's accounting.
// Where that HBM cannot be had, a transfer crosses on XLA's stream instead, as
// with ZINFJAX_COPY_STREAM=0: slower, never an error.
#ifndef ZINFJAX_CUDA_COPIES_H_
#define ZINFJAX_CUDA_COPIES_H_

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/buffer.h"
#include "core/store.h"

namespace zinfjax {

// Buffers whose copies are done, waiting to go back to their store.
struct Returned {
  std::shared_ptr<SwapStore> store;
  std::unique_ptr<AlignedBuffer> buffer;
};

class Returns {
 public:
  void Put(Returned r) {
    std::lock_guard<std::mutex> lock(mu_);
    done_.push_back(std::move(r));
  }
  void Drain() {  // on the launch thread: giving back may free, and so unpin, a buffer
    std::vector<Returned> done;
    {
      std::lock_guard<std::mutex> lock(mu_);
      done.swap(done_);
    }
    for (Returned& r : done) r.store->GiveBack(std::move(r.buffer));
  }

 private:
  std::mutex mu_;
  std::vector<Returned> done_;
};

inline Returns& returns() {
  static auto* r = new Returns();
  return *r;
}

// Host function: hands a buffer (a `Returned*`) back once the copies before it are done.
inline void CUDART_CB ReturnBuffer(void* data) {
  std::unique_ptr<Returned> r(static_cast<Returned*>(data));
  returns().Put(std::move(*r));
}

// Enqueues the host function that returns `buffer` to `store` after the copies on `stream`.
inline cudaError_t ReturnAfter(cudaStream_t stream, std::shared_ptr<SwapStore> store,
                               std::unique_ptr<AlignedBuffer> buffer) {
  if (!buffer) return cudaSuccess;  // a lent mapping: nothing to hand back
  auto back = std::make_unique<Returned>(Returned{std::move(store), std::move(buffer)});
  cudaError_t err = cudaLaunchHostFunc(stream, ReturnBuffer, back.get());
  if (err == cudaSuccess) back.release();  // owned by ReturnBuffer now
  return err;
}

// A staging buffer in device memory, filled on one stream and drained on another.
struct Slot {
  char* data = nullptr;
  size_t bytes = 0;
  cudaEvent_t filled = nullptr;   // recorded after the fill
  cudaEvent_t drained = nullptr;  // recorded after the drain
  bool draining = true;           // its drain is enqueued: it may be refilled after `drained`
  bool used = false;
};

class Ring {
 public:
  cudaError_t Init(int n) {
    slots_.resize(n < 1 ? 1 : n);
    cudaError_t err = cudaSuccess;
    for (Slot& s : slots_) {
      if (err == cudaSuccess) err = cudaEventCreateWithFlags(&s.filled, cudaEventDisableTiming);
      if (err == cudaSuccess) err = cudaEventCreateWithFlags(&s.drained, cudaEventDisableTiming);
    }
    return err;
  }

  // The next slot, of at least `bytes`, once stream `filler` may write it (nullptr in *out:
  // its last contents wait to be drained, or HBM had no room for it). The caller records
  // `filled`, and `drained` with `draining = true` once it has enqueued the drain.
  cudaError_t Acquire(cudaStream_t filler, size_t bytes, Slot** out) {
    Slot& s = slots_[next_ % slots_.size()];
    *out = nullptr;
    if (!s.draining) return cudaSuccess;
    cudaError_t err = cudaSuccess;
    if (s.bytes < bytes) {  // first use or a larger transfer (sizes are static per call site)
      if (bytes >= unfit_) return cudaSuccess;  // failed before: not asked for at every call
      if (s.used) err = cudaEventSynchronize(s.drained);
      if (err == cudaSuccess && s.data != nullptr) err = cudaFree(s.data);
      s.data = nullptr;
      s.bytes = 0;
      if (err == cudaSuccess) err = cudaMalloc(reinterpret_cast<void**>(&s.data), bytes);
      if (err == cudaErrorMemoryAllocation) {  // HBM is XLA's: the caller uses XLA's stream
        cudaGetLastError();  // clears the error, which is not sticky
        s.data = nullptr;
        unfit_ = bytes;
        return cudaSuccess;
      }
      if (err != cudaSuccess) return err;
      s.bytes = bytes;
    } else if (s.used) {
      err = cudaStreamWaitEvent(filler, s.drained, 0);
      if (err != cudaSuccess) return err;
    }
    ++next_;
    s.draining = false;
    s.used = true;
    *out = &s;
    return cudaSuccess;
  }

 private:
  std::vector<Slot> slots_;
  size_t next_ = 0;
  size_t unfit_ = SIZE_MAX;  // the smallest size cudaMalloc refused
};

// Where shards of these sizes sit packed in a staging buffer: each at a 256-byte boundary.
inline std::vector<size_t> Packed(const std::vector<size_t>& bytes) {
  std::vector<size_t> at;
  size_t end = 0;
  for (size_t b : bytes) {
    at.push_back(end);
    end = (end + b + 255) / 256 * 256;
  }
  return at;
}

// A read started on a store, in host memory once taken, on the device once staged.
struct StartedRead {
  std::shared_ptr<SwapStore> store;
  int64_t store_id;
  std::string key;  // its first shard's key: read_wait finds it by the same key
  uint64_t ticket;
  std::optional<SwapStore::OwnedRead> read;  // taken (buffer null once staged)
  Slot* slot = nullptr;                      // staged
  std::vector<size_t> staged_at;             // staged: shard i at slot->data + staged_at[i]
  std::exception_ptr error;                  // the read failed: raised by its read_wait
};

// One device's copy stream, staging rings and started reads. Used on the device's
// launch thread (locked all the same); made on first use, never freed.
class CopyLane {
 public:
  static bool Enabled() {
    static const bool on = [] {
      const char* v = std::getenv("ZINFJAX_COPY_STREAM");
      return v == nullptr || std::string(v) != "0";
    }();
    return on;
  }

  static CopyLane* For(int32_t ordinal, cudaError_t* err) {
    static std::mutex mu;
    static auto* lanes = new std::vector<std::unique_ptr<CopyLane>>();
    std::lock_guard<std::mutex> lock(mu);
    if (static_cast<size_t>(ordinal) >= lanes->size()) lanes->resize(ordinal + 1);
    std::unique_ptr<CopyLane>& lane = (*lanes)[ordinal];
    if (!lane) {
      auto made = std::make_unique<CopyLane>();
      const char* n = std::getenv("ZINFJAX_COPY_STAGING");
      int slots = n != nullptr ? std::atoi(n) : 2;
      *err = cudaStreamCreateWithFlags(&made->stream_, cudaStreamNonBlocking);
      if (*err == cudaSuccess) *err = made->writes_.Init(slots);
      if (*err == cudaSuccess) *err = made->reads_ring_.Init(slots);
      if (*err != cudaSuccess) return nullptr;
      lane = std::move(made);
    }
    return lane.get();
  }

  std::mutex& mu() { return mu_; }
  cudaStream_t stream() const { return stream_; }
  Ring& writes() { return writes_; }

  void Started(StartedRead r) { reads_.push_back(std::move(r)); }

  // Started reads now on the device (staged), not yet taken.
  size_t staged() const {
    size_t n = 0;
    for (const StartedRead& r : reads_) n += r.slot != nullptr;
    return n;
  }

  // Stages the started reads that are in host memory, in the order they started, while
  // staging buffers are free.
  cudaError_t Pump() {
    for (StartedRead& r : reads_) {
      if (r.slot != nullptr || r.error) continue;
      if (!r.read && !r.store->Done(r.ticket)) break;
      bool staged = false;
      cudaError_t err = Stage(r, &staged);
      if (err != cudaSuccess || !staged) return err;
    }
    return cudaSuccess;
  }

  // The oldest started read of (`store_id`, `key`), taken out of the lane: staged now if it
  // was not (waiting for the drive); its `slot` stays null where no staging buffer was free.
  // nullopt: no such read was started.
  std::optional<StartedRead> Take(int64_t store_id, const std::string& key, cudaError_t* err) {
    *err = cudaSuccess;
    for (auto it = reads_.begin(); it != reads_.end(); ++it) {
      if (it->store_id != store_id || it->key != key) continue;
      StartedRead r = std::move(*it);
      reads_.erase(it);
      if (r.slot == nullptr && !r.error) {
        bool staged = false;
        *err = Stage(r, &staged);
      }
      return r;
    }
    return std::nullopt;
  }

 private:
  // Takes `r` from its store (waiting for it) and, given a free slot, enqueues its copy to
  // the device on the copy stream; `staged` says whether it was.
  cudaError_t Stage(StartedRead& r, bool* staged) {
    *staged = false;
    if (!r.read) {
      try {
        r.read = r.store->TakeRead(r.ticket);
      } catch (...) {
        r.error = std::current_exception();
        *staged = true;  // settled: its read_wait raises it
        return cudaSuccess;
      }
    }
    const SwapStore::OwnedRead& read = *r.read;
    // a lent mapping: each shard from its extent, packed; a lent buffer: its span in one copy
    const bool in_place = !read.buffer;
    std::vector<size_t> bytes;
    for (const ShardEntry& e : read.entries) bytes.push_back(e.nbytes);
    std::vector<size_t> at = in_place ? Packed(bytes) : read.at;
    size_t span = at.back() + bytes.back();
    Slot* slot = nullptr;
    cudaError_t err = reads_ring_.Acquire(stream_, span, &slot);
    if (err != cudaSuccess || slot == nullptr) return err;
    if (in_place) {
      for (size_t i = 0; i < at.size() && err == cudaSuccess; ++i)
        err = cudaMemcpyAsync(slot->data + at[i], read.base + read.at[i], bytes[i],
                              cudaMemcpyHostToDevice, stream_);
    } else {
      err = cudaMemcpyAsync(slot->data, read.base, span, cudaMemcpyHostToDevice, stream_);
    }
    if (err == cudaSuccess) err = cudaEventRecord(slot->filled, stream_);
    if (err == cudaSuccess) err = ReturnAfter(stream_, r.store, std::move(r.read->buffer));
    if (err != cudaSuccess) return err;
    r.slot = slot;
    r.staged_at = std::move(at);
    *staged = true;
    return cudaSuccess;
  }

  std::mutex mu_;
  cudaStream_t stream_ = nullptr;
  Ring writes_, reads_ring_;
  std::deque<StartedRead> reads_;
};

// Device memory of one shard (an XLA buffer): where a copy starts or ends.
struct DeviceSpan {
  void* data;
  size_t bytes;
};

// A write's copies on XLA's `stream` alone: each shard `xs[i]` to `host + at[i]`, then the
// host function `done(arg)`.
inline cudaError_t CopyOutDirect(cudaStream_t stream, const std::vector<DeviceSpan>& xs,
                                 uint8_t* host, const std::vector<size_t>& at, cudaHostFn_t done,
                                 void* arg) {
  cudaError_t err = cudaSuccess;
  for (size_t i = 0; i < xs.size() && err == cudaSuccess; ++i)
    err = cudaMemcpyAsync(host + at[i], xs[i].data, xs[i].bytes, cudaMemcpyDeviceToHost, stream);
  return err == cudaSuccess ? cudaLaunchHostFunc(stream, done, arg) : err;
}

// A write's copies through the lane: the shards `xs` device to device into a staging buffer
// on XLA's `stream`, then to `host + at[i]` on the copy stream, then the host function
// `done(arg)` there. `in_place` (a memory store's lent mapping, the shards in extents of their
// own): packed in the staging buffer, one copy each to the host; else (a lent buffer) at their
// offsets `at`, gaps included, and one copy of the span. No HBM for a staging buffer: on
// XLA's stream alone (CopyOutDirect).
inline cudaError_t CopyOut(CopyLane& lane, cudaStream_t stream, const std::vector<DeviceSpan>& xs,
                           uint8_t* host, const std::vector<size_t>& at, bool in_place,
                           cudaHostFn_t done, void* arg) {
  std::vector<size_t> bytes;
  for (const DeviceSpan& x : xs) bytes.push_back(x.bytes);
  std::vector<size_t> staged = in_place ? Packed(bytes) : at;
  size_t span = 0;
  for (size_t i = 0; i < xs.size(); ++i) span = std::max(span, staged[i] + xs[i].bytes);
  Slot* slot = nullptr;  // null only where HBM had no room: each write's drain is enqueued with it
  cudaError_t err = lane.writes().Acquire(stream, span, &slot);
  if (err == cudaSuccess && slot == nullptr) return CopyOutDirect(stream, xs, host, at, done, arg);
  for (size_t i = 0; i < xs.size() && err == cudaSuccess; ++i)
    err = cudaMemcpyAsync(slot->data + staged[i], xs[i].data, xs[i].bytes,
                          cudaMemcpyDeviceToDevice, stream);
  if (err == cudaSuccess) err = cudaEventRecord(slot->filled, stream);
  if (err == cudaSuccess) err = cudaStreamWaitEvent(lane.stream(), slot->filled, 0);
  if (in_place) {
    for (size_t i = 0; i < xs.size() && err == cudaSuccess; ++i)
      err = cudaMemcpyAsync(host + at[i], slot->data + staged[i], xs[i].bytes,
                            cudaMemcpyDeviceToHost, lane.stream());
  } else if (err == cudaSuccess) {
    err = cudaMemcpyAsync(host, slot->data, span, cudaMemcpyDeviceToHost, lane.stream());
  }
  if (err == cudaSuccess) err = cudaEventRecord(slot->drained, lane.stream());
  if (err == cudaSuccess) slot->draining = true;
  if (err == cudaSuccess) err = cudaLaunchHostFunc(lane.stream(), done, arg);
  return err;
}

// A taken read's copies into `ys` on XLA's `stream`: device to device from its staging buffer
// once the staging copy is done, or (no buffer was free) from the host, returning the host
// buffer after. Its shards must have been checked against `ys` (SwapStore::CheckRead).
inline cudaError_t CopyIn(cudaStream_t stream, StartedRead& r, const std::vector<DeviceSpan>& ys) {
  const SwapStore::OwnedRead& read = *r.read;
  cudaError_t err = cudaSuccess;
  if (r.slot == nullptr) {
    for (size_t i = 0; i < ys.size() && err == cudaSuccess; ++i)
      err = cudaMemcpyAsync(ys[i].data, read.base + read.at[i], ys[i].bytes,
                            cudaMemcpyHostToDevice, stream);
    if (err == cudaSuccess) err = ReturnAfter(stream, r.store, std::move(r.read->buffer));
    return err;
  }
  err = cudaStreamWaitEvent(stream, r.slot->filled, 0);
  for (size_t i = 0; i < ys.size() && err == cudaSuccess; ++i)
    err = cudaMemcpyAsync(ys[i].data, r.slot->data + r.staged_at[i], ys[i].bytes,
                          cudaMemcpyDeviceToDevice, stream);
  if (err == cudaSuccess) err = cudaEventRecord(r.slot->drained, stream);
  if (err == cudaSuccess) r.slot->draining = true;
  return err;
}

// Gives up a taken read that will not be copied (its shards did not match): its staging
// buffer once its copy is done, or its host buffer.
inline void Release(cudaStream_t stream, StartedRead& r) {
  if (r.slot != nullptr) {
    cudaStreamWaitEvent(stream, r.slot->filled, 0);
    if (cudaEventRecord(r.slot->drained, stream) == cudaSuccess) r.slot->draining = true;
  } else if (r.read && r.read->buffer) {
    r.store->GiveBack(std::move(r.read->buffer));
  }
}

}  // namespace zinfjax

#endif  // ZINFJAX_CUDA_COPIES_H_
