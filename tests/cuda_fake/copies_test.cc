// ffi/cuda/copies.h against the stand-in CUDA runtime (cuda_runtime_api.h here) and a real
// swap store: data lands where it should, host<->device copies run on the copy stream and
// never on XLA's, staging buffers are reused only once drained, and a read with no free
// staging buffer or a mismatched shape is handled, as is HBM with no room for staging.
// Usage: copies_test FOLDER|memory.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/errors.h"
#include "core/store.h"
#include "cuda/copies.h"

namespace zinfjax {
namespace {

int checks = 0;

#define CHECK(cond, ...)                                            \
  do {                                                              \
    ++checks;                                                       \
    if (!(cond)) {                                                  \
      std::fprintf(stderr, "copies_test:%d: %s: ", __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                            \
      std::fprintf(stderr, "\n");                                   \
      std::exit(1);                                                 \
    }                                                               \
  } while (0)

FakeStream xla_stream{1};  // the stream XLA passes a handler
constexpr cudaStream_t kXla = &xla_stream;

// Shard sizes of one layer (floats): odd sizes, so the owned buffers have alignment gaps.
const std::vector<int64_t> kSizes = {1000, 37};

std::vector<float> Values(int layer, size_t shard, int64_t n, float salt = 0) {
  std::vector<float> v(n);
  for (int64_t i = 0; i < n; ++i) v[i] = salt + layer * 1000.0f + shard * 100.0f + i * 0.5f;
  return v;
}

std::string Key(const char* state, int layer, size_t shard) {
  return std::string(state) + "/" + std::to_string(layer) + "/" + std::to_string(shard);
}

void WriteLayer(SwapStore& store, int layer) {
  std::vector<std::vector<float>> data;
  std::vector<ShardIo> shards;
  for (size_t s = 0; s < kSizes.size(); ++s) data.push_back(Values(layer, s, kSizes[s]));
  for (size_t s = 0; s < kSizes.size(); ++s)
    shards.push_back({Key("p", layer, s), data[s].data(), data[s].size() * 4, "float32", {kSizes[s]}});
  store.Wait(store.WriteManyAsync(shards));
}

// Host copy ops (H2D or D2H) on `stream` in the log since `from`.
int HostCopies(int stream, size_t from) {
  int n = 0;
  for (size_t i = from; i < fake_log().size(); ++i) {
    const FakeOp& op = fake_log()[i];
    if (op.what == "copy" && op.stream == stream && op.kind != cudaMemcpyDeviceToDevice) ++n;
  }
  return n;
}

int Copies(int stream, int kind, size_t from) {
  int n = 0;
  for (size_t i = from; i < fake_log().size(); ++i) {
    const FakeOp& op = fake_log()[i];
    if (op.what == "copy" && op.stream == stream && op.kind == kind) ++n;
  }
  return n;
}

StartedRead Start(std::shared_ptr<SwapStore> store, int layer, bool in_place = false) {
  std::vector<std::string> keys;
  for (size_t s = 0; s < kSizes.size(); ++s) keys.push_back(Key("p", layer, s));
  uint64_t ticket = store->ReadOwnedAsync(keys, true, in_place);
  while (!store->Done(ticket)) {
  }
  StartedRead r;
  r.store = store;
  r.store_id = 7;
  r.key = keys.front();
  r.ticket = ticket;
  return r;
}

std::vector<ShardIo> Outs(std::vector<std::vector<float>>& ys, int64_t grow = 0) {
  ys.clear();
  std::vector<ShardIo> outs;
  for (int64_t n : kSizes) ys.emplace_back(n + grow, -1.0f);
  for (size_t s = 0; s < kSizes.size(); ++s)
    outs.push_back({"", ys[s].data(), ys[s].size() * 4, "float32", {kSizes[s] + grow}});
  return outs;
}

std::vector<DeviceSpan> Spans(std::vector<std::vector<float>>& ys) {
  std::vector<DeviceSpan> spans;
  for (auto& y : ys) spans.push_back({y.data(), y.size() * 4});
  return spans;
}

// Takes layer `layer`'s read from the lane and copies it into fresh outputs; checks the values.
void Consume(CopyLane& lane, int layer, bool expect_staged) {
  cudaError_t err = cudaSuccess;
  std::optional<StartedRead> r = lane.Take(7, Key("p", layer, 0), &err);
  CHECK(r.has_value() && err == cudaSuccess, "layer %d's read was started", layer);
  CHECK(!r->error, "layer %d read without error", layer);
  CHECK((r->slot != nullptr) == expect_staged, "layer %d staged: %d", layer, r->slot != nullptr);
  std::vector<std::vector<float>> ys;
  SwapStore::CheckRead(*r->read, Outs(ys));
  size_t from = fake_log().size();
  CHECK(CopyIn(kXla, *r, Spans(ys)) == cudaSuccess, "CopyIn");
  if (expect_staged)
    CHECK(HostCopies(kXla->id, from) == 0, "a staged read reaches XLA's stream device to device");
  for (size_t s = 0; s < kSizes.size(); ++s)
    CHECK(ys[s] == Values(layer, s, kSizes[s]), "layer %d shard %zu arrives intact", layer, s);
}

struct Commit {
  std::shared_ptr<SwapStore> store;
  SwapStore::DetachedWrite write;
};

void CUDART_CB CommitWrite(void* data) {
  std::unique_ptr<Commit> c(static_cast<Commit*>(data));
  c->store->FinishDetached(std::move(c->write));
}

// One write's grads on the "device" (`salt` tells writes apart), the shards the store reserves
// for them and their device spans.
struct Grads {
  std::vector<std::vector<float>> values;
  std::vector<ShardIo> shards;
  std::vector<DeviceSpan> xs;
};

Grads GradsOf(int step, float salt) {
  Grads g;
  for (size_t s = 0; s < kSizes.size(); ++s) g.values.push_back(Values(step, s, kSizes[s], salt));
  for (size_t s = 0; s < kSizes.size(); ++s) {
    g.shards.push_back({Key("g", step, s), nullptr, g.values[s].size() * 4, "float32", {kSizes[s]}});
    g.xs.push_back({g.values[s].data(), g.values[s].size() * 4});
  }
  return g;
}

// The grads of write `step` read back from the store equal `grads`.
void CheckStored(SwapStore& store, int step, const std::vector<std::vector<float>>& grads) {
  std::vector<std::vector<float>> back;
  std::vector<ShardIo> outs = Outs(back);
  for (size_t s = 0; s < kSizes.size(); ++s) outs[s].key = Key("g", step, s);
  store.Wait(store.ReadManyAsync(outs));
  for (size_t s = 0; s < kSizes.size(); ++s)
    CHECK(back[s] == grads[s], "grad shard %zu of write %d reaches the store intact", s, step);
}

void TestWrites(CopyLane& lane, std::shared_ptr<SwapStore> store) {
  for (int step = 0; step < 3; ++step) {  // more writes than staging buffers
    Grads g = GradsOf(step, 0.25f);
    const std::vector<std::vector<float>>& grads = g.values;
    const std::vector<DeviceSpan>& xs = g.xs;
    auto c = std::make_unique<Commit>(Commit{store, store->BeginDetached(g.shards)});
    size_t from = fake_log().size();
    CHECK(CopyOut(lane, kXla, xs, c->write.buffer->data(), c->write.at, false, CommitWrite,
                  c.get()) == cudaSuccess, "CopyOut");
    c.release();
    CHECK(HostCopies(kXla->id, from) == 0, "grads leave XLA's stream device to device only");
    CHECK(Copies(lane.stream()->id, cudaMemcpyDeviceToHost, from) == 1,
          "one copy to the host on the copy stream");
    CheckStored(*store, step, grads);
  }
}

void TestStagedReads(CopyLane& lane, std::shared_ptr<SwapStore> store) {
  size_t from = fake_log().size();
  for (int layer = 0; layer < 3; ++layer) lane.Started(Start(store, layer));
  CHECK(lane.Pump() == cudaSuccess, "Pump");
  CHECK(lane.staged() == 2, "two staging buffers: two of three reads staged, got %zu", lane.staged());
  CHECK(HostCopies(kXla->id, from) == 0 && Copies(lane.stream()->id, cudaMemcpyHostToDevice, from) == 2,
        "staging copies run on the copy stream");
  Consume(lane, 0, true);
  CHECK(lane.Pump() == cudaSuccess && lane.staged() == 2, "the drained buffer takes the third read");
  Consume(lane, 1, true);
  Consume(lane, 2, true);
  cudaError_t err;
  CHECK(!lane.Take(7, Key("p", 0, 0), &err).has_value(), "a read is taken once");
}

void TestNoFreeBuffer(CopyLane& one, std::shared_ptr<SwapStore> store) {
  one.Started(Start(store, 0));
  one.Started(Start(store, 1));
  CHECK(one.Pump() == cudaSuccess && one.staged() == 1, "one staging buffer: one read staged");
  size_t from = fake_log().size();
  Consume(one, 1, false);  // taken before the staged one: no buffer is free
  CHECK(Copies(kXla->id, cudaMemcpyHostToDevice, from) == static_cast<int>(kSizes.size()),
        "unstaged: from the host on XLA's stream");
  Consume(one, 0, true);
}

int Mallocs(size_t from) {
  int n = 0;
  for (size_t i = from; i < fake_log().size(); ++i) n += fake_log()[i].what == "malloc";
  return n;
}

// HBM has no room for a staging buffer: writes and reads cross on XLA's stream, intact, and
// the refused size is not asked for again.
void TestNoRoomForStaging(CopyLane& fresh, std::shared_ptr<SwapStore> store) {
  fake_malloc_limit() = 0;
  for (int step = 0; step < 2; ++step) {
    Grads g = GradsOf(step, 0.75f);
    auto c = std::make_unique<Commit>(Commit{store, store->BeginDetached(g.shards)});
    size_t from = fake_log().size();
    CHECK(CopyOut(fresh, kXla, g.xs, c->write.buffer->data(), c->write.at, false, CommitWrite,
                  c.get()) == cudaSuccess, "CopyOut without room for staging");
    c.release();
    CHECK(Copies(kXla->id, cudaMemcpyDeviceToHost, from) == static_cast<int>(kSizes.size()) &&
          HostCopies(fresh.stream()->id, from) == 0, "grads cross on XLA's stream");
    CHECK(Mallocs(from) == (step == 0 ? 1 : 0), "write %d asked for HBM %d times", step,
          Mallocs(from));
    CheckStored(*store, step, g.values);
  }
  fresh.Started(Start(store, 0));
  CHECK(fresh.Pump() == cudaSuccess && fresh.staged() == 0, "no room: no read staged");
  size_t from = fake_log().size();
  Consume(fresh, 0, false);
  CHECK(Copies(kXla->id, cudaMemcpyHostToDevice, from) == static_cast<int>(kSizes.size()),
        "unstaged: from the host on XLA's stream");
  fake_malloc_limit() = SIZE_MAX;
}

void TestMismatch(CopyLane& lane, std::shared_ptr<SwapStore> store) {
  lane.Started(Start(store, 2));
  cudaError_t err;
  std::optional<StartedRead> r = lane.Take(7, Key("p", 2, 0), &err);
  CHECK(r && r->slot != nullptr, "staged when taken");
  std::vector<std::vector<float>> ys;
  bool threw = false;
  try {
    SwapStore::CheckRead(*r->read, Outs(ys, /*grow=*/1));
  } catch (const ShardMismatch& e) {
    threw = std::string(e.what()).find("was written as") != std::string::npos;
  }
  CHECK(threw, "a read taken with other shapes is refused, naming both");
  Release(kXla, *r);
  for (int layer = 0; layer < 3; ++layer) lane.Started(Start(store, layer));
  CHECK(lane.Pump() == cudaSuccess && lane.staged() == 2, "the released buffer is reused");
  for (int layer = 0; layer < 3; ++layer) Consume(lane, layer, true);
}

// The pin hooks the CUDA handlers set, recording what they lock; `refuse_pins` makes them fail.
std::vector<std::pair<const void*, size_t>> pins;
int unpins = 0;
bool refuse_pins = false;

bool FakePin(void* p, size_t bytes) {
  if (refuse_pins) return false;
  pins.push_back({p, bytes});
  return true;
}

void FakeUnpin(void*) { ++unpins; }

bool Pinned(const void* p) {
  for (const auto& [at, bytes] : pins)
    if (p >= at && static_cast<const uint8_t*>(p) < static_cast<const uint8_t*>(at) + bytes)
      return true;
  return false;
}

// A memory store page-locks only the extents it lends a device (grads written in place, params
// read in place), each once, never the optimizer's states; once a lock is refused it lends
// buffers, and the data arrives intact either way.
void TestPinnedExtents() {
  StoreConfig config;
  config.memory = true;
  config.fresh = true;
  {
    auto store = std::make_shared<SwapStore>(config);
    std::vector<float> master = Values(9, 0, 100000);
    store->Wait(store->WriteManyAsync({{"m/0", master.data(), master.size() * 4, "float32",
                                        {static_cast<int64_t>(master.size())}}}));
    WriteLayer(*store, 0);
    store->SetPinHooks(&FakePin, &FakeUnpin);
    CHECK(pins.empty(), "setting the hooks locks none of the mapping, got %zu locks", pins.size());
    uint64_t lent_bytes = 0;
    for (int step = 0; step < 2; ++step) {
      std::vector<ShardIo> shards;
      for (size_t s = 0; s < kSizes.size(); ++s)
        shards.push_back({Key("g", 0, s), nullptr, static_cast<size_t>(kSizes[s]) * 4, "float32",
                          {kSizes[s]}});
      SwapStore::DetachedWrite w = store->BeginDetached(shards, /*in_place=*/true);
      CHECK(!w.buffer, "a grads write lends the mapping");
      for (size_t s = 0; s < kSizes.size(); ++s) {
        std::vector<float> g = Values(step, s, kSizes[s], 0.5f);
        std::memcpy(w.base + w.at[s], g.data(), g.size() * 4);
        CHECK(Pinned(w.base + w.at[s]), "the lent grads extent %zu is locked", s);
        if (step == 0) lent_bytes += w.entries[s].capacity;
      }
      store->FinishDetached(std::move(w));
      CHECK(pins.size() == kSizes.size(), "each extent locked once, got %zu locks", pins.size());
    }
    uint64_t ticket = store->ReadOwnedAsync({Key("p", 0, 0), Key("p", 0, 1)}, true, true);
    std::vector<std::vector<float>> ys;
    store->TakeResults(ticket, Outs(ys));
    for (size_t s = 0; s < kSizes.size(); ++s) {
      CHECK(ys[s] == Values(0, s, kSizes[s]), "params shard %zu read in place intact", s);
      ShardEntry e;
      CHECK(Pinned(store->View(Key("p", 0, s), &e)), "the params read in place are locked");
      lent_bytes += e.capacity;
    }
    ShardEntry e;
    CHECK(!Pinned(store->View("m/0", &e)), "the optimizer's states stay pageable");
    CHECK(store->mapping_pinned_bytes() == lent_bytes, "locked %llu bytes, lent %llu",
          static_cast<unsigned long long>(store->mapping_pinned_bytes()),
          static_cast<unsigned long long>(lent_bytes));
    refuse_pins = true;
    std::vector<float> g = Values(5, 0, kSizes[0], 0.25f);
    SwapStore::DetachedWrite w = store->BeginDetached(
        {{Key("g", 5, 0), nullptr, g.size() * 4, "float32", {kSizes[0]}}}, /*in_place=*/true);
    CHECK(w.buffer != nullptr, "a refused lock borrows a buffer");
    std::memcpy(w.base + w.at[0], g.data(), g.size() * 4);
    store->FinishDetached(std::move(w));
    CHECK(!store->LendsMapping(), "nothing is lent after a refusal");
    std::vector<float> back(g.size());
    store->Wait(store->ReadManyAsync({{Key("g", 5, 0), back.data(), back.size() * 4, "float32",
                                       {kSizes[0]}}}));
    CHECK(back == g, "a borrowed write arrives intact");
  }
  CHECK(unpins == static_cast<int>(pins.size()), "every locked extent unlocked at close: %d of %zu",
        unpins, pins.size());
}

// Through the copy stream, a memory store that lends its mapping is copied from and to in
// place: grads and params move between their own (locked) extents and the staging buffers one
// shard at a time, no buffer is borrowed, nothing crosses to the host on XLA's stream, and the
// data arrives intact.
void TestLentThroughLane(CopyLane& lane) {
  StoreConfig config;
  config.memory = true;
  config.fresh = true;
  size_t locks = pins.size();
  {
    auto store = std::make_shared<SwapStore>(config);
    store->SetPinHooks(&FakePin, &FakeUnpin);
    for (int layer = 0; layer < 3; ++layer) WriteLayer(*store, layer);
    for (int step = 0; step < 3; ++step) {  // more writes than staging buffers
      Grads g = GradsOf(step, 0.75f);
      const std::vector<std::vector<float>>& grads = g.values;
      const std::vector<DeviceSpan>& xs = g.xs;
      auto c = std::make_unique<Commit>(Commit{store, store->BeginDetached(g.shards, true)});
      CHECK(!c->write.buffer, "a grads write lends the mapping through the copy stream");
      for (size_t s = 0; s < kSizes.size(); ++s)
        CHECK(Pinned(c->write.base + c->write.at[s]), "grads extent %zu is locked", s);
      size_t from = fake_log().size();
      Commit* commit = c.release();  // owned by CommitWrite, which the stand-in runs at once
      CHECK(CopyOut(lane, kXla, xs, commit->write.base, commit->write.at, true, CommitWrite,
                    commit) == cudaSuccess, "CopyOut in place");
      CHECK(HostCopies(kXla->id, from) == 0, "grads leave XLA's stream device to device only");
      CHECK(Copies(lane.stream()->id, cudaMemcpyDeviceToHost, from) == static_cast<int>(kSizes.size()),
            "one copy per shard to its extent on the copy stream");
      CheckStored(*store, step, grads);  // in their extents: read back from the mapping
    }
    size_t from = fake_log().size();
    for (int layer = 0; layer < 3; ++layer) lane.Started(Start(store, layer, true));
    CHECK(lane.Pump() == cudaSuccess && lane.staged() == 2, "two of three lent reads staged");
    CHECK(HostCopies(kXla->id, from) == 0 &&
              Copies(lane.stream()->id, cudaMemcpyHostToDevice, from) == 2 * static_cast<int>(kSizes.size()),
          "each lent shard staged from its extent on the copy stream");
    for (int layer = 0; layer < 3; ++layer) {
      cudaError_t err = cudaSuccess;
      std::optional<StartedRead> r = lane.Take(7, Key("p", layer, 0), &err);
      CHECK(r && err == cudaSuccess && r->slot != nullptr, "layer %d's lent read staged", layer);
      CHECK(!r->read->buffer, "layer %d's read borrowed no buffer", layer);
      std::vector<std::vector<float>> ys;
      SwapStore::CheckRead(*r->read, Outs(ys));
      size_t before = fake_log().size();
      CHECK(CopyIn(kXla, *r, Spans(ys)) == cudaSuccess, "CopyIn of a lent read");
      CHECK(HostCopies(kXla->id, before) == 0, "a staged lent read reaches XLA's stream device to device");
      for (size_t s = 0; s < kSizes.size(); ++s)
        CHECK(ys[s] == Values(layer, s, kSizes[s]), "layer %d shard %zu arrives intact", layer, s);
      CHECK(lane.Pump() == cudaSuccess, "Pump");
    }
    CHECK(store->mapping_pinned_bytes() > 0, "the lent extents are locked");
  }
  CHECK(unpins == static_cast<int>(pins.size()), "every extent locked through the lane unlocked at "
        "close: %d of %zu (%zu before)", unpins, pins.size(), locks);
}

}  // namespace
}  // namespace zinfjax

int main(int argc, char** argv) {
  using namespace zinfjax;
  if (argc != 2) {
    std::fprintf(stderr, "usage: copies_test FOLDER|memory\n");
    return 2;
  }
  StoreConfig config;
  config.memory = std::string(argv[1]) == "memory";
  if (!config.memory) config.paths = {argv[1]};
  config.fresh = true;
  auto store = std::make_shared<SwapStore>(config);
  for (int layer = 0; layer < 3; ++layer) WriteLayer(*store, layer);
  setenv("ZINFJAX_COPY_STAGING", "2", 1);
  cudaError_t err = cudaSuccess;
  CopyLane* lane = CopyLane::For(0, &err);
  CHECK(lane != nullptr && err == cudaSuccess, "lane");
  setenv("ZINFJAX_COPY_STAGING", "1", 1);
  CopyLane* one = CopyLane::For(1, &err);
  CHECK(one != nullptr && one != lane, "a lane per device");
  TestWrites(*lane, store);
  TestStagedReads(*lane, store);
  TestNoFreeBuffer(*one, store);
  TestMismatch(*lane, store);
  CopyLane* fresh = CopyLane::For(2, &err);
  CHECK(fresh != nullptr, "a third lane");
  TestNoRoomForStaging(*fresh, store);
  returns().Drain();  // every host buffer goes back to the store
  if (config.memory) {
    TestPinnedExtents();
    refuse_pins = false;
    TestLentThroughLane(*lane);
  }
  std::printf("copies_test: %d checks passed (%s store)\n", checks, argv[1]);
  return 0;
}
