#include "core/adam.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/workers.h"

namespace zinfjax {
namespace {

__attribute__((always_inline)) inline float FromBF16(uint16_t b) {
  uint32_t bits = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// One slice of the update. kFrom: read master and moments from `from` (another copy), write
// them to master, m, v; else update those in place.
template <Precision G, Precision P, Precision M, bool kFrom>
__attribute__((always_inline)) inline void Body(float* __restrict master, void* __restrict m,
                                                void* __restrict v, const void* grad,
                                                void* params_out, size_t begin, size_t end,
                                                const AdamHyper& h, const AdamSources& from) {
  const float* gf = static_cast<const float*>(grad);
  const uint16_t* gb = static_cast<const uint16_t*>(grad);
  float* pf = static_cast<float*>(params_out);
  uint16_t* pb = static_cast<uint16_t*>(params_out);
  float* mf = static_cast<float*>(m);
  float* vf = static_cast<float*>(v);
  uint16_t* mb = static_cast<uint16_t*>(m);
  uint16_t* vb = static_cast<uint16_t*>(v);
  const float* xs = kFrom ? from.master : master;
  const float* mfs = kFrom ? static_cast<const float*>(from.m) : mf;
  const float* vfs = kFrom ? static_cast<const float*>(from.v) : vf;
  const uint16_t* mbs = kFrom ? static_cast<const uint16_t*>(from.m) : mb;
  const uint16_t* vbs = kFrom ? static_cast<const uint16_t*>(from.v) : vb;
  const float lr = -h.lr, b1 = h.b1, c1 = h.one_minus_b1, b2 = h.b2, c2 = h.one_minus_b2;
  const float eps = h.eps, wd = h.weight_decay, bc1 = h.bc1, bc2 = h.bc2;
  const uint32_t seed_m = MomentSeed(h.seed, 0), seed_v = MomentSeed(h.seed, 1);
  for (size_t i = begin; i < end; ++i) {
    const float g = G == Precision::kBF16 ? FromBF16(gb[i]) : gf[i];
    const float m0 = M == Precision::kBF16 ? FromBF16(mbs[i]) : mfs[i];
    const float v0 = M == Precision::kBF16 ? FromBF16(vbs[i]) : vfs[i];
    const float x0 = xs[i];
    const float mi = c1 * g + b1 * m0;
    const float vi = c2 * (g * g) + b2 * v0;
    const float update = (mi / bc1) / (std::sqrt(vi / bc2) + eps) + wd * x0;
    const float p = x0 + update * lr;
    if constexpr (M == Precision::kBF16) {
      mb[i] = ToBF16Stochastic(mi, seed_m);
      vb[i] = ToBF16Stochastic(vi, seed_v);
    } else {
      mf[i] = mi;
      vf[i] = vi;
    }
    master[i] = p;
    if constexpr (P == Precision::kF32) pf[i] = p;
    if constexpr (P == Precision::kBF16) pb[i] = ToBF16(p);
  }
}

using Chunk = void (*)(float*, void*, void*, const void*, void*, size_t, size_t, const AdamHyper&,
                       const AdamSources&);

#define ZINFJAX_ADAM_ISA(SUFFIX, TARGET)                                                      \
  template <Precision G, Precision P, Precision M, bool F>                                   \
  TARGET void Chunk##SUFFIX(float* master, void* m, void* v, const void* g, void* p,         \
                            size_t b, size_t e, const AdamHyper& h, const AdamSources& s) {  \
    Body<G, P, M, F>(master, m, v, g, p, b, e, h, s);                                        \
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

template <Precision G, Precision P, Precision M, bool F>
Chunk Pick() {
  switch (kIsa) {
    case Isa::kAvx512: return ChunkAvx512<G, P, M, F>;
    case Isa::kAvx2: return ChunkAvx2<G, P, M, F>;
    default: return ChunkGeneric<G, P, M, F>;
  }
}

template <Precision G, Precision M, bool F>
Chunk PickParams(Precision p) {
  switch (p) {
    case Precision::kBF16: return Pick<G, Precision::kBF16, M, F>();
    case Precision::kF32: return Pick<G, Precision::kF32, M, F>();
    default: return Pick<G, Precision::kNone, M, F>();
  }
}

template <Precision M, bool F>
Chunk PickGrads(Precision g, Precision p) {
  return g == Precision::kBF16 ? PickParams<Precision::kBF16, M, F>(p)
                               : PickParams<Precision::kF32, M, F>(p);
}

template <bool F>
Chunk PickMoments(Precision moments, Precision g, Precision p) {
  return moments == Precision::kBF16 ? PickGrads<Precision::kBF16, F>(g, p)
                                     : PickGrads<Precision::kF32, F>(g, p);
}

}  // namespace

const char* AdamIsa() {
  switch (kIsa) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "generic";
  }
}

void AdamW(float* master, void* m, void* v, Precision moment_type, const void* grad,
           Precision grad_type, void* params_out, Precision params_type, size_t n,
           const AdamHyper& h, int threads, const AdamSources* from) {
  if (params_out == nullptr) params_type = Precision::kNone;
  const AdamSources sources = from ? *from : AdamSources{master, m, v};
  Chunk chunk = from ? PickMoments<true>(moment_type, grad_type, params_type)
                     : PickMoments<false>(moment_type, grad_type, params_type);
  // Pieces of 32K elements (a multiple of 64, so each stays vector-aligned) that the threads
  // claim one at a time: a preempted thread holds up one piece, not a share of the call.
  // A thread per 64K elements at most: below that, a worker's wake-up costs more than it saves.
  constexpr size_t kPiece = 1 << 15, kMinPerThread = 1 << 16;
  ParallelBlocks(n, kPiece, kMinPerThread, threads, [&](size_t begin, size_t end) {
    chunk(master, m, v, grad, params_out, begin, end, h, sources);
  });
}

}  // namespace zinfjax
