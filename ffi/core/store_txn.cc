// The swap store's all-or-nothing steps: Begin / Commit / Rollback (see store.h).
#include "core/store.h"

#include "core/errors.h"
#include "core/store_internal.h"

namespace zinfjax {

void SwapStore::Begin(const std::vector<std::string>& prefixes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (txn_) throw EngineError("swap store: Begin inside a transaction (Commit or Rollback first)");
  txn_ = true;
  txn_prefixes_ = prefixes;
}

void SwapStore::Commit() {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [key, old] : txn_old_) free_.emplace(old.capacity, old.offset);
  txn_old_.clear();
  txn_pending_.clear();
  txn_ = false;
}

void SwapStore::WaitWritesLocked(std::unique_lock<std::mutex>& lock) {
  done_cv_.wait(lock, [&] {
    for (const auto& [ticket, job] : jobs_)
      if (job->write && !job->done) return false;
    return true;
  });
}

void SwapStore::RestoreLocked(const std::string& key, const ShardEntry& pending) {
  free_.emplace(pending.capacity, pending.offset);
  auto old = txn_old_.find(key);
  if (old != txn_old_.end()) {
    manifest_[key] = old->second;
    txn_old_.erase(old);
  } else {
    manifest_.erase(key);
  }
}

void SwapStore::Rollback() {
  std::unique_lock<std::mutex> lock(mu_);
  WaitWritesLocked(lock);  // the writes in flight land before their extents are given back
  for (const auto& [key, e] : txn_pending_) RestoreLocked(key, e);
  txn_old_.clear();
  txn_pending_.clear();
  txn_ = false;
}

void SwapStore::RollbackKeys(const std::vector<std::string>& keys) {
  std::unique_lock<std::mutex> lock(mu_);
  if (!txn_) throw EngineError("swap store: RollbackKeys outside a transaction (Begin first)");
  WaitWritesLocked(lock);
  for (const std::string& key : keys) {
    auto pending = txn_pending_.find(key);
    if (pending == txn_pending_.end()) continue;  // not rewritten in this transaction
    RestoreLocked(key, pending->second);
    txn_pending_.erase(pending);
  }
}

uint8_t* SwapStore::Stage(const std::string& key, ShardEntry* entry, const uint8_t** from) {
  if (!config_.memory)
    throw EngineError("only a host-memory store stages its shards in place (Stage of '" + key + "')");
  const ShardEntry now = Entry(key);  // once its detached writes are done
  *from = map_ + now.offset;
  ShardEntry e = Allocate(key, now.nbytes, now.dtype, now.shape);
  if (e.offset != now.offset) {  // versioned: the step's copy, read from the committed one
    std::lock_guard<std::mutex> lock(mu_);
    e.checksum = now.checksum;  // a memory store's reads skip it (updated in place)
    manifest_[key] = e;
  }
  *entry = e;
  return map_ + e.offset;
}

bool SwapStore::in_transaction() const {
  std::lock_guard<std::mutex> lock(mu_);
  return txn_;
}

}  // namespace zinfjax
