// zinfjax._engine's whole-file I/O: write_files / read_files (checkpoints' chunk files),
// each file's payload gathered from or scattered to numpy arrays in the call.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/errors.h"
#include "core/files.h"
#include "python/bindings.h"

namespace py = pybind11;

namespace zinfjax {
namespace {

// Bytes [lo, hi) that an array's elements span (empty: lo == hi).
std::pair<const uint8_t*, const uint8_t*> Span(const py::array& a) {
  auto* base = static_cast<const uint8_t*>(a.data());
  if (a.size() == 0) return {base, base};
  int64_t lo = 0, hi = 0;
  for (py::ssize_t d = 0; d < a.ndim(); ++d) {
    int64_t reach = static_cast<int64_t>(a.strides(d)) * (a.shape(d) - 1);
    (reach < 0 ? lo : hi) += reach;
  }
  return {base + lo, base + hi + a.itemsize()};
}

bool Named(const py::array& a, const char* name) {
  return py::str(a.dtype().attr("name")).cast<std::string>() == name;
}

// One file's (dst, src) copies, checked: the same shape and dtype (or float32 into bfloat16),
// and the side in the file's buffer (`dst` for a write's gathers, `src` for a read's scatters)
// inside its payload.
std::vector<BoxCopy> BoxCopies(const std::vector<std::pair<py::array, py::array>>& pairs,
                               const FileIo& file, bool scatter) {
  std::vector<BoxCopy> out;
  auto* lo = static_cast<const uint8_t*>(file.data);
  for (const auto& [dst, src] : pairs) {
    bool same = dst.dtype().attr("__eq__")(src.dtype()).cast<bool>();
    bool cast = !same && Named(src, "float32") && Named(dst, "bfloat16");
    if (dst.ndim() != src.ndim() ||
        !std::equal(dst.shape(), dst.shape() + dst.ndim(), src.shape()) || !(same || cast))
      throw EngineError("a copy for " + file.path + " has arrays of different shapes or dtypes "
                        "(only float32 to bfloat16 is cast)");
    if (!dst.writeable())
      throw EngineError("a copy for " + file.path + " writes to a read-only array");
    auto [begin, end] = Span(scatter ? src : dst);
    if (begin < lo || end > lo + file.bytes)
      throw EngineError("a copy for " + file.path + " reaches outside the file's payload buffer");
    BoxCopy c{static_cast<uint8_t*>(const_cast<void*>(dst.data())),
              static_cast<const uint8_t*>(src.data()),
              static_cast<size_t>(src.itemsize()), {}, {}, {},
              cast ? BoxCopy::Cast::kF32ToBf16 : BoxCopy::Cast::kNone};
    for (py::ssize_t d = 0; d < dst.ndim(); ++d) {
      c.shape.push_back(dst.shape(d));
      c.dst_strides.push_back(dst.strides(d));
      c.src_strides.push_back(src.strides(d));
    }
    out.push_back(std::move(c));
  }
  return out;
}

using Copies = std::vector<std::vector<std::pair<py::array, py::array>>>;

// write_files / read_files: the buffers taken with the GIL (they outlive the call), the I/O
// without it. With `sizes`, each buffer holds a payload of that many bytes and the rest of it
// is room the engine may use (the trailer and O_DIRECT padding: then no staging copy). With
// `copies`, each file's (dst, src) array pairs fill its payload before the write, or are filled
// from it after the read and check.
template <void (*Run)(const std::vector<FileIo>&, int, bool), bool kRead>
void FilesCall(const std::vector<std::string>& paths, const std::vector<py::buffer>& bufs,
               int threads, bool direct, const std::optional<std::vector<size_t>>& sizes,
               const std::optional<Copies>& copies) {
  if (bufs.size() != paths.size() || (sizes && sizes->size() != paths.size()) ||
      (copies && copies->size() != paths.size()))
    throw EngineError("paths, buffers, sizes and copies must have the same length");
  std::vector<FileIo> files;
  for (size_t i = 0; i < paths.size(); ++i) {
    py::buffer_info info = bufs[i].request(kRead || sizes.has_value() || copies.has_value());
    RequireContiguous(info);
    size_t room = Bytes(info), bytes = sizes ? (*sizes)[i] : room;
    if (bytes > room)
      throw EngineError("buffer for " + paths[i] + " holds " + std::to_string(room) +
                        " bytes, less than its size " + std::to_string(bytes));
    files.push_back({paths[i], info.ptr, bytes, sizes ? room : 0, {}});
    if (copies) files.back().copies = BoxCopies((*copies)[i], files.back(), kRead);
  }
  py::gil_scoped_release release;
  Run(files, threads, direct);
}

}  // namespace

void DefineFiles(py::module_& m) {
  m.def("write_files", &FilesCall<WriteFiles, false>, py::arg("paths"), py::arg("buffers"),
        py::arg("threads") = 8, py::arg("direct") = true, py::arg("sizes") = py::none(),
        py::arg("copies") = py::none(),
        "Write each buffer as a whole file followed by its CRC-32C (4 bytes, little-endian); "
        "each file's `copies` (dst, src) arrays, dst inside its buffer, fill it first.");
  m.def("read_files", &FilesCall<ReadFiles, true>, py::arg("paths"), py::arg("outs"),
        py::arg("threads") = 8, py::arg("direct") = true, py::arg("sizes") = py::none(),
        py::arg("copies") = py::none(),
        "Read files written by write_files into `outs`, checking each one's size and CRC-32C; "
        "then each file's `copies` (dst, src) arrays, src inside its buffer, are copied.");
}

}  // namespace zinfjax
