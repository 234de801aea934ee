// XLA FFI handlers for the swap store on the CUDA platform.
//
// A shard moves between device memory and the store through a page-locked
// staging buffer: device -> pinned host with cudaMemcpyAsync on the stream
// XLA passes in, then the engine's aio path to NVMe (and the reverse for
// reads; a started read fills an engine-owned buffer while the program
// runs, and its wait stages that into device memory). Built as its own module (zinfjax._engine_cuda) only when CMake
// finds the CUDA toolkit, and registered only when JAX has a GPU backend, so
// a CPU-only install never needs libcudart.
#include <cuda_runtime_api.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "core/buffer.h"
#include "core/store.h"
#include "xla/ffi/api/ffi.h"
#include "xla/ffi_util.h"

namespace ffi = xla::ffi;
namespace py = pybind11;

namespace zinfjax {
namespace {

// One growable page-locked staging buffer per process (transfers are serialized on it).
class Staging {
 public:
  uint8_t* Get(size_t bytes) {
    if (!buffer_ || buffer_->capacity() < bytes) {
      if (buffer_) cudaHostUnregister(buffer_->data());
      buffer_ = std::make_unique<AlignedBuffer>(bytes);
      cudaHostRegister(buffer_->data(), buffer_->capacity(), cudaHostRegisterDefault);
    }
    return buffer_->data();
  }
  std::mutex mu;

 private:
  std::unique_ptr<AlignedBuffer> buffer_;
};

Staging& staging() {
  static auto* s = new Staging();
  return *s;
}

ffi::Error Check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(err));
}

int32_t DeviceScalar(cudaStream_t stream, const ffi::Buffer<ffi::S32>& b) {
  int32_t value = 0;
  cudaMemcpyAsync(&value, b.typed_data(), sizeof(value), cudaMemcpyDeviceToHost, stream);
  cudaStreamSynchronize(stream);
  return value;
}

ffi::Error WriteImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank,
                     ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::S32> token, int64_t store,
                     std::string_view key) {
  return WithStore(store, [&](SwapStore& s) {
    std::string k = ShardKey(key, DeviceScalar(stream, rank), DeviceScalar(stream, layer));
    std::lock_guard<std::mutex> lock(staging().mu);
    uint8_t* host = staging().Get(x.size_bytes());
    if (auto e = Check(cudaMemcpyAsync(host, x.untyped_data(), x.size_bytes(), cudaMemcpyDeviceToHost, stream), "copy to host"); e.failure()) return e;
    if (auto e = Check(cudaStreamSynchronize(stream), "sync"); e.failure()) return e;
    s.Wait(s.WriteAsync(k, host, x.size_bytes(), DtypeName(x.element_type()), Dims(x)));
    int32_t one = 1;
    return Check(cudaMemcpyAsync(token->typed_data(), &one, sizeof(one), cudaMemcpyHostToDevice, stream), "token");
  });
}

ffi::Error ReadImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> token, ffi::Buffer<ffi::S32> rank,
                    ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> y, int64_t store,
                    std::string_view key) {
  (void)token;
  return WithStore(store, [&](SwapStore& s) {
    std::string k = ShardKey(key, DeviceScalar(stream, rank), DeviceScalar(stream, layer));
    std::lock_guard<std::mutex> lock(staging().mu);
    uint8_t* host = staging().Get(y->size_bytes());
    s.Wait(s.ReadAsync(k, host, y->size_bytes(), DtypeName(y->element_type()), Dims(*y),
                       /*urgent=*/true));
    if (auto e = Check(cudaMemcpyAsync(y->untyped_data(), host, y->size_bytes(), cudaMemcpyHostToDevice, stream), "copy to device"); e.failure()) return e;
    return Check(cudaStreamSynchronize(stream), "sync");
  });
}

// A layer's shards of several leaves in one call each (see the CPU handlers),
// staged at 4 KiB-aligned offsets of the staging buffer.
ffi::Error WriteManyImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> layer,
                         ffi::RemainingArgs xs, ffi::ResultBuffer<ffi::S32> token, int64_t store,
                         std::string_view keys) {
  return WithStore(store, [&](SwapStore& s) {
    std::vector<std::string> names = ShardKeys(keys, DeviceScalar(stream, rank), DeviceScalar(stream, layer));
    if (names.size() != xs.size())
      return ffi::Error::InvalidArgument("zinfjax_swap_write_many: arrays and keys differ in number");
    size_t total = 0;
    for (size_t i = 0; i < xs.size(); ++i) total += AlignUp(xs.get<ffi::AnyBuffer>(i).value().size_bytes());
    std::lock_guard<std::mutex> lock(staging().mu);
    uint8_t* host = staging().Get(total);
    std::vector<ShardIo> shards;
    size_t at = 0;
    for (size_t i = 0; i < xs.size(); ++i) {
      ffi::AnyBuffer x = xs.get<ffi::AnyBuffer>(i).value();
      if (auto e = Check(cudaMemcpyAsync(host + at, x.untyped_data(), x.size_bytes(), cudaMemcpyDeviceToHost, stream), "copy to host"); e.failure()) return e;
      shards.push_back({names[i], host + at, x.size_bytes(), DtypeName(x.element_type()), Dims(x)});
      at += AlignUp(x.size_bytes());
    }
    if (auto e = Check(cudaStreamSynchronize(stream), "sync"); e.failure()) return e;
    s.Wait(s.WriteManyAsync(shards));
    int32_t one = 1;
    return Check(cudaMemcpyAsync(token->typed_data(), &one, sizeof(one), cudaMemcpyHostToDevice, stream), "token");
  });
}

ffi::Error ReadStartManyImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> token, ffi::Buffer<ffi::S32> rank,
                             ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::S32> ticket,
                             int64_t store, std::string_view keys) {
  (void)token;
  return WithStore(store, [&](SwapStore& s) {
    std::vector<std::string> names = ShardKeys(keys, DeviceScalar(stream, rank), DeviceScalar(stream, layer));
    int32_t value = static_cast<int32_t>(s.ReadOwnedAsync(names, /*urgent=*/true));
    return Check(cudaMemcpyAsync(ticket->typed_data(), &value, sizeof(value), cudaMemcpyHostToDevice, stream), "ticket");
  });
}

ffi::Error ReadWaitManyImpl(cudaStream_t stream, ffi::Buffer<ffi::S32> ticket, ffi::RemainingRets ys,
                            int64_t store) {
  return WithStore(store, [&](SwapStore& s) {
    uint64_t t = static_cast<uint64_t>(DeviceScalar(stream, ticket));
    size_t total = 0;
    for (size_t i = 0; i < ys.size(); ++i) total += AlignUp(ys.get<ffi::AnyBuffer>(i).value()->size_bytes());
    std::lock_guard<std::mutex> lock(staging().mu);
    uint8_t* host = staging().Get(total);
    std::vector<ShardIo> outs;
    size_t at = 0;
    for (size_t i = 0; i < ys.size(); ++i) {
      ffi::Result<ffi::AnyBuffer> y = ys.get<ffi::AnyBuffer>(i).value();
      outs.push_back({"", host + at, y->size_bytes(), DtypeName(y->element_type()), Dims(*y)});
      at += AlignUp(y->size_bytes());
    }
    s.TakeResults(t, outs);
    at = 0;
    for (size_t i = 0; i < ys.size(); ++i) {
      ffi::Result<ffi::AnyBuffer> y = ys.get<ffi::AnyBuffer>(i).value();
      if (auto e = Check(cudaMemcpyAsync(y->untyped_data(), host + at, y->size_bytes(), cudaMemcpyHostToDevice, stream), "copy to device"); e.failure()) return e;
      at += AlignUp(y->size_bytes());
    }
    return Check(cudaStreamSynchronize(stream), "sync");
  });
}

}  // namespace
}  // namespace zinfjax

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZinfjaxSwapWriteManyCuda, zinfjax::WriteManyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("store")
                                  .Attr<std::string_view>("keys"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZinfjaxSwapReadStartManyCuda, zinfjax::ReadStartManyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("store")
                                  .Attr<std::string_view>("keys"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZinfjaxSwapReadWaitManyCuda, zinfjax::ReadWaitManyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingRets()
                                  .Attr<int64_t>("store"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZinfjaxSwapWriteCuda, zinfjax::WriteImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("store")
                                  .Attr<std::string_view>("key"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZinfjaxSwapReadCuda, zinfjax::ReadImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("store")
                                  .Attr<std::string_view>("key"));

PYBIND11_MODULE(_engine_cuda, m) {
  m.doc() = "zinfjax CUDA FFI handlers (swap store <-> device memory through pinned staging)";
  m.def("registrations", []() {
    py::dict d;
    d["zinfjax_swap_write"] = py::capsule(reinterpret_cast<void*>(ZinfjaxSwapWriteCuda));
    d["zinfjax_swap_read"] = py::capsule(reinterpret_cast<void*>(ZinfjaxSwapReadCuda));
    d["zinfjax_swap_write_many"] = py::capsule(reinterpret_cast<void*>(ZinfjaxSwapWriteManyCuda));
    d["zinfjax_swap_read_start_many"] = py::capsule(reinterpret_cast<void*>(ZinfjaxSwapReadStartManyCuda));
    d["zinfjax_swap_read_wait_many"] = py::capsule(reinterpret_cast<void*>(ZinfjaxSwapReadWaitManyCuda));
    return d;
  });
}
