// How a projection's tiles are divided among the threads (linear.cpp).
//
//   - A step of a few rows is bound by the bytes it reads: each thread streams an equal share
//     of the bytes from its front (in lanes: tiles.h `LaneRun`), and a thread done with its
//     own takes half of what is left of the share with the most left, from its back
//     (`Shares`), so the threads finish together even when one runs slower (a busier core,
//     another VM's load on its host core).
//   - A step of many rows is bound by arithmetic: threads claim passes of tiles in turn
//     (`chunks`), each pass's weights staying in L2 while every slab of rows reads them.
#pragma once

#include "tiles.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

namespace iterserve {

// A few rows' step: thread i's share of all tiles, [bounds[i], bounds[i + 1]), by equal
// shares of the bytes, each read as one stream: bounds[i] is the first tile with at least
// i / threads of the bytes before it. Found segment by segment, not tile by tile: walking a
// 1B's head tile by tile (8,016 tiles) put ~14 us on each one-row step (AVX-512 BF16).
inline std::vector<int64_t> split_by_bytes(const std::vector<Segment>& segs, int threads) {
  int64_t total = 0;
  for (const Segment& seg : segs) total += seg.stride * seg.tiles;
  const int64_t all = segs.empty() ? 0 : segs.back().first + segs.back().tiles;
  std::vector<int64_t> bounds(threads + 1, all);
  bounds[0] = 0;
  int64_t before = 0;  // bytes of the segments before this one, times threads
  int next = 1;
  for (const Segment& seg : segs) {
    // Tile t of this segment has before + t * stride bytes before it (times threads).
    const int64_t step = seg.stride * threads;
    for (; next < threads; ++next) {
      const int64_t need = total * next - before;
      const int64_t t = need <= 0 ? 0 : (need + step - 1) / step;
      if (t >= seg.tiles) break;
      bounds[next] = seg.first + t;
    }
    before += step * seg.tiles;
  }
  return bounds;
}

// Steps [begin, end) of a few rows' step list (`Shares`).
struct StepRange {
  int64_t begin = 0, end = 0;
};

// The steps of one thread's share still to do, [front, back), in one atomic word, so that its
// owner (taking from the front) and a thread done with its own (from the back) never take the
// same step.
class alignas(64) Share {
 public:
  void reset(StepRange r) { word_.store(pack(r.begin, r.end), std::memory_order_relaxed); }
  int64_t left() const {
    const uint64_t w = word_.load(std::memory_order_relaxed);
    return static_cast<int64_t>(w >> 32) - static_cast<int64_t>(w & 0xffffffffu);
  }
  // The owner's next step, from the front; false when none are left.
  bool take_front(int64_t& taken) {
    StepRange step;
    if (!take([](int64_t front, int64_t) { return StepRange{front, front + 1}; }, step))
      return false;
    taken = step.begin;
    return true;
  }
  // Half the steps left (at least one), from the back, for another thread to run front to
  // back as lanes of its own; false when none are left.
  bool take_back_half(StepRange& taken) {
    return take(
        [](int64_t front, int64_t back) {
          return StepRange{back - std::max<int64_t>(1, (back - front) / 2), back};
        },
        taken);
  }

 private:
  // The steps pick(front, back) names, at the front or at the back of what is left, in one
  // exchange of the word; false when none are left.
  template <typename Pick>
  bool take(Pick pick, StepRange& taken) {
    uint64_t w = word_.load(std::memory_order_relaxed);
    for (;;) {
      const int64_t front = static_cast<int64_t>(w & 0xffffffffu);
      const int64_t back = static_cast<int64_t>(w >> 32);
      if (front >= back) return false;
      taken = pick(front, back);
      const uint64_t rest =
          taken.begin == front ? pack(taken.end, back) : pack(front, taken.begin);
      if (word_.compare_exchange_weak(w, rest)) return true;
    }
  }
  static uint64_t pack(int64_t front, int64_t back) {
    return static_cast<uint64_t>(front) | static_cast<uint64_t>(back) << 32;
  }
  std::atomic<uint64_t> word_{0};
};

// A few rows' step, thread by thread: each thread's share by split_by_bytes, as the lane steps
// of M rows (tiles.h `LaneRun`: each segment's part of the share in lanes), to be run from its
// front by its own thread, a step at a time (up to 4 tiles, ~75 KB of Q4_K at 2048 inputs),
// while a thread done with its own takes half of what is left of the share with most left,
// from its back, and runs it front to back (its lanes forward, as streams; a step at a time
// from the back, each a tile before the last of every lane, read them backwards). Against the
// equal split alone, the one-row projections of a 1B Q4_K_M's 16 layers in turn (2 threads)
// waited ~5 us a call for the slower thread instead of 5-80 us, and ran 3-5% faster in a
// quiet spell (2026-11-29, avx512vnni, a throwaway harness of these loops); the engine's
// batch-1 decode of that file moved within this machine's noise.
class Shares {
 public:
  Shares(const std::vector<Segment>& segs, int threads, int64_t M)
      : shares_(new Share[threads]), first_run_(threads + 1, 0), threads_(threads) {
    const std::vector<int64_t> bounds = split_by_bytes(segs, threads);
    runs_.reserve(segs.size() + threads);
    for (int i = 0; i < threads; ++i) {
      int64_t steps = 0;
      for (size_t s = 0; s < segs.size(); ++s) {
        const Segment& seg = segs[s];
        const int64_t lo = std::max(bounds[i], seg.first);
        const int64_t hi = std::min(bounds[i + 1], seg.first + seg.tiles);
        if (lo >= hi) continue;
        runs_.emplace_back(static_cast<int64_t>(s), lo - seg.first, hi - seg.first,
                           few_rows_width(seg.format, M), seg.stride);
        steps += runs_.back().steps();
      }
      first_run_[i + 1] = static_cast<int64_t>(runs_.size());
      shares_[i].reset({0, steps});
    }
  }

  // Calls run(step) on share i's steps from its front, then on halves of what is left of the
  // others', taken from their backs, until none are left.
  template <typename F>
  void run(int i, F&& run_step) {
    int64_t taken;
    while (shares_[i].take_front(taken)) run_step(step(i, taken));
    for (;;) {
      int most = -1;
      int64_t most_left = 0;
      for (int j = 0; j < threads_; ++j)
        if (const int64_t left = shares_[j].left(); left > most_left) most = j, most_left = left;
      if (most < 0) return;
      StepRange half;
      if (shares_[most].take_back_half(half))
        for (int64_t k = half.begin; k < half.end; ++k) run_step(step(most, k));
    }
  }

 private:
  // Step k of share i (its runs' steps in order; a share spans a few segments at most).
  LaneStep step(int i, int64_t k) const {
    for (int64_t r = first_run_[i];; ++r) {
      const int64_t n = runs_[r].steps();
      if (k < n) return runs_[r].step(k);
      k -= n;
    }
  }

  std::unique_ptr<Share[]> shares_;
  std::vector<LaneRun> runs_;       // share after share
  std::vector<int64_t> first_run_;  // share i's runs: [first_run_[i], first_run_[i + 1])
  int threads_;
};

// What a thread takes at a time in a step of many rows: a pass of one segment's tiles.
struct Chunk {
  int64_t seg;
  int64_t t_begin, t_end;  // the segment's own tile numbers
};

// All the weight's tiles as chunks, segment after segment, in the order they lie in memory.
// Threads claim them one after another as they finish the last (linear.cpp), so a thread
// that runs slower takes fewer, where an equal split of the tiles had every step wait for it
// at the end. A few rows' steps keep the split by bytes (`Shares`): one stream a thread,
// where passes claimed in turn made the bundled model's one-row steps 13% slower (each pass
// a stream started afresh, on projections of ~60 tiles; benchmarks/decode_speed.py,
// 2026-11-29, avx512vnni), and a 1B's no faster.
inline std::vector<Chunk> chunks(const std::vector<Segment>& segs) {
  std::vector<Chunk> out;
  for (size_t s = 0; s < segs.size(); ++s)
    for (int64_t t = 0; t < segs[s].tiles; t += kTilesPerPass)
      out.push_back({static_cast<int64_t>(s), t, std::min(t + kTilesPerPass, segs[s].tiles)});
  return out;
}

}  // namespace iterserve
