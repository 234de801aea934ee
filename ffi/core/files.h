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

// One file's payload: written from or read into `data` (`bytes` long). Where `data` is
// aligned and `room` (its usable bytes, at least `bytes`) holds the trailer and the
// O_DIRECT padding, the drive reads and writes it in place, with no staging copy; the bytes
// past the payload are then the engine's to use.
struct FileIo {
  std::string path;
  void* data;
  size_t bytes;
  size_t room = 0;
};

// Creates (or replaces) each file as its payload followed by the payload's CRC-32C.
// No fsync: the caller flushes the file system once. Throws EngineError/NoSpace naming the file.
void WriteFiles(const std::vector<FileIo>& files, int threads, bool direct);

// Reads each file's payload into its buffer and checks the trailer; a file of another size or
// with a wrong checksum throws CorruptShard naming it.
void ReadFiles(const std::vector<FileIo>& files, int threads, bool direct);

}  // namespace zinfjax

#endif  // ZINFJAX_CORE_FILES_H_
