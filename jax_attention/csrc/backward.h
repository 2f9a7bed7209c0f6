// The backward: dQ, dK and dV from the forward's inputs, output and row statistics.
//
// Everything is computed transposed, keys as rows: S^T = K Q^T, P^T, dP^T = V dO^T and
// dS^T, so that dV += P^T dO, dK += dS^T Q and dQ^T += K^T dS^T are products of
// row-major operands with no transpose inside the loops.  Queries are taken in blocks
// of kBwdRows (a multiple of 16: the vector width of those products), keys in tiles.
// Work is shared by (batch, key/value head): a task owns its dK and dV and the dQ of its
// group of query heads.  Attention sinks: the forward's saved normaliser holds them, so
// the weights are recomputed as without; each sink's gradient is reduced from the rows'
// sink weights and rowsum(dO * O) (sink_gradient), per example, then summed.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "attention.h"
#include "gemm.h"
#include "scratch.h"
#include "vec.h"

namespace twin {

constexpr int64_t kBwdRows = 64;   // query rows of a backward block
// Keys of a backward tile: 128, or 64 up to 512 keys.  At short lengths the causal
// diagonal is a large share of the work, and a (128 keys x 64 queries) tile on it computes
// twice what its rows see; from about 1024 keys the larger tile is ahead.
constexpr int64_t kBwdKeys = 128, kBwdShortKeys = 64, kShortKeys = 512;
static int64_t backward_keys(const Problem& pb) { return pb.kv_len <= kShortKeys ? kBwdShortKeys : kBwdKeys; }

struct BackwardArgs {
  const float *q, *k, *v, *out, *d_out, *row_max, *row_sum;
  float *dq, *dk, *dv;
  float* dq_parts;  // (chunks, B, T, H, D) when a unit's key tiles are split, else null
  int64_t chunks;
  float* dsink_parts;  // (B, H): each example's share of the sinks' gradient, or null (no sinks)
};

// One query head's operands, padded to whole blocks: rows past T have 1 / l = 0 (hidden).
struct HeadOperands {
  float *q, *qt, *d_out, *d_out_t, *m, *inv_l, *delta, *dqt;
};

// A backward task's working memory, carved out of one Scratch: each of the group's G
// query heads' operands, then the unit's key tile, its products and its dK and dV.
struct UnitMemory {
  int64_t head_floats = 0, unit_floats = 0;
  // Each piece starts on 16 floats (64 bytes).
  static int64_t piece(int64_t n) { return round_up(n, kPad); }
  UnitMemory(const Problem& pb, int64_t keys) {
    const int64_t D = pb.width, Dv = pb.v_width, Dp = round_up(D, kPad), Dvp = round_up(Dv, kPad);
    const int64_t Tp = round_up(pb.q_len, kBwdRows), R = kBwdRows;
    head_floats = piece(Tp * Dp) + piece(Tp * D) + piece(Tp * Dvp) + piece(Tp * Dv) + 3 * piece(Tp) + piece(Tp * D);
    unit_floats = piece(keys * D) + piece(keys * Dv) + piece(D * keys) + 2 * piece(keys * R) + piece(keys * Dp) +
                  piece(keys * Dvp);
  }
  int64_t total(int64_t G) const { return G * head_floats + unit_floats; }
};

// Hands out consecutive pieces of a buffer.
struct Carver {
  float* next;
  float* take(int64_t n) {
    float* p = next;
    next += UnitMemory::piece(n);
    return p;
  }
};

static void prepare_head(const Problem& pb, const BackwardArgs& a, int64_t b, int64_t h, Carver& memory,
                         HeadOperands& op) {
  const int64_t D = pb.width, Dv = pb.v_width, Dp = round_up(D, kPad), Dvp = round_up(Dv, kPad);
  const int64_t T = pb.q_len, R = kBwdRows, Tp = round_up(T, R), blocks = Tp / R, head = b * pb.heads + h;
  const int64_t ldq = pb.heads * D, ldo = pb.heads * Dv;
  const float* Q = a.q + pb.q_row(b, h, 0) * D;
  const float* dO = a.d_out + pb.q_row(b, h, 0) * Dv;
  const float* O = a.out + pb.q_row(b, h, 0) * Dv;
  op.q = memory.take(Tp * Dp);
  op.qt = memory.take(blocks * D * R);  // block i: (D, R) at i * D * R
  op.d_out = memory.take(Tp * Dvp);
  op.d_out_t = memory.take(blocks * Dv * R);
  op.m = memory.take(Tp);
  op.inv_l = memory.take(Tp);
  op.delta = memory.take(Tp);
  op.dqt = memory.take(blocks * D * R);
  pack(T, D, Q, ldq, op.q, Dp, Tp);
  pack(T, Dv, dO, ldo, op.d_out, Dvp, Tp);
  std::fill(op.qt, op.qt + blocks * D * R, 0.0f);
  std::fill(op.d_out_t, op.d_out_t + blocks * Dv * R, 0.0f);
  for (int64_t i = 0; i < blocks; ++i) {
    const int64_t rows = std::min(R, T - i * R);
    transpose(rows, D, op.q + i * R * Dp, Dp, op.qt + i * D * R, R);
    transpose(rows, Dv, op.d_out + i * R * Dvp, Dvp, op.d_out_t + i * Dv * R, R);
  }
  std::fill(op.m, op.m + Tp, 0.0f);
  std::fill(op.inv_l, op.inv_l + Tp, 0.0f);  // 0 for a row with nothing to attend to, and past T: zero weights
  std::fill(op.delta, op.delta + Tp, 0.0f);
  std::copy(a.row_max + head * T, a.row_max + (head + 1) * T, op.m);
  for (int64_t r = 0; r < T; ++r) {
    const float l = a.row_sum[head * T + r];
    op.inv_l[r] = l == 0.0f ? 0.0f : 1.0f / l;
  }
  // delta = rowsum(dO * O): dO from its packed copy, whole vectors, then the rest.
  const int64_t whole = Dv / kLanes * kLanes;
  for (int64_t r = 0; r < T; ++r) {
    const float* dor = op.d_out + r * Dvp;
    const float* orow = O + r * ldo;
    vf acc{};
    for (int64_t c = 0; c < whole; c += kLanes) acc += load(dor + c) * load(orow + c);
    float sum = sum_lanes(acc);
    for (int64_t c = whole; c < Dv; ++c) sum += dor[c] * orow[c];
    op.delta[r] = sum;
  }
  std::fill(op.dqt, op.dqt + blocks * D * R, 0.0f);
}

// The gradient of head h's sink from example b's rows: the sink is a logit with no value,
// so the softmax's backward gives it -sum_r p_sink(r) * delta(r).
static float sink_gradient(const Problem& pb, const BackwardArgs& a, int64_t b, int64_t h, const HeadOperands& op) {
  const int64_t T = pb.q_len, head = b * pb.heads + h;
  double total = 0.0;
  for (int64_t r = 0; r < T; ++r)
    total += sink_probability(op.m[r], a.row_sum[head * T + r], pb.scale, pb.sinks[h]) * op.delta[r];
  return static_cast<float>(-total);
}

// The key tiles t = chunk, chunk + chunks, ... of key/value head (b, hk): dK and dV of
// those tiles, and their share of dQ for the group's query heads.  (next_b, next_hk): the
// unit to prefetch for, or next_b < 0.
static void backward_unit(const Problem& pb, const BackwardArgs& a, int64_t b, int64_t hk, int64_t chunk,
                          int64_t next_b, int64_t next_hk) {
  const int64_t D = pb.width, Dv = pb.v_width, Dp = round_up(D, kPad), Dvp = round_up(Dv, kPad);
  const int64_t T = pb.q_len, G = pb.group(), R = kBwdRows, blocks = tiles_of(T, R);
  const int64_t len = pb.length(b), ldk = pb.kv_heads * D, ldv = pb.kv_heads * Dv;
  const int64_t keys = backward_keys(pb);
  // The operands of the unit that this thread will most likely take next (q, dO and O of
  // its query heads, its first two key tiles), fetched into L2 while this one computes:
  // their first reads (the copies of q, dO, k and v, delta's pass over O) otherwise wait
  // on memory.
  Prefetcher<2> ahead;
  if (next_b >= 0) {
    // The group's query heads are side by side in a row: G * D floats of q, G * Dv of dO and O.
    ahead.add(a.q + pb.q_row(next_b, next_hk * G, 0) * D, T, pb.heads * D, G * D);
    ahead.add(a.d_out + pb.q_row(next_b, next_hk * G, 0) * Dv, T, pb.heads * Dv, G * Dv);
    ahead.add(a.out + pb.q_row(next_b, next_hk * G, 0) * Dv, T, pb.heads * Dv, G * Dv);
    const int64_t rows = std::min(pb.length(next_b), 2 * keys);  // its first two key tiles
    ahead.add(a.k + pb.kv_row(next_b, next_hk, 0) * D, rows, ldk, D);
    ahead.add(a.v + pb.kv_row(next_b, next_hk, 0) * Dv, rows, ldv, Dv);
    ahead.start(blocks * tiles_of(len, keys) * G / 2);  // about the (tile, block, head) steps below
  }
  const Scratch work(kBackwardUnit, UnitMemory(pb, keys).total(G));
  Carver memory{work.get()};
  std::vector<HeadOperands> heads(G);
  for (int64_t j = 0; j < G; ++j) {
    prepare_head(pb, a, b, hk * G + j, memory, heads[j]);
    if (a.dsink_parts != nullptr && chunk == 0)  // every chunk prepares the heads; one reports
      a.dsink_parts[b * pb.heads + hk * G + j] = sink_gradient(pb, a, b, hk * G + j, heads[j]);
  }
  float* const kp = memory.take(keys * D);
  float* const vp = memory.take(keys * Dv);
  float* const kt = memory.take(D * keys);
  float* const pt = memory.take(keys * R);
  float* const dst = memory.take(keys * R);
  float* const dk = memory.take(keys * Dp);
  float* const dv = memory.take(keys * Dvp);
  const float scale = pb.scale;
  const vi lane = lane_indices();
  for (int64_t t = chunk; t * keys < len; t += a.chunks) {
    const int64_t c0 = t * keys, n = std::min(keys, len - c0);
    pack(n, D, a.k + pb.kv_row(b, hk, c0) * D, ldk, kp, D, n);  // (n, D)
    pack(n, Dv, a.v + pb.kv_row(b, hk, c0) * Dv, ldv, vp, Dv, n);
    transpose(n, D, kp, D, kt, keys);  // (D, n)
    std::fill(dk, dk + keys * Dp, 0.0f);
    std::fill(dv, dv + keys * Dvp, 0.0f);
    for (int64_t i = 0; i < blocks; ++i) {
      const int64_t r0 = i * R, rows = std::min(R, T - r0);
      if (pb.first(r0) >= c0 + n || pb.last(b, r0 + rows - 1) <= c0) continue;  // no row sees the tile
      const bool edge = !(pb.first(r0 + rows - 1) <= c0 && pb.last(b, r0) >= c0 + n);
      for (int64_t j = 0; j < G; ++j) {
        HeadOperands& op = heads[j];
        gemm(n, R, D, kp, D, op.qt + i * D * R, R, pt, R, false);          // s^T = k q^T
        gemm(n, R, Dv, vp, Dv, op.d_out_t + i * Dv * R, R, dst, R, false);  // dp^T = v do^T
        for (int64_t c = 0; c < n; ++c) {
          // Rows [first, last) of the block see key c0 + c.
          int64_t first = 0, last = R;
          if (edge) {
            const int64_t key = c0 + c;
            if (pb.right >= 0) first = std::max<int64_t>(first, key - pb.offset - pb.right - r0);
            if (pb.left >= 0) last = std::min<int64_t>(last, key - pb.offset + pb.left + 1 - r0);
          }
          float* pr = pt + c * R;
          float* dr = dst + c * R;
          for (int64_t r = 0; r < R; r += kLanes) {
            const vi seen = (lane + static_cast<int32_t>(r) >= static_cast<int32_t>(first)) &
                            (lane + static_cast<int32_t>(r) < static_cast<int32_t>(last));
            const vf p = exp_nonpositive((load(pr + r) - load(op.m + r0 + r)) * scale) *
                         load(op.inv_l + r0 + r);
            const vf w = seen ? p : vf{};
            store(pr + r, w);
            store(dr + r, w * (load(dr + r) - load(op.delta + r0 + r)) * scale);
          }
        }
        gemm(n, Dvp, R, pt, R, op.d_out + r0 * Dvp, Dvp, dv, Dvp, true);  // dv += p^T do
        gemm(n, Dp, R, dst, R, op.q + r0 * Dp, Dp, dk, Dp, true);        // dk += ds^T q
        gemm(D, R, n, kt, keys, dst, R, op.dqt + i * D * R, R, true);  // dq^T += k^T ds^T
        ahead.step();
      }
    }
    for (int64_t r = 0; r < n; ++r) {
      std::memcpy(a.dk + pb.kv_row(b, hk, c0 + r) * D, dk + r * Dp, D * sizeof(float));
      std::memcpy(a.dv + pb.kv_row(b, hk, c0 + r) * Dv, dv + r * Dvp, Dv * sizeof(float));
    }
  }
  ahead.finish();
  float* dq = a.dq_parts ? a.dq_parts + chunk * pb.batch * T * pb.heads * D : a.dq;
  for (int64_t j = 0; j < G; ++j)
    for (int64_t i = 0; i < blocks; ++i) {
      const int64_t rows = std::min(R, T - i * R);
      transpose(D, rows, heads[j].dqt + i * D * R, R, dq + pb.q_row(b, hk * G + j, i * R) * D, pb.heads * D);
    }
}

static ffi::Error Backward(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                           ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::F32> out,
                           ffi::Buffer<ffi::F32> d_out, ffi::Buffer<ffi::F32> row_max, ffi::Buffer<ffi::F32> row_sum,
                           ffi::Buffer<ffi::F32> sinks, float scale, int64_t offset, int64_t left, int64_t right,
                           ffi::ResultBuffer<ffi::F32> dq, ffi::ResultBuffer<ffi::F32> dk,
                           ffi::ResultBuffer<ffi::F32> dv, ffi::ResultBuffer<ffi::F32> dsinks) {
  if (!consistent(q, k, v, lengths, sinks) || dsinks->element_count() != sinks.element_count())
    return ffi::Error::InvalidArgument("twin_attention_flash_bwd: inconsistent shapes");
  const Problem pb = problem(q, k, v, lengths, sinks, scale, offset, left, right);
  // Keys past a length get zero gradients; the tiles write the rest.
  for (int64_t b = 0; b < pb.batch; ++b) {
    const int64_t from = pb.kv_row(b, 0, pb.length(b)), to = pb.kv_row(b + 1, 0, 0);
    std::fill(dk->typed_data() + from * pb.width, dk->typed_data() + to * pb.width, 0.0f);
    std::fill(dv->typed_data() + from * pb.v_width, dv->typed_data() + to * pb.v_width, 0.0f);
  }
  const int64_t units = pb.batch * pb.kv_heads;
  const int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  // Too few (batch, kv head) units for the threads: each unit's key tiles are dealt
  // round-robin to parts, each with a dQ of its own, summed at the end.
  const int64_t chunks = units >= threads ? 1 : tiles_of(threads, units);
  const int64_t size = pb.batch * pb.heads * pb.q_len * pb.width;
  // Each part is written whole: every unit writes its heads' rows of every part.
  const Scratch parts(kBackwardParts, chunks > 1 ? chunks * size : 0);
  std::vector<float> dsink_parts(pb.sinks != nullptr ? pb.batch * pb.heads : 0);
  const BackwardArgs args{q.typed_data(), k.typed_data(), v.typed_data(), out.typed_data(), d_out.typed_data(),
                          row_max.typed_data(), row_sum.typed_data(), dq->typed_data(), dk->typed_data(),
                          dv->typed_data(), chunks > 1 ? parts.get() : nullptr, chunks,
                          pb.sinks != nullptr ? dsink_parts.data() : nullptr};
  parallel_for(pool, units * chunks, [&](int64_t i) {
    const int64_t unit = i / chunks;
    // Work is dealt in order, so a thread's next unit is likely `threads` units on.
    const int64_t next = chunks == 1 && unit + threads < units ? unit + threads : -1;
    backward_unit(pb, args, unit / pb.kv_heads, unit % pb.kv_heads, i % chunks,
                  next < 0 ? -1 : next / pb.kv_heads, next < 0 ? -1 : next % pb.kv_heads);
  });
  if (chunks > 1) {
    float* total = dq->typed_data();
    std::copy(parts.get(), parts.get() + size, total);
    for (int64_t part = 1; part < chunks; ++part)
      for (int64_t e = 0; e < size; ++e) total[e] += parts.get()[part * size + e];
  }
  if (pb.sinks != nullptr)  // each head's sink gradient: its examples' shares summed
    for (int64_t h = 0; h < pb.heads; ++h) {
      double total = 0.0;
      for (int64_t b = 0; b < pb.batch; ++b) total += dsink_parts[b * pb.heads + h];
      dsinks->typed_data()[h] = static_cast<float>(total);
    }
  return ffi::Error::Success();
}

}  // namespace twin
