// Error types of the engine. Layer-1 code throws them; the pybind layer maps
// them to Python exceptions and the FFI handlers to ffi::Error (never throw).
#ifndef ZINFJAX_CORE_ERRORS_H_
#define ZINFJAX_CORE_ERRORS_H_

#include <stdexcept>
#include <string>

namespace zinfjax {

struct EngineError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct PoolExhausted : EngineError {
  using EngineError::EngineError;
};
struct NoSpace : EngineError {          // ENOSPC: names the path and the bytes needed
  using EngineError::EngineError;
};
struct CorruptShard : EngineError {     // short file, bad checksum, bad manifest
  using EngineError::EngineError;
};
struct MissingShard : EngineError {     // key not in the manifest
  using EngineError::EngineError;
};
struct ShardMismatch : EngineError {    // dtype or shape differs from what was written
  using EngineError::EngineError;
};
struct StoreLocked : EngineError {      // another process holds the folder
  using EngineError::EngineError;
};
struct BackendUnavailable : EngineError {
  using EngineError::EngineError;
};

// "what: strerror(err)" for a failed system call.
std::string SysError(const std::string& what, int err);

}  // namespace zinfjax

#endif  // ZINFJAX_CORE_ERRORS_H_
