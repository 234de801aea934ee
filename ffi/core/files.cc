#include "core/files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <cerrno>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

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

// Tasks run by a few threads, in the order queued; a task may queue more in front (a file's
// pieces once the file is ready), so one file's checksum and copies overlap the drive's work
// on the others. The first exception stops the rest and is rethrown by Run.
class Tasks {
 public:
  using Task = std::function<void()>;

  void Add(Task task) {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.push_back(std::move(task));
  }

  void AddFront(std::vector<Task> tasks) {  // from a running task
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (auto it = tasks.rbegin(); it != tasks.rend(); ++it) queue_.push_front(std::move(*it));
    }
    ready_.notify_all();
  }

  void Run(size_t threads) {
    size_t k = std::max<size_t>(threads, 1);
    std::vector<std::thread> pool;
    for (size_t t = 1; t < k; ++t) pool.emplace_back([this] { Loop(); });
    Loop();
    for (auto& t : pool) t.join();
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      ready_.wait(lock, [this] { return !queue_.empty() || running_ == 0; });
      if (queue_.empty()) return;  // and nothing running that could add more
      Task task = std::move(queue_.front());
      queue_.pop_front();
      ++running_;
      lock.unlock();
      try {
        task();
      } catch (...) {
        lock.lock();
        if (!error_) error_ = std::current_exception();
        queue_.clear();
        lock.unlock();
      }
      lock.lock();
      if (--running_ == 0 && queue_.empty()) ready_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable ready_;
  std::deque<Task> queue_;
  size_t running_ = 0;
  std::exception_ptr error_;
};

// A piece of one file: bytes [offset, offset + length) of payload + trailer.
struct Piece {
  size_t file, offset, length;
};

std::vector<Piece> Pieces(const std::vector<FileIo>& files, size_t f) {
  std::vector<Piece> out;
  size_t total = files[f].bytes + kTrailer;
  for (size_t off = 0; off < total; off += kPiece) out.push_back({f, off, std::min(kPiece, total - off)});
  return out;
}

// Threads worth starting: no more than there are pieces.
size_t Threads(const std::vector<FileIo>& files, int threads) {
  size_t pieces = 0;
  for (const FileIo& f : files) pieces += (f.bytes + kTrailer + kPiece - 1) / kPiece;
  return std::min<size_t>(pieces, static_cast<size_t>(std::max(threads, 1)));
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

// float32 to bfloat16, round to nearest even; NaN becomes the quiet NaN of its sign.
void F32ToBf16(uint8_t* dst, const uint8_t* src, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    uint32_t b;
    std::memcpy(&b, src + 4 * i, 4);
    uint16_t h = (b & 0x7FFFFFFFu) > 0x7F800000u ? static_cast<uint16_t>((b >> 16) | 0x7FC0u)
                                                 : static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
    std::memcpy(dst + 2 * i, &h, 2);
  }
}

void WritePiece(const Piece& p, const FileIo& file, int fd, bool direct, const uint8_t* trailer) {
  thread_local AlignedBuffer bounce(kPiece);
  size_t body = Body(p, file);
  bool in_place = InPlace(file, direct);
  auto* dst = in_place ? static_cast<uint8_t*>(file.data) + p.offset : static_cast<uint8_t*>(bounce.data());
  if (!in_place) std::memcpy(dst, static_cast<const uint8_t*>(file.data) + p.offset, body);
  for (size_t b = body; b < p.length; ++b) dst[b] = trailer[p.offset + b - file.bytes];  // the trailer's bytes
  size_t n = direct ? AlignUp(p.length) : p.length;
  std::memset(dst + p.length, 0, n - p.length);
  for (size_t done = 0; done < n;) {
    ssize_t w = ::pwrite(fd, dst + done, n - done, static_cast<off_t>(p.offset + done));
    if (w < 0 && errno == EINTR) continue;
    if (w < 0 && errno == ENOSPC)
      throw NoSpace("no space left on the drive writing " + file.path + " (" + std::to_string(file.bytes) +
                    " bytes)");
    if (w <= 0) throw EngineError(SysError("cannot write " + file.path, w < 0 ? errno : EIO));
    done += static_cast<size_t>(w);
  }
}

void ReadPiece(const Piece& p, const FileIo& file, int fd, bool direct, uint8_t* trailer) {
  thread_local AlignedBuffer bounce(kPiece);
  bool in_place = InPlace(file, direct);
  auto* src = in_place ? static_cast<uint8_t*>(file.data) + p.offset : static_cast<uint8_t*>(bounce.data());
  size_t n = direct ? AlignUp(p.length) : p.length;
  size_t got = 0;
  while (got < p.length) {
    ssize_t r = ::pread(fd, src + got, n - got, static_cast<off_t>(p.offset + got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw EngineError(SysError("cannot read " + file.path, errno));
    if (r == 0) throw CorruptShard(file.path + " ended early (truncated while being read)");
    got += static_cast<size_t>(r);
  }
  size_t body = Body(p, file);
  if (!in_place) std::memcpy(static_cast<uint8_t*>(file.data) + p.offset, src, body);
  for (size_t b = body; b < p.length; ++b) trailer[p.offset + b - file.bytes] = src[b];
}

}  // namespace

void CopyBox(const BoxCopy& c) {
  size_t ndim = c.shape.size();
  for (int64_t n : c.shape)
    if (n == 0) return;
  size_t dst_item = c.cast == BoxCopy::Cast::kF32ToBf16 ? 2 : c.itemsize;
  // the innermost axes contiguous in both boxes make one run of `run` elements
  size_t run = 1, outer = ndim;
  while (outer > 0 && c.dst_strides[outer - 1] == static_cast<int64_t>(run * dst_item) &&
         c.src_strides[outer - 1] == static_cast<int64_t>(run * c.itemsize)) {
    run *= static_cast<size_t>(c.shape[outer - 1]);
    --outer;
  }
  std::vector<int64_t> index(outer, 0);
  int64_t dst = 0, src = 0;  // byte offsets of the run at `index`
  for (;;) {
    if (c.cast == BoxCopy::Cast::kF32ToBf16)
      F32ToBf16(c.dst + dst, c.src + src, run);
    else
      std::memcpy(c.dst + dst, c.src + src, run * c.itemsize);
    size_t axis = outer;
    for (; axis > 0; --axis) {  // the next index, last axis fastest
      size_t a = axis - 1;
      dst += c.dst_strides[a];
      src += c.src_strides[a];
      if (++index[a] < c.shape[a]) break;
      dst -= c.dst_strides[a] * c.shape[a];
      src -= c.src_strides[a] * c.shape[a];
      index[a] = 0;
    }
    if (axis == 0) return;
  }
}

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
  std::unique_ptr<std::atomic<size_t>[]> left(new std::atomic<size_t>[files.size()]);
  Tasks tasks;
  for (size_t f = 0; f < files.size(); ++f) {
    tasks.Add([&, f] {  // the payload gathered and checksummed, then its pieces written
      const FileIo& file = files[f];
      for (const BoxCopy& c : file.copies) CopyBox(c);
      uint32_t crc = Crc32c(file.data, file.bytes);
      for (size_t b = 0; b < kTrailer; ++b) trailers[f * kTrailer + b] = static_cast<uint8_t>(crc >> (8 * b));
      bool d;
      fds.fd[f] = OpenFile(file.path, O_WRONLY | O_CREAT | O_TRUNC, direct, &d);
      fds.direct[f] = d;
      std::vector<Piece> pieces = Pieces(files, f);
      left[f] = pieces.size();
      std::vector<Tasks::Task> writes;
      for (const Piece& p : pieces)
        writes.push_back([&, p] {
          WritePiece(p, files[p.file], fds.fd[p.file], fds.direct[p.file], &trailers[p.file * kTrailer]);
          size_t total = files[p.file].bytes + kTrailer;  // O_DIRECT wrote whole blocks: cut the padding
          if (--left[p.file] == 0 && fds.direct[p.file] && AlignUp(total) != total &&
              ::ftruncate(fds.fd[p.file], static_cast<off_t>(total)) != 0)
            throw EngineError(SysError("cannot truncate " + files[p.file].path, errno));
        });
      tasks.AddFront(std::move(writes));
    });
  }
  tasks.Run(Threads(files, threads));
}

void ReadFiles(const std::vector<FileIo>& files, int threads, bool direct) {
  Fds fds(files.size());
  std::vector<uint8_t> trailers(files.size() * kTrailer);
  std::unique_ptr<std::atomic<size_t>[]> left(new std::atomic<size_t>[files.size()]);
  Tasks tasks;
  for (size_t f = 0; f < files.size(); ++f) {
    tasks.Add([&, f] {  // opened and sized, then its pieces read; the last one checks and copies
      const FileIo& file = files[f];
      bool d;
      fds.fd[f] = OpenFile(file.path, O_RDONLY, direct, &d);
      fds.direct[f] = d;
      struct stat st;
      if (::fstat(fds.fd[f], &st) != 0) throw EngineError(SysError("cannot stat " + file.path, errno));
      if (static_cast<size_t>(st.st_size) != file.bytes + kTrailer)
        throw CorruptShard(file.path + " is " + std::to_string(st.st_size) + " bytes, expected " +
                           std::to_string(file.bytes + kTrailer) + " (truncated or not this chunk)");
      std::vector<Piece> pieces = Pieces(files, f);
      left[f] = pieces.size();
      std::vector<Tasks::Task> reads;
      for (const Piece& p : pieces)
        reads.push_back([&, p] {
          const FileIo& file = files[p.file];
          uint8_t* trailer = &trailers[p.file * kTrailer];
          ReadPiece(p, file, fds.fd[p.file], fds.direct[p.file], trailer);
          if (--left[p.file] != 0) return;
          uint32_t want = 0;
          for (size_t b = 0; b < kTrailer; ++b) want |= uint32_t{trailer[b]} << (8 * b);
          if (Crc32c(file.data, file.bytes) != want)
            throw CorruptShard(file.path + " fails its CRC-32C check (damaged on the drive)");
          for (const BoxCopy& c : file.copies) CopyBox(c);
        });
      tasks.AddFront(std::move(reads));
    });
  }
  tasks.Run(Threads(files, threads));
}

}  // namespace zinfjax
