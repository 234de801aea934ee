// XLA FFI handler for the fused AdamW kernel, CPU platform.
//
// Operands: master (f32), m, v (both f32 or both bf16: stochastic rounding), grad (f32 or
// bf16), f32 scalars lr, bc1, bc2 (they change every step, so they are operands, not
// attributes), an s32 scalar `count` (the step: bf16 moments' rounding seed) and a pred
// scalar `apply`: false skips the update (a step with non-finite grads), the
// states stay as they are and the params are the master's values.
// Results: master, m, v (aliased to the operands when XLA can) and the new
// compute params (f32 or bf16). Constant hyperparameters are attributes.
#include "xla/adam_ffi.h"

#include <cstring>

#include "core/adam.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace zinfjax {
namespace {

float Scalar(const ffi::Buffer<ffi::F32>& b) { return b.typed_data()[0]; }

void CopyIfNotAliased(const void* in, void* out, size_t bytes) {
  if (in != out) std::memcpy(out, in, bytes);
}

ffi::Error AdamWImpl(ffi::Buffer<ffi::F32> master, ffi::AnyBuffer m, ffi::AnyBuffer v,
                     ffi::AnyBuffer grad, ffi::Buffer<ffi::F32> lr, ffi::Buffer<ffi::F32> bc1,
                     ffi::Buffer<ffi::F32> bc2, ffi::Buffer<ffi::S32> count,
                     ffi::Buffer<ffi::PRED> apply, ffi::ResultBuffer<ffi::F32> master_out,
                     ffi::Result<ffi::AnyBuffer> m_out, ffi::Result<ffi::AnyBuffer> v_out,
                     ffi::Result<ffi::AnyBuffer> params_out, float b1, float one_minus_b1, float b2,
                     float one_minus_b2, float eps, float weight_decay) {
  size_t n = master.element_count();
  if (m.element_count() != n || v.element_count() != n || grad.element_count() != n ||
      params_out->element_count() != n)
    return ffi::Error::InvalidArgument("zinfjax_adamw: master, m, v, grad and params differ in size");
  Precision mt;
  if (m.element_type() != v.element_type() || m.element_type() != m_out->element_type() ||
      v.element_type() != v_out->element_type())
    return ffi::Error::InvalidArgument("zinfjax_adamw: m and v must have one dtype, in and out");
  switch (m.element_type()) {
    case ffi::DataType::F32: mt = Precision::kF32; break;
    case ffi::DataType::BF16: mt = Precision::kBF16; break;
    default: return ffi::Error::InvalidArgument("zinfjax_adamw: moments must be float32 or bfloat16");
  }
  Precision gt, pt;
  switch (grad.element_type()) {
    case ffi::DataType::F32: gt = Precision::kF32; break;
    case ffi::DataType::BF16: gt = Precision::kBF16; break;
    default: return ffi::Error::InvalidArgument("zinfjax_adamw: grads must be float32 or bfloat16");
  }
  switch (params_out->element_type()) {
    case ffi::DataType::F32: pt = Precision::kF32; break;
    case ffi::DataType::BF16: pt = Precision::kBF16; break;
    default: return ffi::Error::InvalidArgument("zinfjax_adamw: params must be float32 or bfloat16");
  }
  CopyIfNotAliased(master.typed_data(), master_out->typed_data(), master.size_bytes());
  CopyIfNotAliased(m.untyped_data(), m_out->untyped_data(), m.size_bytes());
  CopyIfNotAliased(v.untyped_data(), v_out->untyped_data(), v.size_bytes());
  if (!apply.typed_data()[0]) {  // skipped: the params are the (unchanged) master's values
    const float* src = master_out->typed_data();
    if (pt == Precision::kF32) {
      std::memcpy(params_out->untyped_data(), src, n * sizeof(float));
    } else {
      uint16_t* dst = static_cast<uint16_t*>(params_out->untyped_data());
      for (size_t i = 0; i < n; ++i) dst[i] = ToBF16(src[i]);
    }
    return ffi::Error::Success();
  }
  AdamHyper h{Scalar(lr), b1, one_minus_b1, b2, one_minus_b2, eps, weight_decay, Scalar(bc1),
              Scalar(bc2), static_cast<uint32_t>(count.typed_data()[0])};
  AdamW(master_out->typed_data(), m_out->untyped_data(), v_out->untyped_data(), mt,
        grad.untyped_data(), gt, params_out->untyped_data(), pt, n, h);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace zinfjax

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZinfjaxAdamW, zinfjax::AdamWImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("b1")
                                  .Attr<float>("one_minus_b1")
                                  .Attr<float>("b2")
                                  .Attr<float>("one_minus_b2")
                                  .Attr<float>("eps")
                                  .Attr<float>("weight_decay"));
