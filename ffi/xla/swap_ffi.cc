// XLA FFI handlers for the swap store, CPU platform.
//
// Three calls move one layer's shards of several leaves as one store job:
// write_many, read_start_many (starts the reads into engine-owned buffers)
// and read_wait_many (takes their results). A call finds its shards from the
// host's copy of the static schedule (SwapSite: the rank by device ordinal,
// the layer by count of executions), as the CUDA handlers must; here the
// program's own rank, layer and ticket operands are in host memory too, and
// every call checks that the schedule agrees with them, so the CPU suite
// proves the schedule the GPU path relies on. Reads take the token of the
// write they depend on: XLA orders FFI calls only by data. Handlers return
// ffi::Error and never throw; a store in deferred-error mode records the
// error instead, for the caller to raise once the program is done.
#include "xla/swap_ffi.h"

#include <atomic>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "core/errors.h"
#include "core/store.h"
#include "xla/ffi/api/ffi.h"
#include "xla/ffi_util.h"

namespace ffi = xla::ffi;

namespace zinfjax {
namespace {

std::atomic<int32_t> write_tokens{1};

// The shard keys from the schedule, checked against the program's rank and layer.
std::vector<std::string> Keys(const char* call, const SwapSite& at, int32_t ordinal,
                              ffi::RunId run, const ffi::Buffer<ffi::S32>& rank,
                              const ffi::Buffer<ffi::S32>& layer) {
  int32_t r = 0, l = 0;
  std::vector<std::string> keys = ScheduledKeys(call, at, ordinal, run.run_id, &r, &l);
  if (r != rank.typed_data()[0] || l != layer.typed_data()[0])
    throw EngineError(std::string(call) + " (site " + std::to_string(at.site) +
                      "): the host schedule gives rank " + std::to_string(r) + ", layer " +
                      std::to_string(l) + " but the program computed rank " +
                      std::to_string(rank.typed_data()[0]) + ", layer " +
                      std::to_string(layer.typed_data()[0]) + " (device ordinal " +
                      std::to_string(ordinal) + "); the call's `ranks`/`layers` schedule is wrong");
  return keys;
}

ffi::Error WriteManyImpl(int32_t ordinal, ffi::RunId run, ffi::Buffer<ffi::S32> rank,
                         ffi::Buffer<ffi::S32> layer, ffi::RemainingArgs xs,
                         ffi::ResultBuffer<ffi::S32> token, SwapSite at) {
  return WithStore(at.store, [&](SwapStore& s) {
    std::vector<std::string> names = Keys("zinfjax_swap_write_many", at, ordinal, run, rank, layer);
    // returns once copied (into a memory store's mapping, or a buffer the disk write drains
    // while the program goes on)
    s.WriteDetachedMany(WriteShards(names, xs, /*with_data=*/true), /*in_place=*/true);
    token->typed_data()[0] = write_tokens.fetch_add(1);
  });
}

ffi::Error ReadStartManyImpl(int32_t ordinal, ffi::RunId run, ffi::Buffer<ffi::S32> token,
                             ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> layer,
                             ffi::ResultBuffer<ffi::S32> ticket, SwapSite at) {
  (void)token;  // only orders this read after its write
  return WithStore(at.store, [&](SwapStore& s) {
    std::vector<std::string> names = Keys("zinfjax_swap_read_start_many", at, ordinal, run, rank, layer);
    uint64_t t = s.ReadOwnedAsync(names, /*urgent=*/true, /*in_place=*/true);
    ProcessOwnedReads().Put(at.store, names.front(), t);
    ticket->typed_data()[0] = static_cast<int32_t>(t);
  });
}

ffi::Error ReadWaitManyImpl(int32_t ordinal, ffi::RunId run, ffi::Buffer<ffi::S32> ticket,
                            ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> layer,
                            ffi::RemainingRets ys, SwapSite at) {
  return WithStore(at.store, [&](SwapStore& s) {
    std::vector<std::string> names = Keys("zinfjax_swap_read_wait_many", at, ordinal, run, rank, layer);
    auto t = static_cast<uint64_t>(ticket.typed_data()[0]);
    if (!ProcessOwnedReads().Take(at.store, names.front(), t))
      throw EngineError("zinfjax_swap_read_wait_many (site " + std::to_string(at.site) +
                        "): the schedule names shard " + names.front() + " but ticket " +
                        std::to_string(t) + " read another");
    s.TakeResults(t, ReadOuts(ys, /*with_data=*/true));
  });
}

}  // namespace
}  // namespace zinfjax

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZinfjaxSwapWriteMany, zinfjax::WriteManyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attrs<zinfjax::SwapSite>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZinfjaxSwapReadStartMany, zinfjax::ReadStartManyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attrs<zinfjax::SwapSite>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZinfjaxSwapReadWaitMany, zinfjax::ReadWaitManyImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::RunId>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingRets()
                                  .Attrs<zinfjax::SwapSite>());
