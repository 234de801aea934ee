// Helpers shared by the CPU and CUDA FFI handlers: dtype names and shapes as
// the swap store's manifest records them, the guard every handler runs its
// store work in, and a call's shard keys from the host's copy of the static
// schedule (core/keys.h, core/schedule.h).
#ifndef ZINFJAX_XLA_FFI_UTIL_H_
#define ZINFJAX_XLA_FFI_UTIL_H_

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "core/errors.h"
#include "core/keys.h"
#include "core/schedule.h"
#include "core/store.h"
#include "xla/ffi/api/ffi.h"

namespace zinfjax {

inline const char* DtypeName(xla::ffi::DataType t) {
  using xla::ffi::DataType;
  switch (t) {
    case DataType::PRED: return "bool";
    case DataType::S8: return "int8";
    case DataType::S16: return "int16";
    case DataType::S32: return "int32";
    case DataType::S64: return "int64";
    case DataType::U8: return "uint8";
    case DataType::U16: return "uint16";
    case DataType::U32: return "uint32";
    case DataType::U64: return "uint64";
    case DataType::F16: return "float16";
    case DataType::F32: return "float32";
    case DataType::F64: return "float64";
    case DataType::BF16: return "bfloat16";
    default: return "unknown";
  }
}

inline std::vector<int64_t> Dims(const xla::ffi::AnyBuffer& b) {
  auto d = b.dimensions();
  return std::vector<int64_t>(d.begin(), d.end());
}

// How handlers find a store by handle. A module that links its own copy of the
// core (the CUDA handlers) points this at the table of the module that opened
// the stores (zinfjax._engine), which is the only one Python registers into.
using StoreLookupFn = std::shared_ptr<SwapStore> (*)(int64_t);
inline StoreLookupFn& StoreLookup() {
  static StoreLookupFn fn = &LookupStore;
  return fn;
}

// Runs `body(store)` on the swap store behind `handle`; `body` returns void or
// an ffi::Error. Handlers never throw: an exception becomes an ffi::Error or,
// for a store in deferred-error mode, is recorded for the caller to raise once
// the program is done (so the other ranks never wait on a failed one).
template <typename F>
xla::ffi::Error WithStore(int64_t handle, F&& body) {
  std::shared_ptr<SwapStore> store = StoreLookup()(handle);
  if (!store)
    return xla::ffi::Error::InvalidArgument("no zinfjax swap store with handle " +
                                            std::to_string(handle) + " (was it closed?)");
  try {
    if constexpr (std::is_void_v<std::invoke_result_t<F, SwapStore&>>) {
      body(*store);
      return xla::ffi::Error::Success();
    } else {
      return body(*store);
    }
  } catch (const std::exception& e) {
    if (!store->defer_errors()) return xla::ffi::Error::Internal(e.what());
    store->DeferError(std::current_exception());
    return xla::ffi::Error::Success();
  }
}

// The attributes every swap call carries: its store, its leaves' base keys
// (newline-separated), and where it is in the static schedule.
struct SwapSite {
  int64_t store;
  std::string_view keys;
  int64_t site;
  xla::ffi::Span<const int32_t> ranks;   // (device ordinal, data-axis rank) pairs
  xla::ffi::Span<const int32_t> layers;  // layer of the k-th execution in a run (mod size)
};

// The shard keys of this execution of a swap call, from the schedule alone
// (no device memory is read): its rank from the device ordinal, its layer
// from the count of its executions in this run.
inline std::vector<std::string> HostKeys(CallSchedule& schedule, const SwapSite& at,
                                         int32_t ordinal, int64_t run, int32_t* rank = nullptr,
                                         int32_t* layer = nullptr) {
  int32_t r = RankOf(ordinal, at.ranks.begin(), at.ranks.size());
  int32_t l = schedule.Layer(at.site, ordinal, run, at.layers.begin(), at.layers.size());
  if (rank) *rank = r;
  if (layer) *layer = l;
  return ShardKeys(at.keys, r, l);
}

// The part of a swap handler the CPU and CUDA platforms share: a call's shard
// keys from the schedule (ZINFJAX_SWAP_TRACE=1 prints one stderr line per
// call), the shards a write_many moves and the outputs a read_wait_many
// fills. `with_data`: the shards point at the buffers themselves (the CPU,
// where they are host memory); else at nothing (CUDA copies them through the
// store's page-locked buffers).
inline std::vector<std::string> ScheduledKeys(const char* call, const SwapSite& at,
                                              int32_t ordinal, int64_t run, int32_t* rank = nullptr,
                                              int32_t* layer = nullptr) {
  static const bool tracing = std::getenv("ZINFJAX_SWAP_TRACE") != nullptr;
  std::vector<std::string> keys = HostKeys(ProcessSchedule(), at, ordinal, run, rank, layer);
  if (tracing)
    std::fprintf(stderr, "zinfjax swap %s site=%lld ordinal=%d run=%lld key0=%s\n", call,
                 static_cast<long long>(at.site), ordinal, static_cast<long long>(run),
                 keys.empty() ? "" : keys.front().c_str());
  return keys;
}

inline std::vector<ShardIo> WriteShards(const std::vector<std::string>& keys,
                                        xla::ffi::RemainingArgs xs, bool with_data) {
  if (keys.size() != xs.size())
    throw EngineError("zinfjax_swap_write_many got " + std::to_string(xs.size()) +
                      " arrays for " + std::to_string(keys.size()) + " keys");
  std::vector<ShardIo> shards;
  for (size_t i = 0; i < xs.size(); ++i) {
    xla::ffi::AnyBuffer x = xs.get<xla::ffi::AnyBuffer>(i).value();
    shards.push_back({keys[i], with_data ? x.untyped_data() : nullptr, x.size_bytes(),
                      DtypeName(x.element_type()), Dims(x)});
  }
  return shards;
}

inline std::vector<ShardIo> ReadOuts(xla::ffi::RemainingRets ys, bool with_data) {
  std::vector<ShardIo> outs;
  for (size_t i = 0; i < ys.size(); ++i) {
    xla::ffi::Result<xla::ffi::AnyBuffer> y = ys.get<xla::ffi::AnyBuffer>(i).value();
    outs.push_back({"", with_data ? y->untyped_data() : nullptr, y->size_bytes(),
                    DtypeName(y->element_type()), Dims(*y)});
  }
  return outs;
}

}  // namespace zinfjax

// Every swap handler takes its attributes as one SwapSite: `.Attrs<SwapSite>()`.
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(zinfjax::SwapSite,
                                      xla::ffi::StructMember<int64_t>("store"),
                                      xla::ffi::StructMember<std::string_view>("keys"),
                                      xla::ffi::StructMember<int64_t>("site"),
                                      xla::ffi::StructMember<xla::ffi::Span<const int32_t>>("ranks"),
                                      xla::ffi::StructMember<xla::ffi::Span<const int32_t>>("layers"));

#endif  // ZINFJAX_XLA_FFI_UTIL_H_
