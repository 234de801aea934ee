// Helpers shared by the CPU and CUDA FFI handlers: dtype names and shapes as
// the swap store's manifest records them, and shard keys.
#ifndef ZINFJAX_XLA_FFI_UTIL_H_
#define ZINFJAX_XLA_FFI_UTIL_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

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

// The store key of one device's shard of one layer: "{base}/r{rank}/l{layer}".
inline std::string ShardKey(std::string_view base, int32_t rank, int32_t layer) {
  return std::string(base) + "/r" + std::to_string(rank) + "/l" + std::to_string(layer);
}

// The shard keys of one call over several leaves: `bases` holds their base
// keys separated by newlines (a key holds no newline).
inline std::vector<std::string> ShardKeys(std::string_view bases, int32_t rank, int32_t layer) {
  std::vector<std::string> keys;
  for (size_t start = 0; start <= bases.size();) {
    size_t end = bases.find('\n', start);
    if (end == std::string_view::npos) end = bases.size();
    keys.push_back(ShardKey(bases.substr(start, end - start), rank, layer));
    start = end + 1;
  }
  return keys;
}

}  // namespace zinfjax

#endif  // ZINFJAX_XLA_FFI_UTIL_H_
