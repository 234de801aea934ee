// Worker threads kept for the CPU kernels' slices.
//
// AdamW splits each tensor over the machine's cores. Starting those threads
// per call cost 20-40 us a thread, per tensor, per step: on a 16-core host
// about 0.5 ms for each of a layer's large tensors, while its update takes a
// few ms. Workers start once and wait for slices instead.
//
// Linux keeps a nice value per thread, and a thread inherits its creator's;
// without privilege a thread may raise its nice value but never lower it. So
// the workers are kept per nice value of the calling threads: the host
// pipeline's thread (ZeroConfig.host_nice) gets workers as low in priority as
// itself, the main thread workers at its own.
#ifndef ZINFJAX_CORE_WORKERS_H_
#define ZINFJAX_CORE_WORKERS_H_

#include <cstddef>
#include <functional>

namespace zinfjax {

// Runs task(0) .. task(n - 1), task(0) on the calling thread and the others on workers at
// the caller's nice value (at most n - 1 of them, made on first need); returns once all ran.
// Tasks must not throw. Safe to call from several threads at once.
void RunSlices(size_t n, const std::function<void(size_t)>& task);

// Workers made so far, over all nice values (a test's view).
size_t WorkerCount();

}  // namespace zinfjax

#endif  // ZINFJAX_CORE_WORKERS_H_
