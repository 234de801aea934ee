// A stand-in for the CUDA runtime, for testing ffi/cuda/copies.h on a machine without a
// GPU: "device" memory is host memory, every call runs at once (host order is a valid order
// for work enqueued in dependency order), and each is logged with its stream so a test can
// check which stream a copy went on.
#ifndef ZINFJAX_TESTS_CUDA_FAKE_H_
#define ZINFJAX_TESTS_CUDA_FAKE_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#define CUDART_CB

typedef int cudaError_t;
constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorMemoryAllocation = 2;
constexpr unsigned cudaStreamNonBlocking = 1;
constexpr unsigned cudaEventDisableTiming = 2;
enum cudaMemcpyKind { cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2, cudaMemcpyDeviceToDevice = 3 };

struct FakeStream { int id; };
struct FakeEvent { int records = 0; };
typedef FakeStream* cudaStream_t;
typedef FakeEvent* cudaEvent_t;
typedef void (*cudaHostFn_t)(void*);

struct FakeOp {
  std::string what;  // "copy", "host_fn", "record", "wait", "malloc", "free", "sync"
  int stream;        // -1: none
  int kind = 0;      // a copy's cudaMemcpyKind
  size_t bytes = 0;
};

inline std::vector<FakeOp>& fake_log() {
  static std::vector<FakeOp> log;
  return log;
}

inline int fake_id(cudaStream_t s) { return s == nullptr ? 0 : s->id; }

inline cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) {
  static int next = 100;
  *s = new FakeStream{next++};
  return cudaSuccess;
}
inline cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) {
  *e = new FakeEvent();
  return cudaSuccess;
}
inline cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  ++e->records;
  fake_log().push_back({"record", fake_id(s)});
  return cudaSuccess;
}
inline cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t, unsigned) {
  fake_log().push_back({"wait", fake_id(s)});
  return cudaSuccess;
}
inline cudaError_t cudaEventSynchronize(cudaEvent_t) {
  fake_log().push_back({"sync", -1});
  return cudaSuccess;
}
// The most one cudaMalloc gives ("HBM" left outside XLA's share); a larger one fails.
inline size_t& fake_malloc_limit() {
  static size_t limit = SIZE_MAX;
  return limit;
}
inline cudaError_t cudaMalloc(void** p, size_t bytes) {
  *p = bytes <= fake_malloc_limit() ? std::malloc(bytes) : nullptr;
  fake_log().push_back({"malloc", -1, 0, bytes});
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaFree(void* p) {
  std::free(p);
  fake_log().push_back({"free", -1});
  return cudaSuccess;
}
inline cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind,
                                   cudaStream_t s) {
  std::memcpy(dst, src, bytes);
  fake_log().push_back({"copy", fake_id(s), kind, bytes});
  return cudaSuccess;
}
inline cudaError_t cudaLaunchHostFunc(cudaStream_t s, cudaHostFn_t fn, void* data) {
  fake_log().push_back({"host_fn", fake_id(s)});
  fn(data);
  return cudaSuccess;
}
inline const char* cudaGetErrorString(cudaError_t) { return "fake CUDA error"; }

#endif  // ZINFJAX_TESTS_CUDA_FAKE_H_
