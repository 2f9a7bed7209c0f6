// The online softmax of the forward, once for every forward the kernel has (forward.h's
// blocks of query rows, decode.h's few rows): a tile's scores turned into weights with
// each row's running maximum and sum, and a finished row.  The order of operations is
// jax_attention._online_softmax's: the maximum taken over the unscaled scores, weights
// exp((s - max) * scale), what was summed rescaled when the maximum grows, and a row
// that has seen nothing giving zeros.
#pragma once
#include <algorithm>
#include <cstdint>

#include "attention.h"
#include "vec.h"

namespace twin {

// Scores s (rows x cols, hidden keys -inf) become the tile's weights in place; each row's
// maximum m, sum l and weighted values acc (rows x Dvp, not yet including this tile) are
// brought to the new maximum.  The caller then adds the tile's weights times its values
// to acc.
inline void softmax_tile(int64_t rows, int64_t cols, float scale, float* s, float* m, float* l, float* acc,
                         int64_t Dvp) {
  const float neg_inf = -__builtin_inff();
  for (int64_t i = 0; i < rows; ++i) {
    float* row = s + i * cols;
    vf mx = splat(neg_inf);
    for (int64_t c = 0; c < cols; c += kLanes) {
      const vf x = load(row + c);
      mx = x > mx ? x : mx;
    }
    float tile_max = mx[0];
    for (int j = 1; j < kLanes; ++j) tile_max = std::max(tile_max, mx[j]);
    const float m_new = std::max(m[i], tile_max);
    if (m_new == neg_inf) {  // nothing seen yet: zero weights
      std::fill(row, row + cols, 0.0f);
      continue;
    }
    vf sum = vf{};
    for (int64_t c = 0; c < cols; c += kLanes) {
      const vf p = exp_nonpositive((load(row + c) - m_new) * scale);
      store(row + c, p);
      sum += p;
    }
    const float tile_sum = sum_lanes(sum);
    if (m[i] != m_new) {  // the maximum grew: rescale what was summed so far
      const float rescale = m[i] == neg_inf ? 0.0f : exp_nonpositive(splat((m[i] - m_new) * scale))[0];
      l[i] *= rescale;
      float* o = acc + i * Dvp;
      for (int64_t c = 0; c < Dvp; c += kLanes) store(o + c, load(o + c) * rescale);
      m[i] = m_new;
    }
    l[i] += tile_sum;
  }
}

// A finished row of query head h: its output O (Dv floats) from the weighted values acc,
// its maximum m and sum l, with the head's sink joined to the normaliser where there are
// sinks (join_sink), and the statistics that the backward reads (row_max, row_sum).  A
// row that saw nothing stays zeros, with maximum and normaliser 0.
inline void finish_row(const Problem& pb, int64_t h, const float* acc, float m, float l, float* O, float* row_max,
                       float* row_sum) {
  const int64_t Dv = pb.v_width;
  *row_max = l == 0.0f ? 0.0f : m;
  if (pb.sinks != nullptr) {
    const SinkJoin join = l == 0.0f ? SinkJoin{0.0f, 1.0f, 0.0f} : join_sink(m, l, pb.scale, pb.sinks[h]);
    const float factor = join.keys / join.denominator;
    for (int64_t c = 0; c < Dv; ++c) O[c] = acc[c] * factor;
    *row_sum = join.normaliser;
    return;
  }
  for (int64_t c = 0; c < Dv; ++c) O[c] = l == 0.0f ? 0.0f : acc[c] / l;
  *row_sum = l;
}

}  // namespace twin
