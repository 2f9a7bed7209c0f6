// What the forward and the backward share: the problem's geometry (which keys a query
// sees), the masking of a tile's scores, the checks of the handlers' operands, and the
// loop that shares work over XLA's intra-op thread pool.
//
// Layouts (row-major, the dimension names of functional.py): tokens before heads, as
// the modules' projections produce them, so that no transpose is needed around a call:
//   q (B, T, H, D)   k (B, S, Hkv, D)   v (B, S, Hkv, Dv)   lengths (B,) int32
//   out (B, T, H, Dv)   row_max, row_sum (B, H, T)
// Query head h reads key/value head h / (H / Hkv).  Query i (at key position
// i + offset) sees key j iff i + offset - left <= j <= i + offset + right and
// j < lengths[b]; left / right < 0 mean unbounded on that side.
//   sinks (H,) float, or (0,) for none: attention sinks, one logit per query head in the
//   units of the scaled scores, that join each row's softmax denominator.
#pragma once
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>

#include "xla/ffi/api/ffi.h"

namespace twin {

namespace ffi = xla::ffi;

static int64_t tiles_of(int64_t n, int64_t size) { return (n + size - 1) / size; }

struct Problem {
  int64_t batch, heads, kv_heads, q_len, kv_len, width, v_width;
  float scale;
  int64_t offset, left, right;  // left / right < 0: unbounded
  const int32_t* lengths;
  const float* sinks;  // (H,), or null: no sinks

  bool heads_first = false;  // (B, H, T, width) arrays instead: decode.h's operands

  int64_t group() const { return heads / kv_heads; }
  // Row r of head h of example b in a (B, T, H, width) array ((B, H, T, width) where
  // heads_first), and the rows between one token of a head and the next.
  int64_t q_row(int64_t b, int64_t h, int64_t r) const {
    return heads_first ? (b * heads + h) * q_len + r : (b * q_len + r) * heads + h;
  }
  int64_t kv_row(int64_t b, int64_t hk, int64_t c) const {
    return heads_first ? (b * kv_heads + hk) * kv_len + c : (b * kv_len + c) * kv_heads + hk;
  }
  int64_t q_step() const { return heads_first ? 1 : heads; }
  int64_t kv_step() const { return heads_first ? 1 : kv_heads; }
  int64_t length(int64_t b) const { return std::clamp<int64_t>(lengths[b], 0, kv_len); }
  // Keys [first, last) that query row r of example b sees.
  int64_t first(int64_t r) const { return left < 0 ? 0 : std::max<int64_t>(0, r + offset - left); }
  int64_t last(int64_t b, int64_t r) const {
    const int64_t len = length(b);
    return right < 0 ? len : std::clamp<int64_t>(r + offset + right + 1, 0, len);
  }
};

// Keys of [c0, c0 + cols) outside [first(r), last(b, r)) for row r of the block rows
// [r0, r0 + rows) set to -inf in s (rows x cols, ld); the padding columns past
// n_valid too.
static void hide(const Problem& pb, int64_t b, int64_t r0, int64_t rows, int64_t c0, int64_t n_valid,
                 int64_t cols, float* s, int64_t ld) {
  const int64_t lo = pb.first(r0 + rows - 1), hi = pb.last(b, r0);  // what every row sees
  if (lo <= c0 && hi >= c0 + cols && n_valid == cols) return;
  const float neg_inf = -__builtin_inff();
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t a = std::max<int64_t>(pb.first(r0 + i) - c0, 0);
    const int64_t z = std::clamp<int64_t>(pb.last(b, r0 + i) - c0, 0, n_valid);
    float* row = s + i * ld;
    if (z <= a) {
      std::fill(row, row + cols, neg_inf);
      continue;
    }
    std::fill(row, row + a, neg_inf);
    std::fill(row + z, row + cols, neg_inf);
  }
}

// Runs f(0) .. f(n - 1) on the calling thread and the pool's: each participant takes
// the next index until none is left, so the caller finishes alone if the pool is busy.
template <typename F>
void parallel_for(ffi::ThreadPool& pool, int64_t n, F&& f) {
  struct State {
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto state = std::make_shared<State>();
  auto work = [state, n, &f]() {
    for (;;) {
      const int64_t i = state->next.fetch_add(1);
      if (i >= n) return;
      f(i);
      if (state->done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(state->mu);
        state->cv.notify_all();
      }
    }
  };
  const int64_t helpers = std::min<int64_t>(std::max<int64_t>(pool.num_threads(), 1), n) - 1;
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work]() { work(); });
  work();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done.load() == n; });
}

static bool consistent(const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<ffi::F32>& k, const ffi::Buffer<ffi::F32>& v,
                       const ffi::Buffer<ffi::S32>& lengths, const ffi::Buffer<ffi::F32>& sinks,
                       bool heads_first = false) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const int t = heads_first ? 2 : 1, h = heads_first ? 1 : 2;  // the token and head axes
  return qd.size() == 4 && kd.size() == 4 && vd.size() == 4 && kd[0] == qd[0] && vd[0] == qd[0] &&
         kd[h] == vd[h] && kd[h] > 0 && qd[h] % kd[h] == 0 && kd[t] == vd[t] && kd[3] == qd[3] &&
         lengths.element_count() == static_cast<size_t>(qd[0]) &&
         (sinks.element_count() == 0 || sinks.element_count() == static_cast<size_t>(qd[h]));
}

// The problem of a call's operands, tokens before heads, or heads before tokens
// (heads_first: q (B, H, T, D), k (B, Hkv, S, D), v (B, Hkv, S, Dv)).
static Problem problem(const ffi::Buffer<ffi::F32>& q, const ffi::Buffer<ffi::F32>& k, const ffi::Buffer<ffi::F32>& v,
                       const ffi::Buffer<ffi::S32>& lengths, const ffi::Buffer<ffi::F32>& sinks, float scale,
                       int64_t offset, int64_t left, int64_t right, bool heads_first = false) {
  const auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions();
  const int t = heads_first ? 2 : 1, h = heads_first ? 1 : 2;  // the token and head axes
  return Problem{qd[0], qd[h], kd[h], qd[t], kd[t], qd[3], vd[3], scale, offset, left, right, lengths.typed_data(),
                 sinks.element_count() == 0 ? nullptr : sinks.typed_data(), heads_first};
}

// A row's sink joined to its normaliser (sinks): the keys' scaled maximum top = max * scale
// and the sink against m = max(top, sink), so that neither exponent is positive.  The
// row's weights are exp((s - max) * scale) * keys / denominator; `normaliser` is the same
// in the frame of the keys' maximum, denominator / keys (infinite where the sink outweighs
// every key beyond float's range: their weights are then 0), which the backward reads.
struct SinkJoin {
  float keys, denominator, normaliser;
};

static SinkJoin join_sink(float row_max, float row_sum, float scale, float sink) {
  const float top = row_max * scale;
  const bool above = sink > top;
  const float keys = above ? std::exp(top - sink) : 1.0f;
  const float denominator = row_sum * keys + (above ? 1.0f : std::exp(sink - top));
  return SinkJoin{keys, denominator, denominator / keys};
}

// The sink's weight in a row from the forward's saved maximum and normaliser: 0 for a
// row that saw nothing, 1 where the sink outweighs the keys beyond float's range.
static float sink_probability(float row_max, float normaliser, float scale, float sink) {
  if (normaliser == 0.0f) return 0.0f;
  const float e = std::exp(sink - row_max * scale);
  return e < normaliser ? e / normaliser : 1.0f;
}

}  // namespace twin
