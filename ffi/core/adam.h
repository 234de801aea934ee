// Fused CPU AdamW: one pass over fp32 master params and moments.
//
// Reads the gradient (fp32 or bf16), updates the moments and the fp32 master
// in place, and writes the compute params (bf16, round to nearest even, or
// fp32) in the same pass, so each byte crosses memory once. The arithmetic
// follows optax.adamw operation by operation (no fused multiply-adds); on fp32
// inputs it agrees with optax to float32 rounding (~1e-7 relative). SIMD: AVX-512 or AVX2
// builds of the same loop, chosen at run time; the shared workers (core/workers.h)
// claim the elements in pieces.
#ifndef ZINFJAX_CORE_ADAM_H_
#define ZINFJAX_CORE_ADAM_H_

#include <cstddef>
#include <cstdint>

namespace zinfjax {

enum class Precision { kNone, kF32, kBF16 };

struct AdamHyper {
  float lr;            // learning rate at this step
  float b1, one_minus_b1;
  float b2, one_minus_b2;
  float eps;
  float weight_decay;  // 0 where masked
  float bc1, bc2;      // bias corrections 1 - b^t, computed by the caller like optax
  uint32_t seed = 0;   // bf16 moments: the step's stochastic-rounding seed (MomentSeed)
};

// The master params and moments an update reads, when they are another copy than the one it
// writes: an all-or-nothing step in host RAM reads the committed copy and writes the step's
// new one, so the old copy is kept without first being copied. Same dtypes as the outputs;
// neither may overlap an output.
struct AdamSources {
  const float* master;
  const void* m;
  const void* v;
};

// grad: fp32 or bf16 (as uint16 bits); params_out may be null (kNone). The moments m and v
// are fp32, or bf16 (moment_type kBF16: read exactly, updated in fp32, stored with
// stochastic rounding, ToBF16Stochastic). `from` null: master, m and v are updated in place;
// else they are written from `from`'s values (the same update, bit for bit).
void AdamW(float* master, void* m, void* v, Precision moment_type, const void* grad,
           Precision grad_type, void* params_out, Precision params_type, size_t n,
           const AdamHyper& h, int threads = 0, const AdamSources* from = nullptr);

// The instruction set the kernel dispatches to on this CPU: avx512, avx2 or generic.
const char* AdamIsa();

// float -> bf16 bits, round to nearest even (NaN stays NaN). Branch-free so
// the kernel's loop still vectorizes.
inline uint16_t ToBF16(float f) {
  uint32_t bits;
  __builtin_memcpy(&bits, &f, 4);
  uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? (bits >> 16) | 0x40u : rounded);
}

// A 32-bit integer hash (lowbias32): the pseudo-random source of stochastic rounding.
inline uint32_t Mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// The seed of step `count` for moment `which` (0: m, 1: v); jnp computes the same.
inline uint32_t MomentSeed(uint32_t count, uint32_t which) {
  return Mix32(count * 0x9e3779b9u + which * 0x85ebca6bu + 1u);
}

// float -> bf16 bits, rounded up with probability (dropped bits) / 2^16: unbiased, so a
// second moment's small increments (b2 = 0.999 adds 0.1% a step, under bf16's 0.4% spacing)
// accumulate instead of rounding away. The 16 random bits hash the bits the value keeps (its
// bf16 truncation) with the step's seed, so every driver (jnp, this kernel, any sharding or
// part split) draws the same threshold for a value: one float32 ulp apart (XLA may fuse a
// multiply-add this loop does not), they round apart with probability 2^-16. Non-finite
// values round to nearest.
inline uint16_t ToBF16Stochastic(float f, uint32_t seed) {
  uint32_t bits;
  __builtin_memcpy(&bits, &f, 4);
  uint32_t up = (bits + (Mix32((bits >> 16) ^ seed) & 0xffffu)) >> 16;
  return static_cast<uint16_t>((bits & 0x7fffffffu) >= 0x7f800000u ? ToBF16(f) : up);
}

}  // namespace zinfjax

#endif  // ZINFJAX_CORE_ADAM_H_
