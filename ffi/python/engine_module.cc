// zinfjax._engine: the C++ engine exposed to Python for host-side work.
#include <pybind11/pybind11.h>

#include "core/buffer.h"

namespace py = pybind11;

PYBIND11_MODULE(_engine, m) {
  m.doc() = "zinfjax C++ engine (host-side bindings)";
  m.attr("ALIGNMENT") = zinfjax::kAlignment;
  m.def("align_up", [](size_t n) { return zinfjax::AlignUp(n); }, py::arg("n"),
        "Bytes `n` rounded up to the O_DIRECT alignment.");
  m.def("build_info", []() {
    py::dict info;
    info["compiler"] = __VERSION__;
    info["cplusplus"] = __cplusplus;
    info["alignment"] = zinfjax::kAlignment;
    return info;
  });
}
