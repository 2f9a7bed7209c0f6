// The forward of a call with few query rows (a decode step: one token, or one token's
// query heads of a key/value head folded into rows), keys and values read where they lie.
//
// forward.h packs every key and value of the call first (K transposed, a tile at a time,
// zeros past each example's length), which costs as much as the attention itself when a
// few rows read them once, and as much as the whole buffer whatever its filled length.
// Here each (batch, key/value head) unit computes every query row of its group at once,
// and reads only the keys those rows see: the scores transposed, (keys x rows) = K Q^T,
// with K read in place as the product's rows (no copy, none past a length), then turned
// into (rows x keys) for the online softmax (online_softmax.h, the forward's own), and
// the weights times V, read in place where its rows are whole vectors.  So a step costs
// what the filled part of a cache costs, not the buffer's length.
//
// Operands in either layout (Problem::heads_first): heads before tokens, as a module's
// cache holds them, or tokens before heads as forward.h takes them; out and the row
// statistics (B, H, T) as forward.h writes them, so that its backward applies.
#pragma once
#include <algorithm>
#include <cstdint>

#include "attention.h"
#include "gemm.h"
#include "online_softmax.h"
#include "scratch.h"
#include "vec.h"

namespace twin {

constexpr int64_t kDecodeKeys = 256;  // keys of a tile

struct DecodeArgs {
  const float *q, *k, *v;
  float *out, *row_max, *row_sum;
};

// Every query row of unit (b, hk): row i = g * T + r is query r of head hk * G + g.
static void decode_unit(const Problem& pb, const DecodeArgs& a, int64_t b, int64_t hk) {
  const int64_t D = pb.width, Dv = pb.v_width, T = pb.q_len, G = pb.group(), rows = G * T;
  const int64_t R = round_up(rows, kPad), Dvp = round_up(Dv, kPad), keys = kDecodeKeys;
  const float neg_inf = -__builtin_inff();
  const int64_t qt_size = D * R, st_size = keys * R, s_size = R * keys, vp_size = keys * Dvp;
  const int64_t acc_size = R * Dvp, ml_size = R;
  const Scratch work(kForwardBlock, qt_size + st_size + s_size + vp_size + acc_size + 2 * ml_size);
  float* const Qt = work.get();      // (D, R): the rows' queries, transposed, zero past rows
  float* const st = Qt + qt_size;    // (keys, R): a tile's scores, transposed
  float* const s = st + st_size;     // (R, keys): the same, then the weights
  float* const vp = s + s_size;      // (keys, Dvp): a tile's values where they cannot be read in place
  float* const acc = vp + vp_size;   // (R, Dvp)
  float* const m = acc + acc_size;
  float* const l = m + ml_size;
  std::fill(Qt, Qt + qt_size, 0.0f);
  for (int64_t i = 0; i < rows; ++i) {
    const float* src = a.q + pb.q_row(b, hk * G + i / T, i % T) * D;
    for (int64_t d = 0; d < D; ++d) Qt[d * R + i] = src[d];
  }
  std::fill(acc, acc + acc_size, 0.0f);
  std::fill(m, m + rows, neg_inf);
  std::fill(l, l + rows, 0.0f);

  const int64_t ldk = pb.kv_step() * D, ldv = pb.kv_step() * Dv;
  const float* K = a.k + pb.kv_row(b, hk, 0) * D;
  const float* V = a.v + pb.kv_row(b, hk, 0) * Dv;
  const int64_t lo = pb.first(0), hi = pb.last(b, T - 1);  // what some row sees
  for (int64_t c0 = lo / keys * keys; c0 < hi; c0 += keys) {
    // Keys [c0, c0 + n) of the tile; the product reads no key past them.
    const int64_t n = std::min(keys, hi - c0), cols = round_up(n, kPad);
    gemm(n, R, D, K + c0 * ldk, ldk, Qt, R, st, R, false);  // (n, R) = K Q^T
    transpose(n, R, st, R, s, cols);  // the columns past n are hidden next
    for (int64_t g = 0; g < G; ++g) hide(pb, b, 0, T, c0, n, cols, s + g * T * cols, cols);
    softmax_tile(rows, cols, pb.scale, s, m, l, acc, Dvp);
    if (Dv == Dvp) {  // whole vectors: V's rows as they lie, the product over the tile's n keys only
      gemm(rows, Dvp, n, s, cols, V + c0 * ldv, ldv, acc, Dvp, true);
    } else {
      pack(n, Dv, V + c0 * ldv, ldv, vp, Dvp, n);
      gemm(rows, Dvp, n, s, cols, vp, Dvp, acc, Dvp, true);
    }
  }
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t h = hk * G + i / T, r = i % T, stat = (b * pb.heads + h) * T + r;
    finish_row(pb, h, acc + i * Dvp, m[i], l[i], a.out + pb.q_row(b, h, r) * Dv, a.row_max + stat,
               a.row_sum + stat);
  }
}

static ffi::Error Decode(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k,
                         ffi::Buffer<ffi::F32> v, ffi::Buffer<ffi::S32> lengths, ffi::Buffer<ffi::F32> sinks,
                         float scale, int64_t offset, int64_t left, int64_t right, bool heads_first,
                         ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> row_max,
                         ffi::ResultBuffer<ffi::F32> row_sum) {
  if (!consistent(q, k, v, lengths, sinks, heads_first))
    return ffi::Error::InvalidArgument("twin_attention_decode_fwd: inconsistent shapes");
  const Problem pb = problem(q, k, v, lengths, sinks, scale, offset, left, right, heads_first);
  const DecodeArgs args{q.typed_data(), k.typed_data(), v.typed_data(), out->typed_data(), row_max->typed_data(),
                        row_sum->typed_data()};
  parallel_for(pool, pb.batch * pb.kv_heads, [&](int64_t u) { decode_unit(pb, args, u / pb.kv_heads, u % pb.kv_heads); });
  return ffi::Error::Success();
}

}  // namespace twin
