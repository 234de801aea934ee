// Whole files with a CRC-32C trailer, moved by a few threads with O_DIRECT.
//
// A checkpoint's chunk files (zarr3 with the `bytes` + `crc32c` codecs) are
// exactly this: the chunk's little-endian bytes, then their CRC-32C as 4
// little-endian bytes. Writing and reading them here, in 8 MiB pieces spread
// over threads, keeps the drive busy where a chunk-at-a-time codec path cannot.
#ifndef ZINFJAX_CORE_FILES_H_
#define ZINFJAX_CORE_FILES_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace zinfjax {

// CRC-32C (Castagnoli), as zarr's crc32c codec and iSCSI define it; `crc` continues a
// previous result. Uses the SSE4.2 instruction where the CPU has it.
uint32_t Crc32c(const void* data, size_t n, uint32_t crc = 0);

// A copy between two boxes of the same shape, each laid out by its own byte strides (e.g. one
// device's part of a chunk, and where that part goes in the device's buffer). The runs
// contiguous in both move by memcpy, or are cast on the way (float32 to bfloat16, rounded to
// nearest even as XLA and ml_dtypes round: the compute copy of fp32 master weights).
struct BoxCopy {
  enum class Cast { kNone, kF32ToBf16 };
  uint8_t* dst;
  const uint8_t* src;
  size_t itemsize;  // of src; dst's is the same, or 2 for kF32ToBf16
  std::vector<int64_t> shape, dst_strides, src_strides;
  Cast cast = Cast::kNone;
};

void CopyBox(const BoxCopy& copy);

// One file's payload: written from or read into `data` (`bytes` long). Where `data` is
// aligned and `room` (its usable bytes, at least `bytes`) holds the trailer and the
// O_DIRECT padding, the drive reads and writes it in place, with no staging copy; the bytes
// past the payload are then the engine's to use. `copies` gather the payload into `data`
// before it is written, or scatter it out of `data` once it is read and checked, on the
// thread that moves the file (so gathers and scatters overlap the drive's work).
struct FileIo {
  std::string path;
  void* data;
  size_t bytes;
  size_t room = 0;
  std::vector<BoxCopy> copies;
};

// Creates (or replaces) each file as its payload (after its `copies`) followed by the
// payload's CRC-32C. No fsync: the caller flushes the file system once. Throws
// EngineError/NoSpace naming the file.
void WriteFiles(const std::vector<FileIo>& files, int threads, bool direct);

// Reads each file's payload into its buffer, checks the trailer, then runs its `copies`; a
// file of another size or with a wrong checksum throws CorruptShard naming it.
void ReadFiles(const std::vector<FileIo>& files, int threads, bool direct);

}  // namespace zinfjax

#endif  // ZINFJAX_CORE_FILES_H_
