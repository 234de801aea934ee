// XLA FFI handler (CPU) for the fused AdamW kernel.
#ifndef ZINFJAX_XLA_ADAM_FFI_H_
#define ZINFJAX_XLA_ADAM_FFI_H_

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* ZinfjaxAdamW(XLA_FFI_CallFrame* call_frame);
}

#endif  // ZINFJAX_XLA_ADAM_FFI_H_
