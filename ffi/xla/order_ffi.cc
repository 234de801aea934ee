// zinfjax_after(x, dep) -> x, once dep exists.
//
// zinfjax.ordering chains a program's collectives in one order on every
// device. XLA drops an optimization barrier before its CPU runtime schedules
// thunks, and that runtime orders thunks only by the buffers they read and
// write; this call reads `dep` (an output of the previous collective) and
// writes `x` (an input of the next), aliased, so it costs no copy where XLA
// can alias and one copy of `x` where it cannot.
#include "xla/order_ffi.h"

#include <cstring>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error AfterImpl(ffi::AnyBuffer x, ffi::AnyBuffer dep, ffi::Result<ffi::AnyBuffer> y) {
  (void)dep;
  if (y->untyped_data() != x.untyped_data()) std::memcpy(y->untyped_data(), x.untyped_data(), x.size_bytes());
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZinfjaxAfter, AfterImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
