#include "core/adam.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

namespace zinfjax {
namespace {

template <Precision G, Precision P>
__attribute__((always_inline)) inline void Body(float* __restrict master, float* __restrict m,
                                                float* __restrict v, const void* grad,
                                                void* params_out, size_t begin, size_t end,
                                                const AdamHyper& h) {
  const float* gf = static_cast<const float*>(grad);
  const uint16_t* gb = static_cast<const uint16_t*>(grad);
  float* pf = static_cast<float*>(params_out);
  uint16_t* pb = static_cast<uint16_t*>(params_out);
  const float lr = -h.lr, b1 = h.b1, c1 = h.one_minus_b1, b2 = h.b2, c2 = h.one_minus_b2;
  const float eps = h.eps, wd = h.weight_decay, bc1 = h.bc1, bc2 = h.bc2;
  for (size_t i = begin; i < end; ++i) {
    float g;
    if constexpr (G == Precision::kBF16) {
      uint32_t bits = static_cast<uint32_t>(gb[i]) << 16;
      std::memcpy(&g, &bits, 4);
    } else {
      g = gf[i];
    }
    const float mi = c1 * g + b1 * m[i];
    const float vi = c2 * (g * g) + b2 * v[i];
    const float update = (mi / bc1) / (std::sqrt(vi / bc2) + eps) + wd * master[i];
    const float p = master[i] + update * lr;
    m[i] = mi;
    v[i] = vi;
    master[i] = p;
    if constexpr (P == Precision::kF32) pf[i] = p;
    if constexpr (P == Precision::kBF16) pb[i] = ToBF16(p);
  }
}

using Chunk = void (*)(float*, float*, float*, const void*, void*, size_t, size_t, const AdamHyper&);

#define ZINFJAX_ADAM_ISA(SUFFIX, TARGET)                                                      \
  template <Precision G, Precision P>                                                        \
  TARGET void Chunk##SUFFIX(float* master, float* m, float* v, const void* g, void* p,       \
                            size_t b, size_t e, const AdamHyper& h) {                        \
    Body<G, P>(master, m, v, g, p, b, e, h);                                                 \
  }

ZINFJAX_ADAM_ISA(Avx512, __attribute__((target("avx512f,avx512bw,avx512vl"))))
ZINFJAX_ADAM_ISA(Avx2, __attribute__((target("avx2"))))
ZINFJAX_ADAM_ISA(Generic, )

enum class Isa { kAvx512, kAvx2, kGeneric };

Isa Detect() {
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512vl"))
    return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2")) return Isa::kAvx2;
  return Isa::kGeneric;
}

const Isa kIsa = Detect();

template <Precision G, Precision P>
Chunk Pick() {
  switch (kIsa) {
    case Isa::kAvx512: return ChunkAvx512<G, P>;
    case Isa::kAvx2: return ChunkAvx2<G, P>;
    default: return ChunkGeneric<G, P>;
  }
}

template <Precision G>
Chunk PickParams(Precision p) {
  switch (p) {
    case Precision::kBF16: return Pick<G, Precision::kBF16>();
    case Precision::kF32: return Pick<G, Precision::kF32>();
    default: return Pick<G, Precision::kNone>();
  }
}

}  // namespace

const char* AdamIsa() {
  switch (kIsa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "generic";
  }
}

void AdamW(float* master, float* m, float* v, const void* grad, Precision grad_type,
           void* params_out, Precision params_type, size_t n, const AdamHyper& h, int threads) {
  Chunk chunk = grad_type == Precision::kBF16 ? PickParams<Precision::kBF16>(params_type)
                                              : PickParams<Precision::kF32>(params_type);
  if (params_out == nullptr) chunk = grad_type == Precision::kBF16
                                         ? Pick<Precision::kBF16, Precision::kNone>()
                                         : Pick<Precision::kF32, Precision::kNone>();
  constexpr size_t kMinPerThread = 1 << 16;
  size_t workers = threads > 0 ? static_cast<size_t>(threads)
                               : std::max(1u, std::thread::hardware_concurrency());
  workers = std::max<size_t>(1, std::min(workers, n / kMinPerThread));
  if (workers == 1) {
    chunk(master, m, v, grad, params_out, 0, n, h);
    return;
  }
  // Split on 64-element boundaries so every thread's slice stays vector-aligned.
  size_t per = ((n + workers - 1) / workers + 63) & ~size_t(63);
  std::vector<std::thread> pool;
  for (size_t w = 1; w < workers; ++w) {
    size_t b = std::min(n, w * per), e = std::min(n, b + per);
    if (b < e) pool.emplace_back(chunk, master, m, v, grad, params_out, b, e, std::cref(h));
  }
  chunk(master, m, v, grad, params_out, 0, std::min(n, per), h);
  for (auto& t : pool) t.join();
}

}  // namespace zinfjax
