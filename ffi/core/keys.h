// Shard keys of the swap store: the one definition, used by the FFI handlers
// (CPU and CUDA) and, through the Python module, by zinfjax's placement plan.
#ifndef ZINFJAX_CORE_KEYS_H_
#define ZINFJAX_CORE_KEYS_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace zinfjax {

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

#endif  // ZINFJAX_CORE_KEYS_H_
