// Fused CPU AdamW: one pass over fp32 master params and moments.
//
// Reads the gradient (fp32 or bf16), updates the moments and the fp32 master
// in place, and writes the compute params (bf16, round to nearest even, or
// fp32) in the same pass, so each byte crosses memory once. The arithmetic
// follows optax.adamw operation by operation (no fused multiply-adds); on fp32
// inputs it agrees with optax to float32 rounding (~1e-7 relative). SIMD: AVX-512 or AVX2
// builds of the same loop, chosen at run time; threads split the elements.
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
};

// grad: fp32 or bf16 (as uint16 bits); params_out may be null (kNone).
void AdamW(float* master, float* m, float* v, const void* grad, Precision grad_type,
           void* params_out, Precision params_type, size_t n, const AdamHyper& h,
           int threads = 0);

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

}  // namespace zinfjax

#endif  // ZINFJAX_CORE_ADAM_H_
