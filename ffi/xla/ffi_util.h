// Helpers shared by the CPU and CUDA FFI handlers: dtype names and shapes as
// the swap store's manifest records them, and the guard every handler runs its
// store work in (shard keys: core/keys.h).
#ifndef ZINFJAX_XLA_FFI_UTIL_H_
#define ZINFJAX_XLA_FFI_UTIL_H_

#include <cstdint>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "core/keys.h"
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

// Runs `body(store)` on the swap store behind `handle`; `body` returns void or
// an ffi::Error. Handlers never throw: an exception becomes an ffi::Error or,
// for a store in deferred-error mode, is recorded for the caller to raise once
// the program is done (so the other ranks never wait on a failed one).
template <typename F>
xla::ffi::Error WithStore(int64_t handle, F&& body) {
  std::shared_ptr<SwapStore> store = LookupStore(handle);
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

}  // namespace zinfjax

#endif  // ZINFJAX_XLA_FFI_UTIL_H_
