// XLA FFI handlers for the swap store on the CUDA platform, asynchronous.
//
// XLA:GPU calls a handler on the host thread that launches the program's
// kernels, usually well ahead of the GPU. So a handler only enqueues work on
// the stream XLA passes in and never synchronizes it:
//
//   * it finds its shards from the host's copy of the static schedule
//     (SwapSite: rank by device ordinal, layer by count of executions in the
//     run), never by reading the rank, layer or ticket operands back;
//   * write_many reserves the shards in the store, enqueues device-to-host
//     copies into a page-locked buffer the store lends, and a host function
//     that hands the filled buffer to the store's I/O threads when the copies
//     are done; reads of those keys wait for the write from the launch on.
//     Both directions leave XLA's stream for the device's copy stream
//     (cuda/copies.h) unless ZINFJAX_COPY_STREAM=0;
//   * read_start_many starts reading into a page-locked buffer the store owns;
//     read_wait_many takes it (waiting on the launch thread only if the read
//     is still on the disk: the schedule starts reads layers ahead), enqueues
//     the host-to-device copies, and a host function that returns the buffer
//     once they are done.
//
// Host functions make no CUDA call: returned buffers are handed back to the
// store on the launch thread, at the next handler. The handlers are not
// command-buffer compatible (their host logic must run at every execution),
// so XLA never captures them into a CUDA graph. Built as its own module
// (zinfjax._engine_cuda) only where CMake finds the CUDA toolkit; it links its
// own copy of the core, so it looks stores up in zinfjax._engine's table.
#include <cuda_runtime_api.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/buffer.h"
#include "core/errors.h"
#include "core/schedule.h"
#include "core/store.h"
#include "cuda/copies.h"
#include "xla/ffi/api/ffi.h"
#include "xla/ffi_util.h"

namespace ffi = xla::ffi;
namespace py = pybind11;

namespace zinfjax {
namespace {

bool Pin(void* p, size_t bytes) {
  // portable: every device context sees it page-locked
  if (cudaHostRegister(p, bytes, cudaHostRegisterPortable) == cudaSuccess) return true;
  cudaGetLastError();  // unpinned still works, as a staged (slower) copy
  return false;
}

void Unpin(void* p) {
  if (cudaHostUnregister(p) != cudaSuccess) cudaGetLastError();
}

struct PendingWrite {
  std::shared_ptr<SwapStore> store;
  SwapStore::DetachedWrite write;
};

void CUDART_CB CommitWrite(void* data) {
  std::unique_ptr<PendingWrite> w(static_cast<PendingWrite*>(data));
  w->store->FinishDetached(std::move(w->write));  // queues the disk write; never throws
}

ffi::Error Check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("zinfjax CUDA swap: ") + what + ": " + cudaGetErrorString(err));
}

std::shared_ptr<SwapStore> Prepared(const SwapSite& at) {
  returns().Drain();
  std::shared_ptr<SwapStore> store = StoreLookup()(at.store);
  if (store) store->SetPinHooks(&Pin, &Unpin);
  return store;
}

// write_many's copies: the shards `xs` into the lent host buffer of `write`, then the host
// function `CommitWrite(pending)`: through a staging buffer on the copy stream, or on XLA's
// stream (ZINFJAX_COPY_STREAM=0).
cudaError_t EnqueueWrite(cudaStream_t stream, int32_t ordinal, ffi::RemainingArgs xs,
                         PendingWrite* pending) {
  SwapStore::DetachedWrite& w = pending->write;
  std::vector<DeviceSpan> spans;
  for (size_t i = 0; i < xs.size(); ++i) {
    ffi::AnyBuffer x = xs.get<ffi::AnyBuffer>(i).value();
    spans.push_back({x.untyped_data(), x.size_bytes()});
  }
  if (!CopyLane::Enabled()) return CopyOutDirect(stream, spans, w.base, w.at, CommitWrite, pending);
  cudaError_t err = cudaSuccess;
  CopyLane* lane = CopyLane::For(ordinal, &err);
  if (lane == nullptr) return err;
  std::lock_guard<std::mutex> lock(lane->mu());
  if ((err = lane->Pump()) != cudaSuccess) return err;
  return CopyOut(*lane, stream, spans, w.base, w.at, /*in_place=*/!w.buffer, CommitWrite, pending);
}

ffi::Error WriteManyImpl(cudaStream_t stream, int32_t ordinal, ffi::RunId run,
                         ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32>, ffi::RemainingArgs xs,
                         ffi::ResultBuffer<ffi::S32> token, SwapSite at) {
  std::shared_ptr<SwapStore> store = Prepared(at);
  return WithStore(at.store, [&](SwapStore& s) -> ffi::Error {
    std::vector<std::string> keys = ScheduledKeys("write", at, ordinal, run.run_id);
    std::vector<ShardIo> shards = WriteShards(keys, xs, /*with_data=*/false);
    // straight into a memory store's (page-locked) mapping where it lends it: from XLA's
    // stream, or from the copy stream's staging buffer
    auto pending = std::make_unique<PendingWrite>(
        PendingWrite{store, s.BeginDetached(shards, /*in_place=*/true)});
    cudaError_t err = EnqueueWrite(stream, ordinal, xs, pending.get());
    if (err != cudaSuccess) {  // release the keys (the step fails with this error)
      store->FinishDetached(std::move(pending->write));
      return Check(err, "enqueue grad copy to host");
    }
    pending.release();  // owned by CommitWrite now
    return Check(cudaMemsetAsync(token->typed_data(), 0, sizeof(int32_t), stream), "token");
  });
}

ffi::Error ReadStartManyImpl(cudaStream_t stream, int32_t ordinal, ffi::RunId run,
                             ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32>,
                             ffi::ResultBuffer<ffi::S32> ticket, SwapSite at) {
  std::shared_ptr<SwapStore> store = Prepared(at);
  return WithStore(at.store, [&](SwapStore& s) -> ffi::Error {
    std::vector<std::string> keys = ScheduledKeys("start", at, ordinal, run.run_id);
    uint64_t read = s.ReadOwnedAsync(keys, /*urgent=*/true, /*in_place=*/true);
    if (!CopyLane::Enabled()) {
      ProcessOwnedReads().Put(at.store, keys.front(), read);
    } else {
      cudaError_t err = cudaSuccess;
      CopyLane* lane = CopyLane::For(ordinal, &err);
      if (lane == nullptr) return Check(err, "copy stream");
      std::lock_guard<std::mutex> lock(lane->mu());
      lane->Started(StartedRead{store, at.store, keys.front(), read});
      if ((err = lane->Pump()) != cudaSuccess) return Check(err, "stage param copy to device");
    }
    return Check(cudaMemsetAsync(ticket->typed_data(), 0, sizeof(int32_t), stream), "ticket");
  });
}

// A taken read checked against `ys` (ShardMismatch names the first shard that differs, its
// buffers released) and copied into them: from its staging buffer, or from the host.
ffi::Error CopyTaken(cudaStream_t stream, StartedRead& r, ffi::RemainingRets ys) {
  try {
    SwapStore::CheckRead(*r.read, ReadOuts(ys, /*with_data=*/false));
  } catch (...) {
    Release(stream, r);
    throw;
  }
  std::vector<DeviceSpan> spans;
  for (size_t i = 0; i < ys.size(); ++i) {
    ffi::Result<ffi::AnyBuffer> y = ys.get<ffi::AnyBuffer>(i).value();
    spans.push_back({y->untyped_data(), y->size_bytes()});
  }
  return Check(CopyIn(stream, r, spans), r.slot ? "enqueue staged param copy"
                                                : "enqueue param copy to device");
}

// read_wait_many through the copy stream: the read staged on the device (now, if it was not
// yet) copied device to device into `ys` once its staging copy is done.
ffi::Error WaitStaged(cudaStream_t stream, int32_t ordinal, int64_t store_id, const std::string& key,
                      ffi::RemainingRets ys) {
  cudaError_t err = cudaSuccess;
  CopyLane* lane = CopyLane::For(ordinal, &err);
  if (lane == nullptr) return Check(err, "copy stream");
  std::lock_guard<std::mutex> lock(lane->mu());
  std::optional<StartedRead> r = lane->Take(store_id, key, &err);
  if (!r) throw EngineError("zinfjax_swap_read_wait_many: no read of shard '" + key +
                            "' was started (the start and wait calls' schedules disagree)");
  if (err != cudaSuccess) return Check(err, "stage param copy to device");
  if (r->error) std::rethrow_exception(r->error);
  return CopyTaken(stream, *r, ys);
}

ffi::Error ReadWaitManyImpl(cudaStream_t stream, int32_t ordinal, ffi::RunId run,
                            ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32>, ffi::Buffer<ffi::S32>,
                            ffi::RemainingRets ys, SwapSite at) {
  std::shared_ptr<SwapStore> store = Prepared(at);
  return WithStore(at.store, [&](SwapStore& s) -> ffi::Error {
    std::vector<std::string> keys = ScheduledKeys("wait", at, ordinal, run.run_id);
    if (CopyLane::Enabled()) return WaitStaged(stream, ordinal, at.store, keys.front(), ys);
    auto ticket = ProcessOwnedReads().Take(at.store, keys.front());
    if (!ticket)
      throw EngineError("zinfjax_swap_read_wait_many: no read of shard '" + keys.front() +
                        "' was started (the start and wait calls' schedules disagree)");
    StartedRead r;  // not staged: copied from the host on XLA's stream
    r.store = store;
    r.read = s.TakeRead(*ticket);
    return CopyTaken(stream, r, ys);
  });
}

// zinfjax_after(x, dep) -> x once dep exists (see xla/order_ffi.cc): a device copy only
// where XLA did not alias the output to `x`.
ffi::Error AfterImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> y) {
  if (y->untyped_data() == x.untyped_data()) return ffi::Error::Success();
  return Check(cudaMemcpyAsync(y->untyped_data(), x.untyped_data(), x.size_bytes(),
                               cudaMemcpyDeviceToDevice, stream), "after");
}

}  // namespace
}  // namespace zinfjax

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZinfjaxAfterCuda, zinfjax::AfterImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZinfjaxSwapWriteManyCuda, zinfjax::WriteManyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attrs<zinfjax::SwapSite>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZinfjaxSwapReadStartManyCuda, zinfjax::ReadStartManyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attrs<zinfjax::SwapSite>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZinfjaxSwapReadWaitManyCuda, zinfjax::ReadWaitManyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingRets()
                                  .Attrs<zinfjax::SwapSite>());

PYBIND11_MODULE(_engine_cuda, m) {
  m.doc() = "zinfjax CUDA FFI handlers (swap store <-> device memory, asynchronous on XLA's stream)";
  m.def("registrations", [](py::capsule store_lookup) {
    zinfjax::StoreLookup() = reinterpret_cast<zinfjax::StoreLookupFn>(store_lookup.get_pointer());
    py::dict d;
    d["zinfjax_swap_write_many"] = py::capsule(reinterpret_cast<void*>(ZinfjaxSwapWriteManyCuda));
    d["zinfjax_swap_read_start_many"] = py::capsule(reinterpret_cast<void*>(ZinfjaxSwapReadStartManyCuda));
    d["zinfjax_swap_read_wait_many"] = py::capsule(reinterpret_cast<void*>(ZinfjaxSwapReadWaitManyCuda));
    d["zinfjax_after"] = py::capsule(reinterpret_cast<void*>(ZinfjaxAfterCuda));
    return d;
  }, py::arg("store_lookup"),
     "XLA FFI handler capsules (CUDA platform); `store_lookup` is zinfjax._engine.store_lookup().");
  m.def("device_count", []() {
    int n = 0;
    return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
  }, "CUDA devices visible to this process (0 where there is no driver or GPU).");
}
