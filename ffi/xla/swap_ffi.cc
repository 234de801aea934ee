// XLA FFI handlers for the swap store, CPU platform.
//
// The store is an attribute (a handle into the engine's table); the shard's
// rank and layer are int32 operands, so one compiled call serves every device
// of a shard_map and every iteration of a scan. Reads take the token of the
// write they depend on as an operand: XLA orders FFI calls only by data.
// Handlers return ffi::Error and never throw; a store in deferred-error mode
// records the error instead, for the caller to raise once the program is done.
#include "xla/swap_ffi.h"

#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/errors.h"
#include "core/store.h"
#include "xla/ffi/api/ffi.h"
#include "xla/ffi_util.h"

namespace ffi = xla::ffi;

namespace zinfjax {
namespace {

std::atomic<int32_t> write_tokens{1};

std::string Key(std::string_view base, const ffi::Buffer<ffi::S32>& rank,
                const ffi::Buffer<ffi::S32>& layer) {
  return ShardKey(base, rank.typed_data()[0], layer.typed_data()[0]);
}

ffi::Error SwapWriteImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> layer,
                         ffi::ResultBuffer<ffi::S32> token, int64_t store, std::string_view key) {
  return WithStore(store, [&](SwapStore& s) {
    // returns once copied: the disk write overlaps the rest of the program
    s.WriteDetached(Key(key, rank, layer), x.untyped_data(), x.size_bytes(),
                    DtypeName(x.element_type()), Dims(x));
    token->typed_data()[0] = write_tokens.fetch_add(1);
  });
}

ffi::Error SwapReadImpl(ffi::Buffer<ffi::S32> token, ffi::Buffer<ffi::S32> rank,
                        ffi::Buffer<ffi::S32> layer, ffi::Result<ffi::AnyBuffer> y,
                        int64_t store, std::string_view key) {
  (void)token;  // only orders this read after its write
  return WithStore(store, [&](SwapStore& s) {
    s.Wait(s.ReadAsync(Key(key, rank, layer), y->untyped_data(), y->size_bytes(),
                       DtypeName(y->element_type()), Dims(*y), /*urgent=*/true));
  });
}

// A layer's shards of several leaves in one call each: one store job (one
// driver wake-up, one submission stream) instead of one per leaf.
ffi::Error SwapWriteManyImpl(ffi::Buffer<ffi::S32> rank, ffi::Buffer<ffi::S32> layer,
                             ffi::RemainingArgs xs, ffi::ResultBuffer<ffi::S32> token,
                             int64_t store, std::string_view keys) {
  return WithStore(store, [&](SwapStore& s) {
    std::vector<std::string> names = ShardKeys(keys, rank.typed_data()[0], layer.typed_data()[0]);
    if (names.size() != xs.size())
      throw EngineError("zinfjax_swap_write_many got " + std::to_string(xs.size()) + " arrays for " +
                        std::to_string(names.size()) + " keys");
    std::vector<ShardIo> shards;
    for (size_t i = 0; i < xs.size(); ++i) {
      ffi::AnyBuffer x = xs.get<ffi::AnyBuffer>(i).value();
      shards.push_back({names[i], x.untyped_data(), x.size_bytes(), DtypeName(x.element_type()), Dims(x)});
    }
    s.WriteDetachedMany(shards);  // returns once copied
    token->typed_data()[0] = write_tokens.fetch_add(1);
  });
}

ffi::Error SwapReadStartManyImpl(ffi::Buffer<ffi::S32> token, ffi::Buffer<ffi::S32> rank,
                                 ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::S32> ticket,
                                 int64_t store, std::string_view keys) {
  (void)token;
  return WithStore(store, [&](SwapStore& s) {
    ticket->typed_data()[0] = static_cast<int32_t>(
        s.ReadOwnedAsync(ShardKeys(keys, rank.typed_data()[0], layer.typed_data()[0]), /*urgent=*/true));
  });
}

ffi::Error SwapReadWaitManyImpl(ffi::Buffer<ffi::S32> ticket, ffi::RemainingRets ys, int64_t store) {
  return WithStore(store, [&](SwapStore& s) {
    std::vector<ShardIo> outs;
    for (size_t i = 0; i < ys.size(); ++i) {
      ffi::Result<ffi::AnyBuffer> y = ys.get<ffi::AnyBuffer>(i).value();
      outs.push_back({"", y->untyped_data(), y->size_bytes(), DtypeName(y->element_type()), Dims(*y)});
    }
    s.TakeResults(static_cast<uint64_t>(ticket.typed_data()[0]), outs);
  });
}

}  // namespace
}  // namespace zinfjax

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZinfjaxSwapWrite, zinfjax::SwapWriteImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("store")
                                  .Attr<std::string_view>("key"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZinfjaxSwapRead, zinfjax::SwapReadImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("store")
                                  .Attr<std::string_view>("key"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZinfjaxSwapWriteMany, zinfjax::SwapWriteManyImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("store")
                                  .Attr<std::string_view>("keys"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZinfjaxSwapReadStartMany, zinfjax::SwapReadStartManyImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Attr<int64_t>("store")
                                  .Attr<std::string_view>("keys"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ZinfjaxSwapReadWaitMany, zinfjax::SwapReadWaitManyImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingRets()
                                  .Attr<int64_t>("store"));
