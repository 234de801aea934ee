// What the swap store's source files share (not part of its interface): the
// job a driver thread runs, and small helpers. See store.h.
#ifndef ZINFJAX_CORE_STORE_INTERNAL_H_
#define ZINFJAX_CORE_STORE_INTERNAL_H_

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <sstream>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/store.h"

namespace zinfjax {

struct SwapStore::Job {
  std::function<void(Job&, AioBackend&)> work;
  bool done = false;
  std::exception_ptr error;
  std::unique_ptr<AlignedBuffer> result;  // a read's own buffer, or a detached write's copy
  bool detached = false;                  // nobody waits: the store finishes it itself
  bool write = false;                     // completing it bumps a generation
  bool lent = false;                      // an in-place read: its shards lie in the mapping
  std::condition_variable cv;             // its own waiter: a read wakes only its caller
  uint64_t ticket = 0;
  std::vector<std::string> keys;
  std::vector<ShardEntry> entries;  // what a read expects
};

// The address space a memory store maps (reserved, not used: pages exist as
// the memfd grows), so views of its shards never move. 4 TiB.
constexpr uint64_t kMemoryMapBytes = uint64_t{1} << 42;

// Helpers of the store_*.cc files.
// Where each shard of a job lies in the job's own buffer: 4 KiB-aligned, so
// reads into it skip the staging copy.
inline std::vector<size_t> Offsets(const std::vector<ShardEntry>& entries, size_t* total) {
  std::vector<size_t> at;
  size_t pos = 0;
  for (const ShardEntry& e : entries) {
    at.push_back(pos);
    pos += AlignUp(e.nbytes);
  }
  *total = pos;
  return at;
}

inline void MakeDirs(const std::string& path) {
  std::string partial;
  std::stringstream ss(path);
  std::string part;
  if (!path.empty() && path[0] == '/') partial = "/";
  while (std::getline(ss, part, '/')) {
    if (part.empty()) continue;
    partial += part + "/";
    if (mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST)
      throw EngineError(SysError("cannot create nvme_path folder " + partial +
                                 " (choose a writable nvme_path)", errno));
  }
}

inline std::string ShapeString(const std::vector<int64_t>& shape) {
  std::string s;
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? "," : "") + std::to_string(shape[i]);
  return s;
}

inline std::string Describe(const std::string& dtype, const std::vector<int64_t>& shape) {
  return dtype + "[" + ShapeString(shape) + "]";
}

inline uint64_t FreeBytes(const std::string& folder) {
  struct statvfs s;
  if (statvfs(folder.c_str(), &s) != 0) return 0;
  return static_cast<uint64_t>(s.f_bavail) * s.f_frsize;
}

}  // namespace zinfjax

#endif  // ZINFJAX_CORE_STORE_INTERNAL_H_
