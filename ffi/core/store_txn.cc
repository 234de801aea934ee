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

void SwapStore::Rollback() {
  std::unique_lock<std::mutex> lock(mu_);
  // the writes in flight land before their extents are given back
  done_cv_.wait(lock, [&] {
    for (const auto& [ticket, job] : jobs_)
      if (job->write && !job->done) return false;
    return true;
  });
  for (const auto& [key, e] : txn_pending_) {
    free_.emplace(e.capacity, e.offset);
    auto old = txn_old_.find(key);
    if (old != txn_old_.end()) {
      manifest_[key] = old->second;
    } else {
      manifest_.erase(key);
    }
  }
  txn_old_.clear();
  txn_pending_.clear();
  txn_ = false;
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
