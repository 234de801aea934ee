// Asynchronous file I/O: io_uring (raw syscalls) with a thread-pool fallback.
//
// A backend takes block requests (file, offset, length, aligned buffer) and
// reports completions; `Transfer` splits one logical extent into blocks,
// stages them through the pinned pool and keeps up to `queue_depth` blocks in
// flight together, verifying or computing a checksum in logical byte order.
#ifndef ZINFJAX_CORE_AIO_H_
#define ZINFJAX_CORE_AIO_H_

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/pool.h"

namespace zinfjax {

struct IoRequest {
  int fd = -1;
  bool write = false;
  uint8_t* buf = nullptr;
  size_t len = 0;
  off_t offset = 0;
  uint64_t tag = 0;
};

struct IoCompletion {
  uint64_t tag = 0;
  int64_t result = 0;  // bytes moved, or -errno
};

class AioBackend {
 public:
  virtual ~AioBackend() = default;
  // Queues one request (at most queue_depth outstanding at a time).
  virtual void Submit(const IoRequest& request) = 0;
  // Sends queued requests to the kernel and waits for at least `min` completions.
  virtual void Reap(std::vector<IoCompletion>* out, size_t min) = 0;
  virtual std::string name() const = 0;
};

// kind: "auto" (io_uring, else threads), "io_uring", or "threads".
// Throws BackendUnavailable when "io_uring" is asked for and cannot be set up.
std::unique_ptr<AioBackend> MakeBackend(const std::string& kind, unsigned queue_depth,
                                        unsigned threads);

// One block of a logical extent: where it lives on disk and where in the extent.
struct Block {
  int fd;
  off_t file_offset;
  size_t length;          // multiple of kAlignment
  size_t extent_offset;   // from the start of the extent
};

struct TransferOptions {
  unsigned queue_depth = 32;
  std::chrono::milliseconds pool_timeout{60000};
};

// One shard's part of a transfer: the blocks of its file extent (covering
// AlignUp(nbytes)) and the caller's bytes.
struct Extent {
  std::vector<Block> blocks;
  uint8_t* data;          // source of a write, destination of a read
  size_t nbytes;
  std::string what;       // names it in read errors
};

// Writes every extent, keeping up to `queue_depth` blocks in flight across
// all of them (one submission stream for many small shards); returns each
// extent's checksum. Zero-pads the tails.
std::vector<uint64_t> WriteExtents(AioBackend& backend, PinnedPool& pool,
                                   const std::vector<Extent>& extents, const TransferOptions& options);

// Reads every extent (as WriteExtents); returns the checksums of the bytes read.
std::vector<uint64_t> ReadExtents(AioBackend& backend, PinnedPool& pool,
                                  const std::vector<Extent>& extents, const TransferOptions& options);

// One extent of the above.
uint64_t WriteExtent(AioBackend& backend, PinnedPool& pool, const std::vector<Block>& blocks,
                     const uint8_t* src, size_t nbytes, const TransferOptions& options);
uint64_t ReadExtent(AioBackend& backend, PinnedPool& pool, const std::vector<Block>& blocks,
                    uint8_t* dst, size_t nbytes, const TransferOptions& options,
                    const std::string& what);

}  // namespace zinfjax

#endif  // ZINFJAX_CORE_AIO_H_
