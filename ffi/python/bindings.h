// Helpers the zinfjax._engine module's source files share, and the parts they define.
#ifndef ZINFJAX_PYTHON_BINDINGS_H_
#define ZINFJAX_PYTHON_BINDINGS_H_

#include <pybind11/pybind11.h>

#include <cstddef>

#include "core/errors.h"

namespace zinfjax {

inline size_t Bytes(const pybind11::buffer_info& info) {
  return static_cast<size_t>(info.size * info.itemsize);
}

inline void RequireContiguous(const pybind11::buffer_info& info) {
  ssize_t stride = info.itemsize;
  for (ssize_t i = info.ndim - 1; i >= 0; --i) {
    if (info.shape[i] > 1 && info.strides[i] != stride)
      throw EngineError("swap store buffers must be C-contiguous (use numpy.ascontiguousarray)");
    stride *= info.shape[i];
  }
}

// write_files / read_files (files_module.cc).
void DefineFiles(pybind11::module_& m);

}  // namespace zinfjax

#endif  // ZINFJAX_PYTHON_BINDINGS_H_
