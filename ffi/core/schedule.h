// Where a swap call is in the static layer schedule, known on the host.
//
// XLA:GPU runs an FFI handler on the host thread that launches the program's
// kernels, well before those kernels run: the rank and layer of the shard a
// call moves are device values at that moment, and reading them back would
// drain the stream. The schedule is static, so zinfjax attaches it to every
// call as attributes: `ranks` holds (device ordinal, data-axis rank) pairs
// for the devices of this process, and `layers[k]` the layer of the k-th execution of the
// call (modulo its length) within one run of the program. CallSchedule counts
// executions per (call site, device) and starts over when a new run begins,
// so a run that stopped half-way does not shift the next one.
//
// OwnedReads pairs a read started by one call with the call that takes its
// result, by the shard key both compute, so the ticket (a device value) never
// has to be read back either.
#ifndef ZINFJAX_CORE_SCHEDULE_H_
#define ZINFJAX_CORE_SCHEDULE_H_

#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "core/errors.h"

namespace zinfjax {

class CallSchedule {
 public:
  // The layer of this execution of call `site` on device `ordinal` in run `run`.
  int32_t Layer(int64_t site, int32_t ordinal, int64_t run, const int32_t* layers, size_t n) {
    if (n == 0) throw EngineError("a swap call carries an empty layer schedule");
    std::lock_guard<std::mutex> lock(mu_);
    Count& c = counts_[{site, ordinal}];
    if (c.calls == 0 || c.run != run) c = Count{run, 0};
    return layers[c.calls++ % n];
  }

 private:
  struct Count {
    int64_t run = 0;
    uint64_t calls = 0;
  };
  std::mutex mu_;
  std::map<std::pair<int64_t, int32_t>, Count> counts_;
};

// The data-axis rank of the device with ordinal `ordinal`: `pairs` holds
// n/2 (ordinal, rank) pairs from the call's mesh.
inline int32_t RankOf(int32_t ordinal, const int32_t* pairs, size_t n) {
  for (size_t i = 0; i + 1 < n; i += 2)
    if (pairs[i] == ordinal) return pairs[i + 1];
  throw EngineError("device ordinal " + std::to_string(ordinal) +
                    " is not in the mesh this swap call was traced for");
}

class OwnedReads {
 public:
  void Put(int64_t store, const std::string& key, uint64_t ticket) {
    std::lock_guard<std::mutex> lock(mu_);
    tickets_[{store, key}].push_back(ticket);
  }

  // The oldest read of `key` still untaken (or, given `exact`, that one: a check
  // that the schedule names the read the program passes). nullopt: none.
  std::optional<uint64_t> Take(int64_t store, const std::string& key,
                               std::optional<uint64_t> exact = std::nullopt) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = tickets_.find({store, key});
    if (it == tickets_.end()) return std::nullopt;
    std::deque<uint64_t>& q = it->second;
    auto at = q.begin();
    if (exact) {
      while (at != q.end() && *at != *exact) ++at;
      if (at == q.end()) return std::nullopt;
    }
    uint64_t ticket = *at;
    q.erase(at);
    if (q.empty()) tickets_.erase(it);
    return ticket;
  }

 private:
  std::mutex mu_;
  std::map<std::pair<int64_t, std::string>, std::deque<uint64_t>> tickets_;
};

// The process's schedule and owned reads (one per module that links the core:
// the CPU and the CUDA handlers each keep their own).
inline CallSchedule& ProcessSchedule() {
  static auto* s = new CallSchedule();
  return *s;
}

inline OwnedReads& ProcessOwnedReads() {
  static auto* o = new OwnedReads();
  return *o;
}

}  // namespace zinfjax

#endif  // ZINFJAX_CORE_SCHEDULE_H_
