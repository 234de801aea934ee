// XLA FFI handler (CPU) that orders one operation after another by data.
#ifndef ZINFJAX_XLA_ORDER_FFI_H_
#define ZINFJAX_XLA_ORDER_FFI_H_

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* ZinfjaxAfter(XLA_FFI_CallFrame* call_frame);
}

#endif  // ZINFJAX_XLA_ORDER_FFI_H_
