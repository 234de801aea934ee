// The swap store's manifest: loading and writing it atomically, queries on
// it, and the checks a read makes against it.
#include "core/store.h"

#include <sys/stat.h>

#include <cstring>
#include <fstream>

#include "core/errors.h"
#include "core/store_internal.h"

namespace zinfjax {
namespace {

// Why the manifest could not be written: its folder removed under an open store (a temporary
// folder deleted before the store was closed), or else a full drive.
[[noreturn]] void ManifestWriteFailed(const std::string& tmp, const std::string& folder) {
  struct stat st;
  if (::stat(folder.c_str(), &st) != 0)
    throw EngineError("cannot write swap manifest " + tmp + ": the store's folder " + folder +
                      " is gone (removed while the store was open); close the run's state "
                      "(TrainState.close) before removing its nvme_path");
  throw NoSpace("cannot write swap manifest " + tmp + " (disk full?)");
}

}  // namespace

void SwapStore::LoadManifest() {
  std::ifstream in(folders_[0] + "/manifest.tsv");
  if (!in) return;
  std::string line;
  std::getline(in, line);
  std::istringstream header(line);
  std::string magic;
  int version = 0;
  uint64_t block = 0, files = 0;
  header >> magic >> version >> block >> files;
  if (magic != "zinfjax-swap" || version != 1)
    throw CorruptShard("swap manifest " + folders_[0] + "/manifest.tsv is not a zinfjax v1 manifest");
  if (block != config_.block_size || files != fds_.size())
    throw CorruptShard("swap manifest " + folders_[0] + "/manifest.tsv was written with block size " +
                       std::to_string(block) + " over " + std::to_string(files) +
                       " nvme paths; reopen it with the same nvme paths and block size");
  while (std::getline(in, line)) {
    std::istringstream row(line);
    std::string key, dtype, shape;
    ShardEntry e;
    if (!std::getline(row, key, '\t') || !std::getline(row, e.dtype, '\t') ||
        !std::getline(row, shape, '\t') || !(row >> e.offset >> e.nbytes >> e.capacity >> std::hex >> e.checksum))
      throw CorruptShard("swap manifest " + folders_[0] + "/manifest.tsv has a malformed line: " + line);
    std::stringstream dims(shape);
    std::string d;
    while (std::getline(dims, d, ',')) e.shape.push_back(std::stoll(d));
    manifest_[key] = e;
    next_offset_ = std::max(next_offset_, e.offset + e.capacity);
  }
}

void SwapStore::WriteManifestLocked() {
  if (config_.memory) return;  // nothing outlives a memory store
  std::string path = folders_[0] + "/manifest.tsv", tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << "zinfjax-swap 1 " << config_.block_size << " " << fds_.size() << "\n";
    for (const auto& [key, e] : manifest_)
      out << key << '\t' << e.dtype << '\t' << ShapeString(e.shape) << '\t' << e.offset << ' '
          << e.nbytes << ' ' << e.capacity << ' ' << std::hex << e.checksum << std::dec << "\n";
    if (!out) ManifestWriteFailed(tmp, folders_[0]);
  }
  int fd = open(tmp.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd >= 0) {
    fsync(fd);
    close(fd);
  }
  if (rename(tmp.c_str(), path.c_str()) != 0)
    throw EngineError(SysError("cannot replace swap manifest " + path, errno));
}

void SwapStore::Sync() {
  {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait(lock, [&] { return detached_.empty(); });
  }
  if (config_.memory) return;
  for (int fd : fds_) fdatasync(fd);
  std::lock_guard<std::mutex> lock(mu_);
  WriteManifestLocked();
}

bool SwapStore::Has(const std::string& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  return manifest_.count(key) > 0;
}

ShardEntry SwapStore::Entry(const std::string& key) const {
  std::unique_lock<std::mutex> lock(mu_);
  WaitWritten(lock, key);
  auto it = manifest_.find(key);
  if (it == manifest_.end())
    throw MissingShard("no shard '" + key + "' in the swap manifest of " + folders_[0] +
                       ": it was never written there (or the manifest belongs to another run)");
  return it->second;
}

std::vector<std::string> SwapStore::Keys() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::string> keys;
  for (const auto& kv : manifest_) keys.push_back(kv.first);
  return keys;
}

uint8_t* SwapStore::View(const std::string& key, ShardEntry* entry) const {
  if (!config_.memory)
    throw EngineError("only a host-memory store lends its shards' memory (View of '" + key + "')");
  *entry = Entry(key);  // once its detached writes are done
  return map_ + entry->offset;  // one "file": logical offsets are file offsets
}

void SwapStore::Exchange(const std::vector<std::pair<std::string, std::string>>& pairs) {
  if (!config_.memory) throw EngineError("only a host-memory store exchanges its shards");
  std::unique_lock<std::mutex> lock(mu_);
  if (txn_)
    throw EngineError("swap store: Exchange inside a transaction (Commit or Rollback first)");
  for (const auto& [a, b] : pairs) {
    WaitWritten(lock, a);
    WaitWritten(lock, b);
  }
  for (const auto& [a, b] : pairs) {
    auto ia = manifest_.find(a), ib = manifest_.find(b);
    if (ia == manifest_.end() || ib == manifest_.end())
      throw MissingShard("no shard '" + (ia == manifest_.end() ? a : b) + "' to exchange");
    const ShardEntry &ea = ia->second, &eb = ib->second;
    if (ea.dtype != eb.dtype || ea.shape != eb.shape || ea.nbytes != eb.nbytes)
      throw ShardMismatch("shards '" + a + "' (" + Describe(ea.dtype, ea.shape) + ") and '" + b +
                          "' (" + Describe(eb.dtype, eb.shape) +
                          ") differ: they cannot trade places");
  }
  for (const auto& [a, b] : pairs) std::swap(manifest_[a], manifest_[b]);
}

std::vector<std::string> SwapStore::files() const {
  std::vector<std::string> out;
  for (const auto& f : folders_) out.push_back(f + "/swap.bin");
  return out;
}

uint64_t SwapStore::bytes_used() const {
  std::lock_guard<std::mutex> lock(mu_);
  return next_offset_;
}

void SwapStore::CheckReadable(const std::string& key, const ShardEntry& e,
                              const std::string& dtype, const std::vector<int64_t>& shape,
                              size_t nbytes) const {
  if (e.dtype != dtype || e.shape != shape || e.nbytes != nbytes)
    throw ShardMismatch("shard '" + key + "' was written as " + Describe(e.dtype, e.shape) + " (" +
                        std::to_string(e.nbytes) + " bytes) but is read as " +
                        Describe(dtype, shape) + " (" + std::to_string(nbytes) + " bytes)");
  for (const Block& b : BlocksFor(e)) {
    struct stat st;
    if (fstat(b.fd, &st) != 0) throw EngineError(SysError("fstat swap file", errno));
    uint64_t need = static_cast<uint64_t>(b.file_offset) + b.length;
    if (static_cast<uint64_t>(st.st_size) < need) {
      size_t i = 0;
      while (fds_[i] != b.fd) ++i;
      throw CorruptShard("swap file " + folders_[i] + "/swap.bin is " + std::to_string(st.st_size) +
                         " bytes, shorter than the " + std::to_string(need) + " bytes shard '" +
                         key + "' needs: the file was truncated; restore it from a checkpoint");
    }
  }
}

ShardEntry SwapStore::ReadableEntry(const std::string& key, const std::string& dtype,
                                   const std::vector<int64_t>& shape, size_t nbytes) {
  ShardEntry e = Entry(key);  // waits for its detached writes
  CheckReadable(key, e, dtype, shape, nbytes);
  return e;
}

}  // namespace zinfjax
