// XLA FFI handler for the fused AdamW kernel, CPU platform.
//
// Operands: master, m, v (f32), grad (f32 or bf16), f32 scalars lr, bc1, bc2
// (they change every step, so they are operands, not attributes) and a pred
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

void CopyIfNotAliased(const ffi::Buffer<ffi::F32>& in, ffi::ResultBuffer<ffi::F32>& out) {
  if (in.typed_data() != out->typed_data())
    std::memcpy(out->typed_data(), in.typed_data(), in.element_count() * sizeof(float));
}

ffi::Error AdamWImpl(ffi::Buffer<ffi::F32> master, ffi::Buffer<ffi::F32> m, ffi::Buffer<ffi::F32> v,
                     ffi::AnyBuffer grad, ffi::Buffer<ffi::F32> lr, ffi::Buffer<ffi::F32> bc1,
                     ffi::Buffer<ffi::F32> bc2, ffi::Buffer<ffi::PRED> apply,
                     ffi::ResultBuffer<ffi::F32> master_out,
                     ffi::ResultBuffer<ffi::F32> m_out, ffi::ResultBuffer<ffi::F32> v_out,
                     ffi::Result<ffi::AnyBuffer> params_out, float b1, float one_minus_b1, float b2,
                     float one_minus_b2, float eps, float weight_decay) {
  size_t n = master.element_count();
  if (m.element_count() != n || v.element_count() != n || grad.element_count() != n ||
      params_out->element_count() != n)
    return ffi::Error::InvalidArgument("zinfjax_adamw: master, m, v, grad and params differ in size");
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
  CopyIfNotAliased(master, master_out);
  CopyIfNotAliased(m, m_out);
  CopyIfNotAliased(v, v_out);
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
              Scalar(bc2)};
  AdamW(master_out->typed_data(), m_out->typed_data(), v_out->typed_data(), grad.untyped_data(), gt,
        params_out->untyped_data(), pt, n, h);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace zinfjax

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZinfjaxAdamW, zinfjax::AdamWImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<float>("b1")
                                  .Attr<float>("one_minus_b1")
                                  .Attr<float>("b2")
                                  .Attr<float>("one_minus_b2")
                                  .Attr<float>("eps")
                                  .Attr<float>("weight_decay"));
