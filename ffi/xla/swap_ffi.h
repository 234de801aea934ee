// XLA FFI handlers (CPU) that move shards between XLA buffers and the swap store.
#ifndef ZINFJAX_XLA_SWAP_FFI_H_
#define ZINFJAX_XLA_SWAP_FFI_H_

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* ZinfjaxSwapWriteMany(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* ZinfjaxSwapReadStartMany(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* ZinfjaxSwapReadWaitMany(XLA_FFI_CallFrame* call_frame);
}

#endif  // ZINFJAX_XLA_SWAP_FFI_H_
