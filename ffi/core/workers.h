// A process-wide set of worker threads for element-wise kernels (the CPU AdamW).
//
// Threads are started once and kept, so a call costs a wake-up, not a thread start per worker
// (a step calls the kernel once per tensor part: hundreds of calls). Work is split into
// blocks that threads claim one at a time, so a thread the OS preempts for another (XLA's
// runtime, the copy threads beside a GPU step) delays only the block it holds, not a fixed
// 1/threads share of every call. Several callers may run at once; each call's blocks are
// done by the caller and by whichever workers are free, up to the call's thread count.
// Callers of different nice values (ZeroConfig.host_nice) get workers of their own value.
#ifndef ZINFJAX_CORE_WORKERS_H_
#define ZINFJAX_CORE_WORKERS_H_

#include <cstddef>
#include <functional>

namespace zinfjax {

// Runs body(begin, end) over [0, n) in `block`-element pieces (the last one shorter), on
// at most `threads` threads, the caller one of them; returns when all pieces are done.
// `threads` <= 0: every hardware thread. Pieces begin at multiples of `block`. A call asks
// for a thread per `min_share` elements at most: waking a worker costs more than a small
// call's work.
void ParallelBlocks(size_t n, size_t block, size_t min_share, int threads,
                    const std::function<void(size_t, size_t)>& body);

// memcpy(dst, src, n) on at most `threads` threads (<= 0: every hardware thread), in 4 MiB
// pieces, a thread per 32 MiB at most: a copy into pages never touched before (a fresh host
// store, a fresh buffer) is bound by one thread's page faults, about 2 GiB/s, which scale
// with threads; a copy between touched pages by memory bandwidth, which one thread does not
// reach.
void ParallelCopy(void* dst, const void* src, size_t n, int threads = 0);

}  // namespace zinfjax

#endif  // ZINFJAX_CORE_WORKERS_H_
