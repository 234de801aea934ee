// The swap store: each rank's shards in preallocated, striped files on NVMe.
//
// Layout: for every path P in `paths`, the folder P/rank{r}/ holds one
// preallocated file swap.bin; the logical space is striped over those files
// in units of `block_size` (RAID 0), so several drives add up. The first
// folder also holds the manifest (key, dtype, shape, offset, bytes, checksum
// per shard); every folder holds a lock file that keeps a second process out,
// and a folder named twice is refused.
//
// Writes and reads are jobs on I/O driver threads and return tickets; Wait
// rethrows a job's error. Every read is checked against the manifest: a
// missing key, a dtype/shape mismatch, a short file or a bad checksum each
// raise their own error. A failed write never touches other shards' bytes.
#ifndef ZINFJAX_CORE_STORE_H_
#define ZINFJAX_CORE_STORE_H_

#include <atomic>
#include <condition_variable>
#include <exception>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <utility>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "core/aio.h"
#include "core/buffer.h"
#include "core/pool.h"

namespace zinfjax {

struct StoreConfig {
  std::vector<std::string> paths;
  int rank = 0;
  size_t block_size = 1 << 20;        // I/O block and stripe unit
  unsigned queue_depth = 32;          // blocks in flight per transfer
  std::string backend = "auto";       // auto | io_uring | threads
  bool direct = true;                 // O_DIRECT (falls back to buffered where unsupported)
  unsigned io_threads = 2;            // concurrent transfers (driver threads)
  unsigned fallback_threads = 8;      // pread/pwrite workers per driver (threads backend)
  size_t pinned_budget = 64 << 20;    // staging buffer pool budget
  int pool_timeout_ms = 60000;
  int io_nice = 0;                    // added to the I/O threads' nice value (lower CPU priority)
  // Start empty: forget what the folders held (another run's shards, maybe
  // with other shapes, block size or stripe count) and reuse their files'
  // space instead of growing them. A run that creates its states does this.
  bool fresh = false;
  // Host RAM instead of files: the store's space is an anonymous memfd, mapped
  // once (no folder, lock or manifest; reads skip checksums, since View lends
  // the memory for in-place updates). `paths` is ignored. The host tier's store.
  bool memory = false;
};

// One shard of a WriteManyAsync / ReadManyAsync.
struct ShardIo {
  std::string key;
  void* data;                  // source of a write, destination of a read; valid until Wait
  size_t nbytes;
  std::string dtype;
  std::vector<int64_t> shape;
};

struct ShardEntry {
  std::string dtype;
  std::vector<int64_t> shape;
  uint64_t offset = 0;    // logical offset (multiple of kAlignment)
  uint64_t nbytes = 0;
  uint64_t capacity = 0;  // AlignUp(nbytes)
  uint64_t checksum = 0;
};

class SwapStore {
 public:
  explicit SwapStore(StoreConfig config);
  ~SwapStore();
  SwapStore(const SwapStore&) = delete;
  SwapStore& operator=(const SwapStore&) = delete;

  // Copies nothing: `src` must stay valid until Wait(ticket) returns.
  uint64_t WriteAsync(const std::string& key, const void* src, size_t nbytes,
                      const std::string& dtype, const std::vector<int64_t>& shape);
  // Reads into `dst` (valid until Wait). `urgent` reads (those a running XLA
  // program waits on) go ahead of queued bulk transfers.
  uint64_t ReadAsync(const std::string& key, void* dst, size_t nbytes, const std::string& dtype,
                     const std::vector<int64_t>& shape,
                     bool urgent = false);
  // Several shards as one job: one driver wake-up and one submission stream
  // for all of them, which is what small shards (one rank's piece of one
  // layer) need. A read checks every shard as ReadAsync does; a write
  // publishes all of them once all are on disk. Copies nothing.
  uint64_t WriteManyAsync(const std::vector<ShardIo>& shards);
  // WriteAsync of a shard of zeros (`src`: `nbytes` zero bytes). Where the extent it takes
  // was never handed out and lies in space that reads as zeros (what a fresh file or mapping
  // grew by), the shard is registered without copying or writing a byte (fresh moments: most
  // of what init would write).
  uint64_t WriteZerosAsync(const std::string& key, const void* src, size_t nbytes,
                           const std::string& dtype, const std::vector<int64_t>& shape);
  uint64_t ReadManyAsync(const std::vector<ShardIo>& shards, bool urgent = false);
  // Reads whole shards (as written) into one buffer the ticket owns; TakeResults
  // checks each against what the caller expects and copies it out. One XLA
  // custom call starts a layer's reads with this and another takes them.
  // With `in_place`, a store that lends its mapping (LendsMapping) copies nothing: the read
  // taken is the shards where they lie, valid until the keys are written again.
  uint64_t ReadOwnedAsync(const std::vector<std::string>& keys, bool urgent = false,
                          bool in_place = false);
  void TakeResults(uint64_t ticket, const std::vector<ShardIo>& outs);
  void Wait(uint64_t ticket);

  // Makes the manifest and file contents durable (fsync + atomic rename).
  void Sync();
  // Preallocates the files for `bytes` more of shards (ENOSPC now, not mid-training).
  // With `exact`, the files are also cut down to that size: space a previous
  // run left beyond it goes back to the drive.
  void Reserve(uint64_t bytes, bool exact = false);
  // Bytes the stripe files hold on disk (allocated space, reused before growing).
  uint64_t allocated_bytes() const;

  // Copies `src` into a buffer the store owns and writes it in the background;
  // returns once copied, so an XLA custom call does not wait on the disk.
  // Reads (and Entry) of the key wait for it, a second write of the key waits
  // for the first, Sync waits for all; its error becomes the deferred error.
  // At most pinned_budget bytes are in flight this way (the copy waits for room).
  void WriteDetached(const std::string& key, const void* src, size_t nbytes,
                     const std::string& dtype, const std::vector<int64_t>& shape);
  // WriteDetached for several shards as one job (a layer's grads).
  void WriteDetachedMany(const std::vector<ShardIo>& shards, bool in_place = false);
  // A detached write in two steps, for data that arrives later (a device-to-host
  // copy in flight). BeginDetached waits for room as WriteDetached does,
  // allocates the shards (NoSpace is thrown here), makes reads of the keys wait
  // from now on, and lends the buffer to fill: shard i goes at `at[i]`.
  // FinishDetached queues the write; it never throws and makes no blocking
  // call (it may run in a CUDA host function): an error becomes the deferred error.
  // With `in_place`, a store that lends its mapping lends the shards' own extents
  // instead of a buffer (no room to wait for, nothing left to copy): FinishDetached
  // then only publishes them.
  struct DetachedWrite {
    std::vector<std::string> keys;
    std::vector<ShardEntry> entries;
    std::vector<size_t> at;                  // shard i is filled at base + at[i]
    std::unique_ptr<AlignedBuffer> buffer;   // none when the mapping is lent
    uint8_t* base = nullptr;
  };
  DetachedWrite BeginDetached(const std::vector<ShardIo>& shards, bool in_place = false);
  void FinishDetached(DetachedWrite write) noexcept;
  // An owned read handed on without the copy (the CUDA handlers copy it to the
  // device): TakeRead waits for the read and hands over its buffer, shard
  // offsets and entries; CheckRead compares those entries with `outs`
  // (ShardMismatch names the first that differs); GiveBack returns the buffer.
  struct OwnedRead {
    std::vector<std::string> keys;
    std::vector<ShardEntry> entries;
    std::vector<size_t> at;                  // shard i lies at base + at[i]
    std::unique_ptr<AlignedBuffer> buffer;   // none when the mapping is lent
    const uint8_t* base = nullptr;
  };
  OwnedRead TakeRead(uint64_t ticket);
  static void CheckRead(const OwnedRead& read, const std::vector<ShardIo>& outs);
  // Whether the job of `ticket` has finished (Wait would not block).
  bool Done(uint64_t ticket);
  void GiveBack(std::unique_ptr<AlignedBuffer> buffer) { GiveBuffer(std::move(buffer)); }
  // Buffers the store lends (owned reads, detached writes) are passed to `pin`
  // when made and to `unpin` before they are freed: the CUDA handlers page-lock
  // them so device copies from and to them run asynchronously.
  // A memory store's mapping is page-locked with them too, one extent at a time, the first
  // time an in-place read or detached write lends it: only the shards that cross to a device
  // (grads, params), never the optimizer's states, which stay pageable (`pin` says whether it
  // could lock; once it cannot, the store lends buffers instead).
  using PinHook = bool (*)(void*, size_t);
  void SetPinHooks(PinHook pin, AlignedBuffer::FreeHook unpin);
  // Whether in-place reads and detached writes lend the memory store's mapping: a memory
  // store whose pin hook (where set) has not refused an extent (device copies from and to
  // pageable memory would block the caller). ZINFJAX_LEND_MAPPING=0 when the store opens
  // turns it off (buffers are borrowed as for a drive), to time both ways or rule it out.
  bool LendsMapping() const { return config_.memory && lend_mapping_ && !pin_refused_.load(); }
  // Bytes of the mapping page-locked so far (the extents lent to a device).
  uint64_t mapping_pinned_bytes() {
    std::lock_guard<std::mutex> lock(pin_mu_);
    return map_pinned_bytes_;
  }
  // Completed writes of `key` so far: a reader on another thread (the host
  // optimizer) waits for the write a running XLA program makes (the grads).
  uint64_t Generation(const std::string& key) const;
  // Waits until Generation(key) >= generation; false on timeout.
  bool WaitGeneration(const std::string& key, uint64_t generation, int timeout_ms);
  bool Has(const std::string& key) const;
  ShardEntry Entry(const std::string& key) const;
  std::vector<std::string> Keys() const;
  std::string backend_name() const { return backend_name_; }
  bool direct() const { return direct_; }
  std::string folder() const { return folders_.front(); }
  bool memory() const { return config_.memory; }
  // A memory store's bytes of `key` (its entry in `entry`), for reading and
  // updating in place: valid while the store lives and the key is not written
  // again (a write in a transaction moves it to a fresh extent).
  uint8_t* View(const std::string& key, ShardEntry* entry) const;
  // A memory store's shards trade places, pair by pair: each key names the bytes the other
  // named, nothing is copied. Both keys of a pair must hold shards of one dtype and shape,
  // with no transfer of them in flight, outside a transaction. All pairs are checked first.
  void Exchange(const std::vector<std::pair<std::string, std::string>>& pairs);
  // A memory store's shard `key` for an update that reads it and rewrites it whole: the bytes
  // to write (returned) and the bytes to read (`*from`). Inside a transaction that versions
  // the key, its first stage takes the step's fresh extent as its first write would (the new
  // bytes are undefined: the update writes them all) and `*from` is the committed copy, kept
  // for Rollback, so nothing is copied; otherwise both are the shard's current bytes.
  uint8_t* Stage(const std::string& key, ShardEntry* entry, const uint8_t** from);
  std::vector<std::string> files() const;
  PoolStats pool_stats() const { return pool_->Stats(); }
  size_t spare_bytes() {
    std::lock_guard<std::mutex> lock(spare_mu_);
    return spare_bytes_;
  }
  // Lent buffers made so far (no spare of their size was kept), and their bytes: each one is
  // allocated and, with pin hooks, page-locked, then unlocked and freed if no spare room is left
  // when it comes back. Growing every step means `pinned_budget` holds too few of them.
  std::pair<uint64_t, uint64_t> buffers_made() {
    std::lock_guard<std::mutex> lock(spare_mu_);
    return {buffers_made_, buffer_bytes_made_};
  }
  uint64_t bytes_used() const;
  // Bytes the store has read and written (shard payloads, all jobs), since it opened.
  uint64_t bytes_read() const { return bytes_read_.load(); }
  uint64_t bytes_written() const { return bytes_written_.load(); }
  // Bytes of zero shards registered without a write (WriteZerosAsync), since it opened.
  uint64_t bytes_left_zero() const { return bytes_left_zero_.load(); }

  // Test-only fault switch: pretend only `bytes` more can be allocated
  // (negative: off, the default). Lets tests hit ENOSPC without a full disk.
  void SetFaultFreeBytes(int64_t bytes);
  // Test-only fault switch: the write job after the next `writes` ones fails
  // (negative: off). Lets tests break a step half way.
  void SetFaultAfterWrites(int64_t writes);

  // All-or-nothing updates (a training step). After Begin, the first write of
  // an existing key whose name starts with one of `prefixes` goes to a fresh
  // extent (reused from earlier steps' freed ones) and the committed one is
  // kept: readers see the newest, Rollback brings back every committed entry
  // (waiting for the writes in flight first) and Commit frees the old ones.
  // So the keys under `prefixes` need twice their space on disk.
  void Begin(const std::vector<std::string>& prefixes);
  void Commit();
  void Rollback();
  // Undoes only the transaction's writes of `keys` (their committed entries back); the
  // transaction goes on for every other key (a step's update redone, not its program's writes).
  void RollbackKeys(const std::vector<std::string>& keys);
  bool in_transaction() const;

  // Deferred errors, for XLA custom calls inside collective programs: a rank
  // that fails there would leave the other ranks waiting in the next
  // collective, so the handler records the error (the first one wins), lets
  // the program finish, and the caller raises it after the step.
  void set_defer_errors(bool on) { defer_errors_ = on; }
  bool defer_errors() const { return defer_errors_; }
  void DeferError(std::exception_ptr error);
  void RaiseDeferred();  // rethrows the recorded error once (and clears it)

 private:
  struct Job;
  uint64_t Enqueue(std::function<void(Job&)> work, std::vector<std::string> keys,
                   std::vector<ShardEntry> entries, bool write,
                   std::unique_ptr<AlignedBuffer> owned = nullptr, bool urgent = false);
  void WaitWritten(std::unique_lock<std::mutex>& lock, const std::string& key) const;
  // A write's shards made current (manifest, checksums, generations) and a detached write's
  // keys and bytes released; both under mu_.
  // `left_zero`: bytes of them registered as zeros, not written (not counted as written).
  void PublishLocked(const std::vector<std::string>& keys, std::vector<ShardEntry>& entries,
                     const std::vector<uint64_t>& sums, uint64_t left_zero = 0);
  void ReleaseDetachedLocked(const std::vector<std::string>& keys, size_t nbytes);
  // The store's own buffers (engine-owned reads, detached-write copies) come
  // from and go back to a cache of spare ones: the same sizes recur every
  // layer and step, and buffers handed back to malloc stay in its arenas
  // (RSS grows with the threads) or are faulted in and zeroed again (CPU).
  // It keeps at most pinned_budget bytes.
  std::unique_ptr<AlignedBuffer> TakeBuffer(size_t bytes);
  void GiveBuffer(std::unique_ptr<AlignedBuffer> buffer);
  // The job that writes `srcs[i]` as shard `entries[i]` of `keys[i]` (every write path); a
  // null `srcs[i]` is a shard of zeros already in place (only hashed, from `zeros`).
  std::function<void(Job&)> WriteWork(std::vector<std::string> keys, std::vector<ShardEntry> entries,
                                      std::vector<const uint8_t*> srcs,
                                      const uint8_t* zeros = nullptr);
  // The checksum of `nbytes` zero bytes (`zeros`), hashed once for each size: a layer's
  // shards come in a few sizes, written again and again.
  uint64_t ZeroChecksum(const uint8_t* zeros, size_t nbytes);
  // The job that reads shards `entries[i]` of `keys[i]` into `dsts[i]` (no dsts: into the
  // job's own buffer) and checks their checksums.
  std::function<void(Job&)> ReadWork(std::vector<std::string> keys, std::vector<ShardEntry> entries,
                                     std::vector<uint8_t*> dsts);
  // The manifest entry of `key`, once its detached writes are done; checked against the read.
  ShardEntry ReadableEntry(const std::string& key, const std::string& dtype,
                           const std::vector<int64_t>& shape, size_t nbytes);
  static thread_local AioBackend* current_backend_;  // the driver thread's backend
  std::vector<Block> BlocksFor(const ShardEntry& e) const;
  ShardEntry Allocate(const std::string& key, size_t nbytes, const std::string& dtype,
                      const std::vector<int64_t>& shape);
  void EnsureAllocated(uint64_t logical_end);
  // A memory store's growth from `from` to `to` bytes: the memfd grows and its new pages are
  // made (zeroed) and mapped on threads, a share each (MADV_POPULATE_WRITE), where fallocate
  // zeroes them on one thread (about 4 GiB/s) and leaves every first write to fault a page at
  // a time. Returns 0, or the errno of the failure with the memfd back at `from` bytes.
  int GrowMemory(uint64_t from, uint64_t to);
  void CheckReadable(const std::string& key, const ShardEntry& e, const std::string& dtype,
                     const std::vector<int64_t>& shape, size_t nbytes) const;
  void OpenFiles();
  void LoadManifest();
  void WriteManifestLocked();
  std::shared_ptr<Job> FindJob(uint64_t ticket);

  StoreConfig config_;
  std::vector<std::string> folders_;
  std::vector<int> fds_;
  std::vector<uint64_t> file_sizes_;  // bytes allocated per stripe file
  std::vector<int> lock_fds_;  // one flock per stripe folder
  uint8_t* map_ = nullptr;     // a memory store's mapping of its memfd (kMemoryMapBytes)
  bool direct_ = true;
  std::string backend_name_;
  std::unique_ptr<PinnedPool> pool_;

  mutable std::mutex mu_;  // manifest, allocation, jobs, deferred error
  std::atomic<bool> defer_errors_{false};
  std::atomic<uint64_t> bytes_read_{0}, bytes_written_{0}, bytes_left_zero_{0};
  std::exception_ptr deferred_;
  std::map<std::string, ShardEntry> manifest_;
  std::map<std::string, uint64_t> generations_;  // completed writes per key
  std::map<std::string, int> detached_;           // detached writes in flight per key
  uint64_t detached_bytes_ = 0;
  std::mutex spare_mu_;
  std::multimap<size_t, std::unique_ptr<AlignedBuffer>> spare_;  // by size
  size_t spare_bytes_ = 0;
  uint64_t buffers_made_ = 0, buffer_bytes_made_ = 0;
  std::atomic<PinHook> pin_{nullptr};
  AlignedBuffer::FreeHook unpin_ = nullptr;
  // A memory store's page-locked extents of its mapping (offset -> bytes, for unpin_ at close),
  // and whether a pin was refused (nothing is lent from then on); under pin_mu_.
  std::mutex pin_mu_;
  std::unordered_map<uint64_t, uint64_t> map_pins_;
  uint64_t map_pinned_bytes_ = 0;
  std::atomic<bool> pin_refused_{false};
  bool lend_mapping_ = true;
  // Page-locks the extents of `entries` not locked yet, where pin hooks are set; false if refused.
  bool PinExtents(const std::vector<ShardEntry>& entries);
  uint64_t next_offset_ = 0;
  // Logical offsets from here on lie past every file's size at open (or its last shrink):
  // space only ever grown by fallocate/ftruncate, which reads as zeros until written.
  uint64_t zero_from_ = 0;
  std::mutex zero_sums_mu_;
  std::unordered_map<uint64_t, uint64_t> zero_sums_;  // ZeroChecksum's, by size
  int64_t fault_free_bytes_ = -1;
  int64_t fault_writes_ = -1;
  // transaction state (see Begin): extents written in it, entries committed before it
  bool txn_ = false;
  std::vector<std::string> txn_prefixes_;
  std::map<std::string, ShardEntry> txn_pending_;
  std::map<std::string, ShardEntry> txn_old_;
  std::multimap<uint64_t, uint64_t> free_;  // freed extents: capacity -> offset
  uint64_t TakeExtent(uint64_t capacity);    // a freed extent of that size, or new space
  void WaitWritesLocked(std::unique_lock<std::mutex>& lock);  // every write job done (mu_ held)
  // the committed entry of `key` back, its transaction's extent freed (mu_ held)
  void RestoreLocked(const std::string& key, const ShardEntry& pending);

  std::condition_variable work_cv_;          // drivers: a job was queued (or stop)
  mutable std::condition_variable done_cv_;  // a write finished: generations, detached writes
  std::deque<std::shared_ptr<Job>> queue_;
  std::map<uint64_t, std::shared_ptr<Job>> jobs_;
  uint64_t next_ticket_ = 1;
  bool stop_ = false;
  std::vector<std::thread> drivers_;
};

// The engine's handle table: FFI handlers find stores by integer handle.
int64_t RegisterStore(std::shared_ptr<SwapStore> store);
std::shared_ptr<SwapStore> LookupStore(int64_t handle);
void UnregisterStore(int64_t handle);

}  // namespace zinfjax

#endif  // ZINFJAX_CORE_STORE_H_
