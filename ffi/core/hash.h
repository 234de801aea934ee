// A fast streaming 64-bit checksum for swap shards.
//
// Four 64-bit lanes consume 32-byte stripes (multiply-rotate rounds in the
// style of xxHash64), so it runs at memory speed and the swap path can verify
// every shard it reads. The result depends only on the bytes fed, not on how
// they were split across Update calls.
#ifndef ZINFJAX_CORE_HASH_H_
#define ZINFJAX_CORE_HASH_H_

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace zinfjax {

class Hasher {
 public:
  explicit Hasher(uint64_t seed = 0) { Reset(seed); }

  void Reset(uint64_t seed = 0) {
    seed_ = seed;
    lane_[0] = seed + kP1 + kP2;
    lane_[1] = seed + kP2;
    lane_[2] = seed;
    lane_[3] = seed - kP1;
    total_ = 0;
    pending_ = 0;
  }

  void Update(const void* data, size_t n) {
    const uint8_t* p = static_cast<const uint8_t*>(data);
    total_ += n;
    if (pending_) {
      size_t take = n < 32 - pending_ ? n : 32 - pending_;
      std::memcpy(buf_ + pending_, p, take);
      pending_ += take;
      p += take;
      n -= take;
      if (pending_ < 32) return;
      Stripe(buf_);
      pending_ = 0;
    }
    while (n >= 32) {
      Stripe(p);
      p += 32;
      n -= 32;
    }
    if (n) {
      std::memcpy(buf_, p, n);
      pending_ = n;
    }
  }

  uint64_t Digest() const {
    uint64_t h;
    if (total_ >= 32) {
      h = Rotl(lane_[0], 1) + Rotl(lane_[1], 7) + Rotl(lane_[2], 12) + Rotl(lane_[3], 18);
      for (uint64_t lane : lane_) h = (h ^ Round(0, lane)) * kP1 + kP4;
    } else {
      h = seed_ + kP5;
    }
    h += total_;
    const uint8_t* p = buf_;
    size_t n = pending_;
    while (n >= 8) {
      h ^= Round(0, Load64(p));
      h = Rotl(h, 27) * kP1 + kP4;
      p += 8;
      n -= 8;
    }
    while (n--) {
      h ^= (*p++) * kP5;
      h = Rotl(h, 11) * kP1;
    }
    h ^= h >> 33;
    h *= kP2;
    h ^= h >> 29;
    h *= kP3;
    h ^= h >> 32;
    return h;
  }

 private:
  static constexpr uint64_t kP1 = 0x9E3779B185EBCA87ULL;
  static constexpr uint64_t kP2 = 0xC2B2AE3D27D4EB4FULL;
  static constexpr uint64_t kP3 = 0x165667B19E3779F9ULL;
  static constexpr uint64_t kP4 = 0x85EBCA77C2B2AE63ULL;
  static constexpr uint64_t kP5 = 0x27D4EB2F165667C5ULL;

  static uint64_t Rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
  static uint64_t Load64(const uint8_t* p) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    return v;
  }
  static uint64_t Round(uint64_t acc, uint64_t input) {
    acc += input * kP2;
    return Rotl(acc, 31) * kP1;
  }
  void Stripe(const uint8_t* p) {
    lane_[0] = Round(lane_[0], Load64(p));
    lane_[1] = Round(lane_[1], Load64(p + 8));
    lane_[2] = Round(lane_[2], Load64(p + 16));
    lane_[3] = Round(lane_[3], Load64(p + 24));
  }

  uint64_t seed_ = 0;
  uint64_t lane_[4];
  uint64_t total_ = 0;
  uint8_t buf_[32];
  size_t pending_ = 0;
};

inline uint64_t Checksum(const void* data, size_t n) {
  Hasher h;
  h.Update(data, n);
  return h.Digest();
}

}  // namespace zinfjax

#endif  // ZINFJAX_CORE_HASH_H_
