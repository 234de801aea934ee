#include "core/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>

#include "core/buffer.h"
#include "core/errors.h"

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace zinfjax {
namespace {

constexpr size_t kPiece = size_t{8} << 20;  // bytes one thread moves per request
constexpr size_t kTrailer = 4;

struct Table {
  uint32_t t[8][256];
  Table() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
      t[0][i] = c;
    }
    for (int s = 1; s < 8; ++s)
      for (uint32_t i = 0; i < 256; ++i) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
  }
};

uint32_t CrcSoftware(const uint8_t* p, size_t n, uint32_t c) {  // slicing by 8
  static const Table table;
  const auto& t = table.t;
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    w ^= c;
    c = t[7][w & 0xFF] ^ t[6][(w >> 8) & 0xFF] ^ t[5][(w >> 16) & 0xFF] ^ t[4][(w >> 24) & 0xFF] ^
        t[3][(w >> 32) & 0xFF] ^ t[2][(w >> 40) & 0xFF] ^ t[1][(w >> 48) & 0xFF] ^ t[0][w >> 56];
    p += 8;
    n -= 8;
  }
  while (n--) c = (c >> 8) ^ t[0][(c ^ *p++) & 0xFF];
  return c;
}

#if defined(__x86_64__)
// Polynomial arithmetic mod the CRC-32C polynomial, bit-reflected as the CRC is (x^0 is the
// top bit): to join CRCs of consecutive blocks computed side by side.
uint32_t MultModP(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = b & 1 ? (b >> 1) ^ 0x82F63B78u : b >> 1;
  }
  return p;
}

uint32_t XPowModP(uint64_t n) {  // x^n mod P
  uint32_t result = 1u << 31, base = 1u << 30;
  for (; n; n >>= 1, base = MultModP(base, base))
    if (n & 1) result = MultModP(result, base);
  return result;
}

__attribute__((target("sse4.2"))) uint32_t CrcHardware(const uint8_t* p, size_t n, uint32_t c) {
  // Three lanes at once hide the instruction's latency (about 3x one lane); a lane's register
  // is moved past the lanes after it by a multiplication with x^(8 * kLane).
  constexpr size_t kLane = 8192;
  static const uint32_t shift = XPowModP(8 * kLane);
  uint64_t c0 = c;
  for (; n >= 3 * kLane; p += 3 * kLane, n -= 3 * kLane) {
    uint64_t c1 = 0, c2 = 0;
    for (size_t i = 0; i < kLane; i += 8) {
      uint64_t w0, w1, w2;
      std::memcpy(&w0, p + i, 8);
      std::memcpy(&w1, p + kLane + i, 8);
      std::memcpy(&w2, p + 2 * kLane + i, 8);
      c0 = _mm_crc32_u64(c0, w0);
      c1 = _mm_crc32_u64(c1, w1);
      c2 = _mm_crc32_u64(c2, w2);
    }
    c0 = MultModP(shift, static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c1);
    c0 = MultModP(shift, static_cast<uint32_t>(c0)) ^ static_cast<uint32_t>(c2);
  }
  while (n >= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    c0 = _mm_crc32_u64(c0, w);
    p += 8;
    n -= 8;
  }
  c = static_cast<uint32_t>(c0);
  while (n--) c = _mm_crc32_u8(c, *p++);
  return c;
}
#endif

// Runs `work(i)` for i in [0, n) on up to `threads` threads; the first exception is rethrown.
template <typename F>
void ParallelFor(size_t n, int threads, F&& work) {
  std::atomic<size_t> next{0};
  std::exception_ptr error;
  std::mutex mu;
  auto loop = [&] {
    for (size_t i; (i = next.fetch_add(1)) < n;) {
      try {
        work(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!error) error = std::current_exception();
        next.store(n);
      }
    }
  };
  size_t k = std::min<size_t>(n, static_cast<size_t>(std::max(threads, 1)));
  std::vector<std::thread> pool;
  for (size_t t = 1; t < k; ++t) pool.emplace_back(loop);
  loop();
  for (auto& t : pool) t.join();
  if (error) std::rethrow_exception(error);
}

// A piece of one file: bytes [offset, offset + length) of payload + trailer.
struct Piece {
  size_t file, offset, length;
};

std::vector<Piece> Pieces(const std::vector<FileIo>& files) {
  std::vector<Piece> out;
  for (size_t f = 0; f < files.size(); ++f) {
    size_t total = files[f].bytes + kTrailer;
    for (size_t off = 0; off < total; off += kPiece) out.push_back({f, off, std::min(kPiece, total - off)});
  }
  return out;
}

// Payload bytes at the start of piece `p`; its remaining bytes belong to the trailer.
size_t Body(const Piece& p, const FileIo& file) {
  return p.offset < file.bytes ? std::min(p.length, file.bytes - p.offset) : 0;
}

// Whether piece I/O can use the caller's buffer itself: aligned, with room for the trailer and
// the padding of the last O_DIRECT block.
bool InPlace(const FileIo& file, bool direct) {
  return direct && reinterpret_cast<uintptr_t>(file.data) % kAlignment == 0 &&
         file.room >= AlignUp(file.bytes + kTrailer);
}

int OpenFile(const std::string& path, int flags, bool direct, bool* is_direct) {
  int fd = direct ? ::open(path.c_str(), flags | O_DIRECT | O_CLOEXEC, 0644) : -1;
  *is_direct = fd >= 0;
  if (fd < 0) fd = ::open(path.c_str(), flags | O_CLOEXEC, 0644);  // e.g. tmpfs: no O_DIRECT
  if (fd < 0) throw EngineError(SysError("cannot open " + path, errno));
  return fd;
}

struct Fds {  // closes what it opened, whatever happens
  std::vector<int> fd;
  std::vector<char> direct;
  explicit Fds(size_t n) : fd(n, -1), direct(n, 0) {}
  ~Fds() {
    for (int f : fd)
      if (f >= 0) ::close(f);
  }
};

}  // namespace

uint32_t Crc32c(const void* data, size_t n, uint32_t crc) {
  const uint8_t* p = static_cast<const uint8_t*>(data);
  uint32_t c = ~crc;
#if defined(__x86_64__)
  static const bool hardware = __builtin_cpu_supports("sse4.2");
  if (hardware) return ~CrcHardware(p, n, c);
#endif
  return ~CrcSoftware(p, n, c);
}

void WriteFiles(const std::vector<FileIo>& files, int threads, bool direct) {
  Fds fds(files.size());
  std::vector<uint8_t> trailers(files.size() * kTrailer);
  ParallelFor(files.size(), threads, [&](size_t f) {  // checksums first: a piece may hold one
    uint32_t crc = Crc32c(files[f].data, files[f].bytes);
    for (size_t b = 0; b < kTrailer; ++b) trailers[f * kTrailer + b] = static_cast<uint8_t>(crc >> (8 * b));
    bool d;
    fds.fd[f] = OpenFile(files[f].path, O_WRONLY | O_CREAT | O_TRUNC, direct, &d);
    fds.direct[f] = d;
  });
  std::vector<Piece> pieces = Pieces(files);
  ParallelFor(pieces.size(), threads, [&](size_t i) {
    thread_local AlignedBuffer bounce(kPiece);
    const Piece& p = pieces[i];
    const FileIo& file = files[p.file];
    size_t body = Body(p, file);
    bool in_place = InPlace(file, fds.direct[p.file]);
    auto* dst = in_place ? static_cast<uint8_t*>(file.data) + p.offset : static_cast<uint8_t*>(bounce.data());
    if (!in_place) std::memcpy(dst, static_cast<const uint8_t*>(file.data) + p.offset, body);
    for (size_t b = body; b < p.length; ++b)  // the trailer's bytes in this piece
      dst[b] = trailers[p.file * kTrailer + (p.offset + b - file.bytes)];
    size_t n = fds.direct[p.file] ? AlignUp(p.length) : p.length;
    std::memset(dst + p.length, 0, n - p.length);
    for (size_t done = 0; done < n;) {
      ssize_t w = ::pwrite(fds.fd[p.file], dst + done, n - done, static_cast<off_t>(p.offset + done));
      if (w < 0 && errno == EINTR) continue;
      if (w < 0 && errno == ENOSPC)
        throw NoSpace("no space left on the drive writing " + file.path + " (" +
                      std::to_string(file.bytes) + " bytes)");
      if (w <= 0) throw EngineError(SysError("cannot write " + file.path, w < 0 ? errno : EIO));
      done += static_cast<size_t>(w);
    }
  });
  for (size_t f = 0; f < files.size(); ++f) {  // O_DIRECT wrote whole blocks: cut the padding
    size_t total = files[f].bytes + kTrailer;
    if (fds.direct[f] && AlignUp(total) != total && ::ftruncate(fds.fd[f], static_cast<off_t>(total)) != 0)
      throw EngineError(SysError("cannot truncate " + files[f].path, errno));
  }
}

void ReadFiles(const std::vector<FileIo>& files, int threads, bool direct) {
  Fds fds(files.size());
  std::vector<uint8_t> trailers(files.size() * kTrailer);
  ParallelFor(files.size(), threads, [&](size_t f) {
    bool d;
    fds.fd[f] = OpenFile(files[f].path, O_RDONLY, direct, &d);
    fds.direct[f] = d;
    struct stat st;
    if (::fstat(fds.fd[f], &st) != 0) throw EngineError(SysError("cannot stat " + files[f].path, errno));
    if (static_cast<size_t>(st.st_size) != files[f].bytes + kTrailer)
      throw CorruptShard(files[f].path + " is " + std::to_string(st.st_size) + " bytes, expected " +
                         std::to_string(files[f].bytes + kTrailer) + " (truncated or not this chunk)");
  });
  std::vector<Piece> pieces = Pieces(files);
  ParallelFor(pieces.size(), threads, [&](size_t i) {
    thread_local AlignedBuffer bounce(kPiece);
    const Piece& p = pieces[i];
    const FileIo& file = files[p.file];
    bool in_place = InPlace(file, fds.direct[p.file]);
    auto* src = in_place ? static_cast<uint8_t*>(file.data) + p.offset : static_cast<uint8_t*>(bounce.data());
    size_t n = fds.direct[p.file] ? AlignUp(p.length) : p.length;
    size_t got = 0;
    while (got < p.length) {
      ssize_t r = ::pread(fds.fd[p.file], src + got, n - got, static_cast<off_t>(p.offset + got));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) throw EngineError(SysError("cannot read " + file.path, errno));
      if (r == 0) throw CorruptShard(file.path + " ended early (truncated while being read)");
      got += static_cast<size_t>(r);
    }
    size_t body = Body(p, file);
    if (!in_place) std::memcpy(static_cast<uint8_t*>(file.data) + p.offset, src, body);
    for (size_t b = body; b < p.length; ++b) trailers[p.file * kTrailer + (p.offset + b - file.bytes)] = src[b];
  });
  ParallelFor(files.size(), threads, [&](size_t f) {
    uint32_t want = 0;
    for (size_t b = 0; b < kTrailer; ++b) want |= uint32_t{trailers[f * kTrailer + b]} << (8 * b);
    if (Crc32c(files[f].data, files[f].bytes) != want)
      throw CorruptShard(files[f].path + " fails its CRC-32C check (damaged on the drive)");
  });
}

}  // namespace zinfjax
