// zinfjax._engine: the C++ engine exposed to Python for host-side work
// (optimizer pipeline, checkpoints, benchmarks), plus the FFI capsules that
// zinfjax registers with XLA at import.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/adam.h"
#include "core/buffer.h"
#include "core/errors.h"
#include "core/files.h"
#include "core/hash.h"
#include "core/keys.h"
#include "core/pool.h"
#include "core/store.h"
#include "python/bindings.h"
#include "xla/adam_ffi.h"
#include "xla/ffi/api/c_api.h"
#include "xla/order_ffi.h"
#include "xla/swap_ffi.h"

namespace py = pybind11;
using namespace zinfjax;

namespace {

template <typename T>
py::capsule EncapsulateFfiHandler(T* fn) {
  return py::capsule(reinterpret_cast<void*>(fn));
}

py::dict PoolStatsDict(const PoolStats& s) {
  py::dict d;
  d["budget_bytes"] = s.budget_bytes;
  d["buffer_bytes"] = s.buffer_bytes;
  d["allocated_bytes"] = s.allocated_bytes;
  d["in_use_bytes"] = s.in_use_bytes;
  d["peak_in_use_bytes"] = s.peak_in_use_bytes;
  d["locked_bytes"] = s.locked_bytes;
  d["acquires"] = s.acquires;
  d["waits"] = s.waits;
  d["timeouts"] = s.timeouts;
  return d;
}

// `nbytes` of a memory store's mapping at `data` as a uint8 array that keeps the store alive.
py::array Lent(const std::shared_ptr<SwapStore>& s, const uint8_t* data, uint64_t nbytes) {
  auto* keep = new std::shared_ptr<SwapStore>(s);
  py::capsule base(keep, [](void* p) { delete static_cast<std::shared_ptr<SwapStore>*>(p); });
  return py::array_t<uint8_t>({static_cast<py::ssize_t>(nbytes)}, {1}, const_cast<uint8_t*>(data),
                              base);
}

// The shards of a write_many / read_many call (buffers must stay alive until its wait).
std::vector<ShardIo> ShardIos(const std::vector<std::string>& keys, const std::vector<py::buffer>& bufs,
                              const std::vector<std::string>& dtypes,
                              const std::vector<std::vector<int64_t>>& shapes, bool writable) {
  if (bufs.size() != keys.size() || dtypes.size() != keys.size() || shapes.size() != keys.size())
    throw EngineError("keys, buffers, dtypes and shapes must have the same length");
  std::vector<ShardIo> out;
  for (size_t i = 0; i < keys.size(); ++i) {
    py::buffer_info info = bufs[i].request(writable);
    RequireContiguous(info);
    out.push_back({keys[i], info.ptr, Bytes(info), dtypes[i], shapes[i]});
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(_engine, m) {
  m.doc() = "zinfjax C++ engine: aio, pinned buffer pool, swap store, XLA FFI handlers";
  m.attr("ALIGNMENT") = kAlignment;

  auto base = py::register_exception<EngineError>(m, "EngineError", PyExc_RuntimeError);
  py::register_exception<NoSpace>(m, "NoSpaceError", PyExc_OSError);
  py::register_exception<CorruptShard>(m, "CorruptShardError", base.ptr());
  py::register_exception<MissingShard>(m, "MissingShardError", PyExc_LookupError);
  py::register_exception<ShardMismatch>(m, "ShardMismatchError", PyExc_ValueError);
  py::register_exception<StoreLocked>(m, "StoreLockedError", base.ptr());
  py::register_exception<PoolExhausted>(m, "PoolExhaustedError", PyExc_TimeoutError);
  py::register_exception<BackendUnavailable>(m, "BackendUnavailableError", base.ptr());

  m.def("align_up", [](size_t n) { return AlignUp(n); }, py::arg("n"),
        "Bytes `n` rounded up to the O_DIRECT alignment.");
  m.def("shard_key", [](const std::string& base, int32_t rank, int32_t layer) {
    return ShardKey(base, rank, layer);
  }, py::arg("base"), py::arg("rank"), py::arg("layer"),
        "The swap-store key of one rank's shard of one layer (the one the FFI handlers use).");
  m.def("checksum", [](py::buffer b) {
    py::buffer_info info = b.request();
    RequireContiguous(info);
    return Checksum(info.ptr, Bytes(info));
  }, py::arg("data"), "The swap store's 64-bit checksum of a buffer's bytes.");
  m.def("crc32c", [](py::buffer b) {
    py::buffer_info info = b.request();
    RequireContiguous(info);
    py::gil_scoped_release release;
    return Crc32c(info.ptr, Bytes(info));
  }, py::arg("data"), "CRC-32C (Castagnoli) of a buffer's bytes, as zarr's crc32c codec has it.");
  DefineFiles(m);
  m.def("build_info", []() {
    py::dict info;
    info["compiler"] = __VERSION__;
    info["cplusplus"] = __cplusplus;
    info["alignment"] = kAlignment;
    return info;
  });

  py::class_<Lease>(m, "Lease", py::buffer_protocol())
      .def_property_readonly("size", &Lease::size)
      .def("release", &Lease::Release)
      .def_buffer([](Lease& l) {
        return py::buffer_info(l.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<ssize_t>(l.size())}, {1});
      });

  py::class_<PinnedPool, std::shared_ptr<PinnedPool>>(m, "PinnedPool")
      .def(py::init<size_t, size_t, bool>(), py::arg("budget_bytes"), py::arg("buffer_bytes"),
           py::arg("lock_memory") = true)
      .def("acquire", [](PinnedPool& p, double timeout_s) {
        return p.Acquire(std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000)));
      }, py::arg("timeout_s") = 60.0, py::call_guard<py::gil_scoped_release>())
      .def("try_acquire", [](PinnedPool& p) -> py::object {
        auto lease = p.TryAcquire();
        if (!lease) return py::none();
        return py::cast(std::move(*lease));
      })
      .def_property_readonly("buffer_bytes", &PinnedPool::buffer_bytes)
      .def_property_readonly("capacity", &PinnedPool::capacity)
      .def("stats", [](const PinnedPool& p) { return PoolStatsDict(p.Stats()); });

  py::class_<SwapStore, std::shared_ptr<SwapStore>>(m, "SwapStore")
      .def(py::init([](std::vector<std::string> paths, int rank, size_t block_size,
                       unsigned queue_depth, std::string backend, bool direct, unsigned io_threads,
                       size_t pinned_budget, double pool_timeout_s, int io_nice, bool fresh,
                       bool memory) {
             StoreConfig c;
             c.paths = std::move(paths);
             c.rank = rank;
             c.block_size = block_size;
             c.queue_depth = queue_depth;
             c.backend = std::move(backend);
             c.direct = direct;
             c.io_threads = io_threads;
             c.pinned_budget = pinned_budget;
             c.pool_timeout_ms = static_cast<int>(pool_timeout_s * 1000);
             c.io_nice = io_nice;
             c.fresh = fresh;
             c.memory = memory;
             return std::make_shared<SwapStore>(std::move(c));
           }),
           py::arg("paths"), py::arg("rank") = 0, py::arg("block_size") = 1 << 20,
           py::arg("queue_depth") = 32, py::arg("backend") = "auto", py::arg("direct") = true,
           py::arg("io_threads") = 2, py::arg("pinned_budget") = 64 << 20,
           py::arg("pool_timeout_s") = 60.0, py::arg("io_nice") = 0, py::arg("fresh") = false,
           py::arg("memory") = false)
      .def_property_readonly("memory", &SwapStore::memory)
      // a memory store's bytes of a shard as a uint8 array that keeps the store alive, with
      // the dtype and shape it was written as
      .def("view", [](std::shared_ptr<SwapStore> s, const std::string& key) {
             ShardEntry e;
             uint8_t* data;
             {
               py::gil_scoped_release release;
               data = s->View(key, &e);
             }
             return py::make_tuple(Lent(s, data, e.nbytes), e.dtype, e.shape);
           }, py::arg("key"))
      // (bytes to read, or None where they are the bytes to write; bytes to write, dtype, shape)
      .def("stage", [](std::shared_ptr<SwapStore> s, const std::string& key) {
             ShardEntry e;
             uint8_t* data;
             const uint8_t* from;
             {
               py::gil_scoped_release release;
               data = s->Stage(key, &e, &from);
             }
             py::object src = from == data ? py::object(py::none()) : Lent(s, from, e.nbytes);
             return py::make_tuple(src, Lent(s, data, e.nbytes), e.dtype, e.shape);
           }, py::arg("key"))
      .def("write_async", [](SwapStore& s, const std::string& key, py::buffer data,
                             const std::string& dtype, std::vector<int64_t> shape) {
        py::buffer_info info = data.request();
        RequireContiguous(info);
        return s.WriteAsync(key, info.ptr, Bytes(info), dtype, shape);
      }, py::arg("key"), py::arg("data"), py::arg("dtype"), py::arg("shape"))
      .def("write_zeros_async", [](SwapStore& s, const std::string& key, py::buffer zeros,
                                   const std::string& dtype, std::vector<int64_t> shape) {
        py::buffer_info info = zeros.request();
        RequireContiguous(info);
        return s.WriteZerosAsync(key, info.ptr, Bytes(info), dtype, shape);
      }, py::arg("key"), py::arg("zeros"), py::arg("dtype"), py::arg("shape"))
      .def("read_async", [](SwapStore& s, const std::string& key, py::buffer out,
                            const std::string& dtype, std::vector<int64_t> shape) {
        py::buffer_info info = out.request(true);
        RequireContiguous(info);
        return s.ReadAsync(key, info.ptr, Bytes(info), dtype, shape);
      }, py::arg("key"), py::arg("out"), py::arg("dtype"), py::arg("shape"))
      .def("write_many", [](SwapStore& s, const std::vector<std::string>& keys,
                            const std::vector<py::buffer>& data, const std::vector<std::string>& dtypes,
                            const std::vector<std::vector<int64_t>>& shapes) {
        return s.WriteManyAsync(ShardIos(keys, data, dtypes, shapes, false));
      }, py::arg("keys"), py::arg("data"), py::arg("dtypes"), py::arg("shapes"))
      .def("read_many", [](SwapStore& s, const std::vector<std::string>& keys,
                           const std::vector<py::buffer>& outs, const std::vector<std::string>& dtypes,
                           const std::vector<std::vector<int64_t>>& shapes) {
        return s.ReadManyAsync(ShardIos(keys, outs, dtypes, shapes, true));
      }, py::arg("keys"), py::arg("outs"), py::arg("dtypes"), py::arg("shapes"))
      .def("wait", &SwapStore::Wait, py::arg("ticket"), py::call_guard<py::gil_scoped_release>())
      .def("sync", &SwapStore::Sync, py::call_guard<py::gil_scoped_release>())
      .def("reserve", &SwapStore::Reserve, py::arg("bytes"), py::arg("exact") = false)
      .def_property_readonly("allocated_bytes", &SwapStore::allocated_bytes)
      .def("generation", &SwapStore::Generation, py::arg("key"))
      .def("wait_generation", [](SwapStore& s, const std::string& key, uint64_t generation,
                                 double timeout_s) {
        return s.WaitGeneration(key, generation, static_cast<int>(timeout_s * 1000));
      }, py::arg("key"), py::arg("generation"), py::arg("timeout_s"),
         py::call_guard<py::gil_scoped_release>())
      .def("has", &SwapStore::Has)
      .def("exchange", &SwapStore::Exchange, py::arg("pairs"),
           py::call_guard<py::gil_scoped_release>())
      .def("keys", &SwapStore::Keys)
      .def("entry", [](const SwapStore& s, const std::string& key) {
        ShardEntry e = s.Entry(key);
        py::dict d;
        d["dtype"] = e.dtype;
        d["shape"] = py::tuple(py::cast(e.shape));
        d["offset"] = e.offset;
        d["nbytes"] = e.nbytes;
        d["capacity"] = e.capacity;
        d["checksum"] = e.checksum;
        return d;
      })
      .def_property_readonly("backend", &SwapStore::backend_name)
      .def_property_readonly("direct", &SwapStore::direct)
      .def_property_readonly("folder", &SwapStore::folder)
      .def_property_readonly("files", &SwapStore::files)
      .def_property_readonly("bytes_used", &SwapStore::bytes_used)
      .def_property_readonly("bytes_read", &SwapStore::bytes_read)
      .def_property_readonly("bytes_written", &SwapStore::bytes_written)
      .def_property_readonly("bytes_left_zero", &SwapStore::bytes_left_zero)
      .def("pool_stats", [](const SwapStore& s) { return PoolStatsDict(s.pool_stats()); })
      .def_property_readonly("spare_bytes", &SwapStore::spare_bytes)
      .def_property_readonly("buffers_made", &SwapStore::buffers_made)
      .def_property_readonly("mapping_pinned_bytes", &SwapStore::mapping_pinned_bytes)
      .def("set_fault_after_writes", &SwapStore::SetFaultAfterWrites, py::arg("writes"))
      .def("begin", &SwapStore::Begin, py::arg("prefixes"))
      .def("commit", &SwapStore::Commit)
      .def("rollback", &SwapStore::Rollback, py::call_guard<py::gil_scoped_release>())
      .def("rollback_keys", &SwapStore::RollbackKeys, py::arg("keys"),
           py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("in_transaction", &SwapStore::in_transaction)
      .def("set_fault_free_bytes", &SwapStore::SetFaultFreeBytes, py::arg("bytes"),
           "Test-only: pretend only `bytes` more can be allocated (negative: off).")
      .def("set_defer_errors", &SwapStore::set_defer_errors, py::arg("on"),
           "Record errors of XLA custom calls instead of failing the program (see raise_deferred).")
      .def("raise_deferred", &SwapStore::RaiseDeferred,
           "Raise the first error recorded in deferred-error mode, if any (and clear it).")
      .def("register", [](std::shared_ptr<SwapStore> s) { return RegisterStore(std::move(s)); },
           "Enter the store in the engine's handle table; returns the handle FFI calls use.");
  m.def("unregister_store", &UnregisterStore, py::arg("handle"));

  m.def("adam_isa", &AdamIsa, "Instruction set the AdamW kernel uses on this CPU.");
  m.def("adamw", [](py::buffer master, py::buffer m, py::buffer v, py::buffer grad,
                    py::object params_out, float lr, float b1, float one_minus_b1, float b2,
                    float one_minus_b2, float eps, float weight_decay, float bc1, float bc2,
                    int threads, uint32_t seed, py::object sources) {
    py::buffer_info mi = master.request(true), mo = m.request(true), vo = v.request(true);
    py::buffer_info gi = grad.request();
    for (auto* info : {&mi, &mo, &vo, &gi}) RequireContiguous(*info);
    size_t n = static_cast<size_t>(mi.size);
    if (mi.itemsize != 4 || mo.itemsize != vo.itemsize || (mo.itemsize != 4 && mo.itemsize != 2))
      throw EngineError("adamw: master must be float32, m and v both float32 or both bfloat16");
    if (static_cast<size_t>(mo.size) != n || static_cast<size_t>(vo.size) != n ||
        static_cast<size_t>(gi.size) != n)
      throw EngineError("adamw: master, m, v and grad must have the same number of elements");
    if (gi.itemsize != 4 && gi.itemsize != 2)
      throw EngineError("adamw: grad must be float32 or bfloat16");
    void* out = nullptr;
    Precision pt = Precision::kNone;
    py::buffer_info po;
    if (!params_out.is_none()) {
      po = params_out.cast<py::buffer>().request(true);
      RequireContiguous(po);
      if (static_cast<size_t>(po.size) != n || (po.itemsize != 4 && po.itemsize != 2))
        throw EngineError("adamw: params_out must be float32 or bfloat16 with as many elements");
      out = po.ptr;
      pt = po.itemsize == 4 ? Precision::kF32 : Precision::kBF16;
    }
    // sources: (master, m, v) another copy to read from, each like its output, apart from all
    std::vector<py::buffer_info> src;
    AdamSources from{};
    if (!sources.is_none()) {
      auto items = sources.cast<std::vector<py::buffer>>();
      if (items.size() != 3) throw EngineError("adamw: sources must be (master, m, v)");
      std::vector<py::buffer_info*> outs{&mi, &mo, &vo, &po};
      for (size_t i = 0; i < 3; ++i) {
        src.push_back(items[i].request());
        RequireContiguous(src[i]);
        if (src[i].size != outs[i]->size || src[i].itemsize != outs[i]->itemsize)
          throw EngineError("adamw: each source must have its output's dtype and elements");
      }
      auto end = [](const py::buffer_info& b) {
        return static_cast<const uint8_t*>(b.ptr) + b.size * b.itemsize;
      };
      for (auto& s : src)
        for (auto* o : outs)
          if (o->ptr && static_cast<const uint8_t*>(s.ptr) < end(*o) &&
              static_cast<const uint8_t*>(o->ptr) < end(s))
            throw EngineError("adamw: a source overlaps an output (update in place: no sources)");
      from = {static_cast<const float*>(src[0].ptr), src[1].ptr, src[2].ptr};
    }
    AdamHyper h{lr, b1, one_minus_b1, b2, one_minus_b2, eps, weight_decay, bc1, bc2, seed};
    py::gil_scoped_release release;
    AdamW(static_cast<float*>(mi.ptr), mo.ptr, vo.ptr,
          mo.itemsize == 4 ? Precision::kF32 : Precision::kBF16, gi.ptr,
          gi.itemsize == 4 ? Precision::kF32 : Precision::kBF16, out, pt, n, h, threads,
          src.empty() ? nullptr : &from);
  }, py::arg("master"), py::arg("m"), py::arg("v"), py::arg("grad"), py::arg("params_out"),
     py::arg("lr"), py::arg("b1"), py::arg("one_minus_b1"), py::arg("b2"), py::arg("one_minus_b2"),
     py::arg("eps"), py::arg("weight_decay"), py::arg("bc1"), py::arg("bc2"), py::arg("threads") = 0,
     py::arg("seed") = 0, py::arg("sources") = py::none(),
     "Fused AdamW over numpy buffers, in place (grad, params_out and the moments may be "
     "bfloat16; bf16 moments are stored with stochastic rounding seeded by `seed`, the step); "
     "with `sources` (master, m, v), the states are read from those and written to the outputs.");

  m.def("registrations", []() {
    py::dict d;
    d["zinfjax_swap_write_many"] = EncapsulateFfiHandler(ZinfjaxSwapWriteMany);
    d["zinfjax_swap_read_start_many"] = EncapsulateFfiHandler(ZinfjaxSwapReadStartMany);
    d["zinfjax_swap_read_wait_many"] = EncapsulateFfiHandler(ZinfjaxSwapReadWaitMany);
    d["zinfjax_adamw"] = EncapsulateFfiHandler(ZinfjaxAdamW);
    d["zinfjax_after"] = EncapsulateFfiHandler(ZinfjaxAfter);
    return d;
  }, "XLA FFI handler capsules (CPU platform), by target name.");
  m.def("ffi_api_version", []() { return py::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR); },
        "The XLA FFI API version of the headers the handlers were built with (major, minor).");
  m.def("store_lookup", []() { return py::capsule(reinterpret_cast<void*>(&LookupStore)); },
        "The store table's lookup function, for handler modules that link their own core.");
}
