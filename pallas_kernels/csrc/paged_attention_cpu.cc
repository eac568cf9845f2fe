// Paged attention for XLA on CPU (an XLA FFI custom call): the "cpu" attention backend.
//
// The pure-jnp path (`reference.paged_attention_xla_flat`) gathers every listed block's K and V
// into a new buffer and then runs thousands of tiny [G, H] x [H, S] dots; on CPU both cost far
// more than reading the blocks once. This kernel walks each sequence's cached blocks in place in
// the pool, then its new tokens (causal), with the online softmax of flash attention: for a
// (sequence, kv head, query chunk) task it loads one tile of 16 keys and values and applies it to
// all of the chunk's queries of that head (G query heads per token), rescaling each query's
// running sum once per tile.
//
// The inner loops come in two forms. A few query rows (a decode's G heads) score a tile one key
// at a time, a dot product along H each. Eight or more rows (a prompt chunk's tokens past the
// tile's diagonal) share one transposed copy of the tile, [H, 16], and accumulate each row's 16
// scores as one vector, with no sum across vector lanes. Head sizes 64 and 128 are compiled as
// constants, so that a group of rows' output accumulators stay in registers across a tile.
// Measured per layer with SmolLM2's heads (9 query, 3 kv, H = 64) on a 2-core AVX-512 CPU,
// against the one-form kernel before it: a 512-token prompt 6.5 -> 3.4 ms, a 512-token chunk
// over 1024 cached tokens 30 -> 15 ms, 64 decodes over 600 cached tokens 3.4-3.9 -> 2.8-3.2 ms.
//
// Two options of Gemma 2 / Mistral (as in Hugging Face transformers): a logit soft cap, each
// score s = (q . k) * scale becoming soft_cap * tanh(s / soft_cap) before the softmax, and a
// sliding window of W tokens, the query at position p seeing only keys at positions
// p - W < j <= p. Positions count from each sequence's first cached token: its cached tokens
// are at 0..c-1 (c = the sum of its entries' context_lens) and its new token i at c + i. A
// query's visible keys in any run of consecutive positions (a cached block, a tile of new
// tokens) are one interval, so nothing is masked: the rows that see all of a run go as one
// group, the rows at the causal diagonal or the window's edge one by one over their part of
// it, and the rows that see none of it, like the blocks before a task's window, are skipped.
// With neither option the code is the same as without them: the cap is a template flag
// resolved once per block, and with no window every row sees every cached block whole.
//
// The queries are one flat token axis: sequence b's new tokens are q[query_start_loc[b] ..
// query_start_loc[b] + query_lens[b]), so a step can pack decodes and prompt chunks of any
// lengths without padding each to the longest (vLLM's `query_start_loc`). A padded [B, Q] batch
// is the case query_start_loc = b * Q.
//
// Built with -ffast-math so that the exp loop vectorizes (glibc's libmvec); no value here is
// infinite or NaN for finite inputs (the running max starts at -1e30, not -inf).
//
// Axis letters follow `pallas_kernels/reference.py`. Inputs:
//   q                f32[T, N, H]       queries, not pre-scaled
//   k_new, v_new     f32[T, K, H]       the new tokens' keys and values
//   kv_cache         f32[L, 2, K, P, S, H] the whole pool (0 = keys, 1 = values)
//   layer            s32[]              which layer of the pool to read
//   query_start_loc  s32[B + 1]         first token of each sequence, non-decreasing, <= T
//   query_lens       s32[B]             new tokens of each sequence (0 for padding)
//   context_blocks   s32[NB]            the sequences' cached blocks, one after another, each
//                                       sequence's in logical order
//   context_rows     s32[NB]            sequence of each entry, non-decreasing; >= B for padding
//   context_lens     s32[NB]            cached tokens in each entry (<= S)
//   scale (attr)     f32                softmax scale
//   sliding_window (attr) s32           window W in tokens (>= 1), 0 for none
//   soft_cap (attr)  f32                logit soft cap (> 0), 0 for none
//   invariant (attr) s32                1: batch-invariant order of operations (RunTask)
// Output:
//   out              f32[T, N, H]       attention of each new token over its sequence's cached
//                                       tokens and its own new tokens up to itself (its last W
//                                       positions with a window); 0 for tokens of no sequence

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "xla/ffi/api/ffi.h"
#include "cpu_tasks.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kMaskValue = -1e30f;  // matches reference._MASK_VALUE
constexpr int64_t kTile = 16;         // keys per online-softmax update (new tokens)
constexpr int64_t kQueryChunk = 32;   // new tokens per task
constexpr int64_t kPrefetchBlocks = 2;  // cached blocks read ahead

struct Shapes {
  int64_t T, N, H, K, G, P, S, L, B, NB;
};

struct Args {
  Shapes d;
  const float* q;
  const float* k_new;
  const float* v_new;
  const float* k_pages;  // this layer's keys:   [K, P, S, H] (a float32 pool)
  const float* v_pages;  // this layer's values: [K, P, S, H]
  // An 8-bit pool (PagedAttentionQuantized): this layer's codes [K, P, S, H], one byte each
  // (int8, or float8_e4m3fn bit patterns with `fp8`), and their scales [K, P, S] (one per
  // token and head).
  const uint8_t* k_codes = nullptr;
  const uint8_t* v_codes = nullptr;
  const float* k_scales = nullptr;
  const float* v_scales = nullptr;
  bool fp8 = false;
  const int32_t* query_start_loc;
  const int32_t* query_lens;
  const int32_t* blocks;
  const int32_t* lens;
  const int64_t* row_start;  // [B + 1] each sequence's first entry in the flat block list
  float scale;
  int64_t window;  // sliding window in tokens, 0 for none
  float soft_cap;  // 0 for none
  bool invariant;  // batch-invariant order of operations (see RunInvariant)
  float* out;
};

struct Task {
  int64_t b, k, i0, i1;  // sequence, kv head, new tokens [i0, i1) of the sequence
};

// Online-softmax state of one query vector.
struct Row {
  const float* q;  // [H], pre-scaled
  float* acc;      // [H] unnormalized output
  float m, l;      // running max and sum
};

// Scores of keys t = 0..n-1 (rows `stride` floats apart) for NR query rows at once, a dot
// product per (row, key) along H, so each key row is loaded once for all of them.
// s: NR score rows, `ld` floats apart. The cheaper form when there are few rows (decode).
template <int NR, int kH>
inline void ScoresByKey(const Row* r, const float* kb, int64_t stride, int64_t n,
                        int64_t head_dim, float* s, int64_t ld) {
  const int64_t H = kH > 0 ? kH : head_dim;
  const float* q0 = r[0].q;
  const float* q1 = r[NR > 1 ? 1 : 0].q;
  const float* q2 = r[NR > 2 ? 2 : 0].q;
  const float* q3 = r[NR > 3 ? 3 : 0].q;
  for (int64_t t = 0; t < n; ++t) {
    const float* kt = kb + t * stride;
    float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
    for (int64_t h = 0; h < H; ++h) {
      const float k = kt[h];
      a0 += q0[h] * k;
      if constexpr (NR > 1) a1 += q1[h] * k;
      if constexpr (NR > 2) a2 += q2[h] * k;
      if constexpr (NR > 3) a3 += q3[h] * k;
    }
    s[t] = a0;
    if constexpr (NR > 1) s[ld + t] = a1;
    if constexpr (NR > 2) s[2 * ld + t] = a2;
    if constexpr (NR > 3) s[3 * ld + t] = a3;
  }
}

// The same scores from a tile of keys transposed to kt: [kH, kTile] (key t of the tile in lane
// t): each row's kTile scores accumulate in one vector over h, with no sum across lanes. Pays
// off when the transpose is shared by many rows (prompt chunks).
template <int NR, int kH>
inline void ScoresByDim(const Row* r, const float* kt, int64_t n, int64_t head_dim, float* s,
                        int64_t ld) {
  const int64_t H = kH > 0 ? kH : head_dim;
  float a[NR][kTile] = {};
  for (int64_t h = 0; h < H; ++h) {
    const float* kh = kt + h * kTile;
    for (int j = 0; j < NR; ++j) {
      const float qh = r[j].q[h];
#pragma omp simd
      for (int64_t t = 0; t < kTile; ++t) a[j][t] += qh * kh[t];
    }
  }
  for (int j = 0; j < NR; ++j) std::copy_n(a[j], n, s + j * ld);
}

// Adds keys t = 0..n-1, with scores s (NR rows, `ld` apart) and values at vb (rows `stride`
// floats apart), to NR query rows: the online-softmax update. With a compiled head size each
// value row is loaded once for the NR rows; otherwise once per row.
// kCap: the scores first become cap * tanh(score / cap) (Gemma 2's logit soft cap).
template <int NR, int kH, bool kCap>
inline void Apply(Row* r, const float* vb, int64_t stride, int64_t n, int64_t head_dim,
                  float* s, int64_t ld, float cap) {
  const int64_t H = kH > 0 ? kH : head_dim;
  for (int j = 0; j < NR; ++j) {
    Row& row = r[j];
    float* p = s + j * ld;
    if constexpr (kCap) {
      const float inv_cap = 1.f / cap;
#pragma omp simd
      for (int64_t t = 0; t < n; ++t) p[t] = cap * std::tanh(p[t] * inv_cap);
    }
    float tile_max = kMaskValue;
    for (int64_t t = 0; t < n; ++t) tile_max = std::max(tile_max, p[t]);
    if (tile_max > row.m) {  // rescale what was accumulated against the old max
      const float c = std::exp(row.m - tile_max);
      row.l *= c;
#pragma omp simd
      for (int64_t h = 0; h < H; ++h) row.acc[h] *= c;
      row.m = tile_max;
    }
    const float m = row.m;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      p[t] = std::exp(p[t] - m);
      sum += p[t];
    }
    row.l += sum;
    if constexpr (kH == 0) {
      float* acc = row.acc;
      for (int64_t t = 0; t < n; ++t) {
        const float pt = p[t];
        const float* vt = vb + t * stride;
#pragma omp simd
        for (int64_t h = 0; h < H; ++h) acc[h] += pt * vt[h];
      }
    }
  }
  if constexpr (kH > 0) {  // all NR accumulators in registers across the tile, each value row
    float acc[NR][kH];      // loaded once for all of them
    for (int j = 0; j < NR; ++j) std::copy_n(r[j].acc, kH, acc[j]);
    for (int64_t t = 0; t < n; ++t) {
      const float* vt = vb + t * stride;
      for (int j = 0; j < NR; ++j) {
        const float pt = s[j * ld + t];
#pragma omp simd
        for (int64_t h = 0; h < kH; ++h) acc[j][h] += pt * vt[h];
      }
    }
    for (int j = 0; j < NR; ++j) std::copy_n(acc[j], kH, r[j].acc);
  }
}

template <int NR, int kH, bool kCap>
inline void UpdateByKey(Row* r, const float* kb, const float* vb, int64_t stride, int64_t n,
                        int64_t H, float* s, int64_t ld, float cap) {
  ScoresByKey<NR, kH>(r, kb, stride, n, H, s, ld);
  Apply<NR, kH, kCap>(r, vb, stride, n, H, s, ld, cap);
}

constexpr int64_t kRowsByDim = 8;  // from this many rows, scores go through a transposed tile

// Adds keys/values t = 0..n-1 (rows `stride` floats apart) to `num_rows` query rows, four at a
// time. kH: the head size when known at compile time (64, 128), else 0. kCap: soft-capped
// scores (cap).
// by_dim: always score through the transposed tile, however few the rows: then a (row, key)
// score is the same sum in the same order whatever rows share the tile (batch invariance).
template <int kH, bool kCap>
void UpdateH(Row* r, int64_t num_rows, const float* kb, const float* vb, int64_t stride,
             int64_t n, int64_t H, float* s, int64_t ld, float cap, bool by_dim) {
  if ((kH > 0 && num_rows >= kRowsByDim) || by_dim) {
    float kt_fixed[kH > 0 ? kH * kTile : 1];
    thread_local std::vector<float> kt_any;  // a head size not compiled in
    float* kt = kt_fixed;
    if constexpr (kH == 0) {
      kt_any.resize(H * kTile);
      kt = kt_any.data();
    }
    for (int64_t t0 = 0; t0 < n; t0 += kTile) {
      const int64_t m = std::min(kTile, n - t0);
      if (m < kTile) std::fill_n(kt, H * kTile, 0.f);  // lanes past m: scored, never read
      for (int64_t t = 0; t < m; ++t)
        for (int64_t h = 0; h < H; ++h) kt[h * kTile + t] = kb[(t0 + t) * stride + h];
      const float* vt = vb + t0 * stride;
      Row* g = r;
      int64_t left = num_rows;
      // Four rows at a time share loads; forced (batch invariance), one row at a time: with
      // -ffast-math the compiler may order a sum differently in each instantiation.
      for (; left >= 4 && !by_dim; g += 4, left -= 4) {
        ScoresByDim<4, kH>(g, kt, m, H, s, ld);
        Apply<4, kH, kCap>(g, vt, stride, m, H, s, ld, cap);
      }
      for (; left > 0; ++g, --left) {
        ScoresByDim<1, kH>(g, kt, m, H, s, ld);
        Apply<1, kH, kCap>(g, vt, stride, m, H, s, ld, cap);
      }
    }
    return;
  }
  for (; num_rows >= 4; r += 4, num_rows -= 4)
    UpdateByKey<4, kH, kCap>(r, kb, vb, stride, n, H, s, ld, cap);
  if (num_rows == 3) UpdateByKey<3, kH, kCap>(r, kb, vb, stride, n, H, s, ld, cap);
  if (num_rows == 2) UpdateByKey<2, kH, kCap>(r, kb, vb, stride, n, H, s, ld, cap);
  if (num_rows == 1) UpdateByKey<1, kH, kCap>(r, kb, vb, stride, n, H, s, ld, cap);
}

// cap: the logit soft cap, 0 for none. by_dim: see UpdateH.
inline void Update(Row* r, int64_t num_rows, const float* kb, const float* vb, int64_t stride,
                   int64_t n, int64_t H, float* s, int64_t ld, float cap, bool by_dim) {
  if (cap > 0.f) {
    if (H == 64) return UpdateH<64, true>(r, num_rows, kb, vb, stride, n, H, s, ld, cap, by_dim);
    if (H == 128)
      return UpdateH<128, true>(r, num_rows, kb, vb, stride, n, H, s, ld, cap, by_dim);
    return UpdateH<0, true>(r, num_rows, kb, vb, stride, n, H, s, ld, cap, by_dim);
  }
  if (H == 64) return UpdateH<64, false>(r, num_rows, kb, vb, stride, n, H, s, ld, cap, by_dim);
  if (H == 128) return UpdateH<128, false>(r, num_rows, kb, vb, stride, n, H, s, ld, cap, by_dim);
  UpdateH<0, false>(r, num_rows, kb, vb, stride, n, H, s, ld, cap, by_dim);
}

void RunTask(const Args& a, const Task& task, std::vector<float>& scratch,
             std::vector<Row>& rows) {
  const Shapes& d = a.d;
  const int64_t H = d.H, K = d.K, G = d.G, k = task.k;
  const int64_t first = a.query_start_loc[task.b];  // token index of the sequence's new token 0
  const int64_t R = (task.i1 - task.i0) * G;        // query vectors: r = (i - i0) * G + g

  const int64_t ld = std::max(d.S, kTile);  // score row stride
  scratch.assign(2 * R * H + 4 * ld, 0.f);
  float* qs = scratch.data();
  float* s = qs + 2 * R * H;
  rows.resize(R);
  for (int64_t i = task.i0; i < task.i1; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t r = (i - task.i0) * G + g;
      const float* src = a.q + ((first + i) * d.N + k * G + g) * H;
      for (int64_t h = 0; h < H; ++h) qs[r * H + h] = src[h] * a.scale;
      rows[r] = Row{qs + r * H, qs + (R + r) * H, kMaskValue, 0.f};
    }

  const int64_t W = a.window;
  const float cap = a.soft_cap;
  const int64_t e0 = a.row_start[task.b], e1 = a.row_start[task.b + 1];
  auto len_of = [&](int64_t e) { return std::clamp<int64_t>(a.lens[e], 0, d.S); };
  int64_t c = 0;  // cached tokens: new token i is at position c + i
  for (int64_t e = e0; e < e1; ++e) c += len_of(e);

  // Adds the keys at positions [p0, p0 + n) (rows `stride` floats apart from kb, vb) to each
  // row that sees any of them; query i (position c + i) sees (c + i - W, c + i], or 0..c + i
  // with no window. Those visible keys are an interval of the span: rows [f0, f1) see all of
  // it and go as one group; rows before f0 (the causal diagonal) and after f1 (the window's
  // edge) see part of it, token by token (G heads each); rows that see none are skipped.
  auto span = [&](int64_t p0, int64_t n, const float* kb, const float* vb, int64_t stride) {
    const int64_t f0 = std::clamp(p0 + n - 1 - c, task.i0, task.i1);
    const int64_t f1 = W > 0 ? std::clamp(p0 + W - c, f0, task.i1) : task.i1;
    auto part = [&](int64_t i) {  // row i over its visible keys [lo, hi)
      const int64_t lo = W > 0 ? std::max(p0, c + i - W + 1) : p0;
      const int64_t hi = std::min(p0 + n, c + i + 1);
      if (hi > lo)
        Update(&rows[(i - task.i0) * G], G, kb + (lo - p0) * stride, vb + (lo - p0) * stride,
               stride, hi - lo, H, s, ld, cap, a.invariant);
      return hi > lo;
    };
    for (int64_t i = std::max(task.i0, p0 - c); i < f0; ++i) part(i);  // before: sees none
    if (f1 > f0)
      Update(&rows[(f0 - task.i0) * G], (f1 - f0) * G, kb, vb, stride, n, H, s, ld, cap,
             a.invariant);
    for (int64_t i = f1; i < task.i1 && part(i); ++i) {}  // later rows see less of it
  };

  // The cached context: with no window every query sees all of it; with one, the blocks
  // before the task's first row's window are skipped. The blocks lie anywhere in the pool, so
  // the hardware prefetcher cannot run ahead from one to the next: the keys and values of the
  // block kPrefetchBlocks ahead are prefetched while this one is computed.
  int64_t e_first = e0, pos = 0;  // first block any row sees, and its first token's position
  if (W > 0)
    for (const int64_t lo = c + task.i0 - W + 1; e_first < e1 && pos + len_of(e_first) <= lo;)
      pos += len_of(e_first++);
  // Block e's keys (or values) as float32 rows, H apart: in place in a float32 pool; from an
  // 8-bit pool, decoded (code value times the row's scale) into `buf`. A float8_e4m3fn code
  // (sign, 4 exponent bits biased by 7, 3 mantissa bits) becomes a float32 by moving its
  // exponent and mantissa bits up to float32's places, which leaves the exponent biased by 7
  // instead of 127: times 2^120 it is the value, subnormal codes included.
  const bool quantized = a.k_codes != nullptr;
  thread_local std::vector<float> kdec, vdec;
  const int64_t block_elems = d.S * H;
  auto decode = [&](int64_t e, bool values, int64_t row0, int64_t n, float* buf) {
    const int64_t base = (k * d.P + a.blocks[e]) * d.S;
    const uint8_t* codes = (values ? a.v_codes : a.k_codes) + (base + row0) * H;
    const float* scales = (values ? a.v_scales : a.k_scales) + base + row0;
    for (int64_t t = 0; t < n; ++t) {
      const float sc = scales[t];
      const uint8_t* c = codes + t * H;
      float* o = buf + t * H;
      if (a.fp8) {
#pragma omp simd
        for (int64_t h = 0; h < H; ++h) {
          const uint32_t b = c[h];
          const uint32_t bits = ((b & 0x80u) << 24) | ((b & 0x7Fu) << 20);
          float f;
          std::memcpy(&f, &bits, sizeof f);
          o[h] = f * 0x1p120f * sc;
        }
      } else {
#pragma omp simd
        for (int64_t h = 0; h < H; ++h) o[h] = static_cast<float>(static_cast<int8_t>(c[h])) * sc;
      }
    }
    return buf;
  };
  auto block_of = [&](int64_t e, bool values) -> const float* {
    if (!quantized)
      return (values ? a.v_pages : a.k_pages) + (k * d.P + a.blocks[e]) * block_elems;
    std::vector<float>& buf = values ? vdec : kdec;
    buf.resize(block_elems);
    return decode(e, values, 0, len_of(e), buf.data());
  };
  auto prefetch = [&](int64_t e) {
    if (e >= e1) return;
    const int64_t offset = (k * d.P + a.blocks[e]) * block_elems;
    const bool q = quantized;
    const int64_t bytes = len_of(e) * H * (q ? 1 : sizeof(float));
    const char* kb = q ? reinterpret_cast<const char*>(a.k_codes + offset)
                       : reinterpret_cast<const char*>(a.k_pages + offset);
    const char* vb = q ? reinterpret_cast<const char*>(a.v_codes + offset)
                       : reinterpret_cast<const char*>(a.v_pages + offset);
    for (int64_t off = 0; off < bytes; off += 64) {
      __builtin_prefetch(kb + off, 0, 2);
      __builtin_prefetch(vb + off, 0, 2);
    }
  };
  if (a.invariant) {
    // Batch-invariant order: every key position 0 .. c + i1 - 1 in tiles aligned at multiples
    // of kTile, whether its key lies in the pool (cached) or among the step's new tokens, each
    // tile gathered into one buffer and scored through the transposed tile. A query then sees
    // the same tiles, each over the same keys, with the same sums, however its sequence is
    // split into cached and new tokens, chunked or batched.
    thread_local std::vector<float> kbuf, vbuf;
    kbuf.resize(kTile * H);
    vbuf.resize(kTile * H);
    const int64_t end = c + task.i1;
    int64_t t0 = W > 0 ? std::max<int64_t>(0, c + task.i0 - W + 1) / kTile * kTile : 0;
    int64_t e = e0, e_pos = 0;  // the cached entry holding position p: [e_pos, e_pos + len)
    for (; t0 < end; t0 += kTile) {
      const int64_t n = std::min(kTile, end - t0);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t p = t0 + t;
        const float *kp, *vp;
        if (p < c) {
          while (e_pos + len_of(e) <= p) e_pos += len_of(e++);
          if (quantized) {  // decoded straight into the tile
            decode(e, false, p - e_pos, 1, kbuf.data() + t * H);
            decode(e, true, p - e_pos, 1, vbuf.data() + t * H);
            continue;
          }
          kp = block_of(e, false) + (p - e_pos) * H;
          vp = block_of(e, true) + (p - e_pos) * H;
        } else {
          kp = a.k_new + ((first + p - c) * K + k) * H;
          vp = a.v_new + ((first + p - c) * K + k) * H;
        }
        std::copy_n(kp, H, kbuf.data() + t * H);
        std::copy_n(vp, H, vbuf.data() + t * H);
      }
      span(t0, n, kbuf.data(), vbuf.data(), H);
    }
  } else {
    for (int64_t e = e_first; e < e_first + kPrefetchBlocks; ++e) prefetch(e);
    for (int64_t e = e_first; e < e1; ++e) {
      prefetch(e + kPrefetchBlocks);
      const int64_t n = len_of(e);
      if (n == 0) continue;
      const float* kb = block_of(e, false);
      const float* vb = block_of(e, true);
      if (W == 0)
        Update(rows.data(), R, kb, vb, H, n, H, s, ld, cap, false);
      else
        span(pos, n, kb, vb, H);
      pos += n;
    }

    // The new tokens, causal, a tile of kTile at a time: new token i sees new tokens 0..i (or
    // i - W + 1..i). Tokens on a tile's diagonal see part of it; the tokens past it see all of
    // it (with a window, up to the window's edge) and go as one group of rows.
    for (int64_t j0 = W > 0 ? std::max<int64_t>(0, task.i0 - W + 1) : 0; j0 < task.i1;
         j0 += kTile) {
      const int64_t n = std::min(kTile, task.i1 - j0);
      span(c + j0, n, a.k_new + ((first + j0) * K + k) * H, a.v_new + ((first + j0) * K + k) * H,
           K * H);
    }
  }  // not invariant

  for (int64_t i = task.i0; i < task.i1; ++i)
    for (int64_t g = 0; g < G; ++g) {
      const Row& r = rows[(i - task.i0) * G + g];
      float* o = a.out + ((first + i) * d.N + k * G + g) * H;
      const float inv = 1.f / r.l;  // l >= 1: a token always sees itself (W >= 1)
      for (int64_t h = 0; h < H; ++h) o[h] = r.acc[h] * inv;
    }
}

// Work shared between the calling thread and the helpers it schedules on XLA's thread pool.
// Tasks are handed out through an atomic counter, so a helper that starts late finds no work
// and returns; the caller waits until every task is done.
struct Work {
  Args args;
  std::vector<int64_t> row_start;
  std::vector<Task> tasks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Run() {
    std::vector<float> scratch;
    std::vector<Row> rows;
    const int64_t n = static_cast<int64_t>(tasks.size());
    for (int64_t t; (t = next.fetch_add(1)) < n;) {
      RunTask(args, tasks[t], scratch, rows);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// The checks and the work shared by both pools. `pool_dims` is the pool's [L, 2, K, P, S, H];
// `a` holds the pool's pointers for layer `layer`, the rest is filled here.
ffi::Error Attend(ffi::ThreadPool& pool, ffi::Buffer<ffi::F32>& q, ffi::Buffer<ffi::F32>& k_new,
                  ffi::Buffer<ffi::F32>& v_new, ffi::Span<const int64_t> cd, int64_t l_idx,
                  ffi::Buffer<ffi::S32>& query_start_loc, ffi::Buffer<ffi::S32>& query_lens,
                  ffi::Buffer<ffi::S32>& context_blocks, ffi::Buffer<ffi::S32>& context_rows,
                  ffi::Buffer<ffi::S32>& context_lens, float scale, int32_t sliding_window,
                  float soft_cap, int32_t invariant, ffi::ResultBuffer<ffi::F32>& out,
                  Args a) {
  auto qd = q.dimensions();
  auto kd = k_new.dimensions();
  if (qd.size() != 3 || kd.size() != 3 || cd.size() != 6 || cd[1] != 2 || kd[0] != qd[0] ||
      kd[1] != cd[2] || kd[2] != qd[2] || cd[5] != qd[2] || qd[1] % cd[2] != 0)
    return ffi::Error::InvalidArgument(
        "paged_attention_cpu: q must be [T, N, H], k_new and v_new [T, K, H] and kv_cache "
        "[L, 2, K, P, S, H] with N % K == 0");
  auto w = std::make_shared<Work>();
  const int64_t B = query_lens.element_count();
  const Shapes d{qd[0], qd[1], qd[2], cd[2], qd[1] / cd[2], cd[3], cd[4], cd[0], B,
                 static_cast<int64_t>(context_blocks.element_count())};
  if (static_cast<int64_t>(query_start_loc.element_count()) != B + 1)
    return ffi::Error::InvalidArgument("query_start_loc must have one more entry than query_lens");
  if (sliding_window < 0 || !(soft_cap >= 0.f))
    return ffi::Error::InvalidArgument("sliding_window and soft_cap must be >= 0 (0: none)");
  if (l_idx < 0 || l_idx >= d.L) return ffi::Error::InvalidArgument("layer out of range");
  const int32_t* qsl = query_start_loc.typed_data();
  const int32_t* qlens = query_lens.typed_data();
  for (int64_t b = 0; b < B; ++b)
    if (qlens[b] < 0 || qsl[b] < 0 || qsl[b] + qlens[b] > qsl[b + 1] || qsl[b + 1] > d.T)
      return ffi::Error::InvalidArgument("query_start_loc/query_lens out of range");

  // Each sequence's entries are contiguous (rows non-decreasing, padding entries last with
  // row >= B); row_start[B] is the first padding entry.
  const int32_t* rows = context_rows.typed_data();
  const int32_t* blocks = context_blocks.typed_data();
  w->row_start.assign(B + 1, d.NB);
  for (int64_t e = d.NB - 1; e >= 0; --e)
    w->row_start[std::clamp<int64_t>(rows[e], 0, B)] = e;
  for (int64_t b = B - 1; b >= 0; --b)
    w->row_start[b] = std::min(w->row_start[b], w->row_start[b + 1]);
  for (int64_t e = 0; e < d.NB; ++e)
    if (rows[e] >= 0 && rows[e] < B && (blocks[e] < 0 || blocks[e] >= d.P))
      return ffi::Error::InvalidArgument("context block id out of range");

  a.d = d;
  a.q = q.typed_data();
  a.k_new = k_new.typed_data();
  a.v_new = v_new.typed_data();
  a.query_start_loc = qsl;
  a.query_lens = qlens;
  a.blocks = blocks;
  a.lens = context_lens.typed_data();
  a.row_start = w->row_start.data();
  a.scale = scale;
  a.window = sliding_window;
  a.soft_cap = soft_cap;
  a.invariant = invariant != 0;
  a.out = out->typed_data();
  w->args = a;
  std::fill(out->typed_data(), out->typed_data() + d.T * d.N * d.H, 0.f);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t i0 = 0; i0 < qlens[b]; i0 += kQueryChunk)
      for (int64_t k = 0; k < d.K; ++k)
        w->tasks.push_back(Task{b, k, i0, std::min<int64_t>(qlens[b], i0 + kQueryChunk)});

  const int64_t num_tasks = static_cast<int64_t>(w->tasks.size());
  jaxpaged::RunTasks(pool, w, num_tasks);
  return ffi::Error::Success();
}

// The pool comes back as a result aliased to the input (input_output_aliases), so that the
// layers' calls form one chain of uses of the pool buffer and XLA never copies it to order
// them against the step's final K/V write. The kernel only reads the pool; the copy runs only
// where XLA gave the result its own buffer.
void PassThrough(const void* in, void* out, size_t bytes) {
  if (out != in) std::copy_n(static_cast<const char*>(in), bytes, static_cast<char*>(out));
}

ffi::Error PagedAttentionImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q,
                              ffi::Buffer<ffi::F32> k_new, ffi::Buffer<ffi::F32> v_new,
                              ffi::Buffer<ffi::F32> kv_cache, ffi::Buffer<ffi::S32> layer,
                              ffi::Buffer<ffi::S32> query_start_loc,
                              ffi::Buffer<ffi::S32> query_lens,
                              ffi::Buffer<ffi::S32> context_blocks,
                              ffi::Buffer<ffi::S32> context_rows,
                              ffi::Buffer<ffi::S32> context_lens, float scale,
                              int32_t sliding_window, float soft_cap, int32_t invariant,
                              ffi::ResultBuffer<ffi::F32> out,
                              ffi::ResultBuffer<ffi::F32> kv_cache_out) {
  PassThrough(kv_cache.untyped_data(), kv_cache_out->untyped_data(), kv_cache.size_bytes());
  auto cd = kv_cache.dimensions();
  const int64_t l_idx = layer.typed_data()[0];
  Args a{};
  if (cd.size() == 6 && l_idx >= 0 && l_idx < cd[0]) {
    const int64_t layer_size = 2 * cd[2] * cd[3] * cd[4] * cd[5];
    a.k_pages = kv_cache.typed_data() + l_idx * layer_size;
    a.v_pages = a.k_pages + layer_size / 2;
  }
  return Attend(pool, q, k_new, v_new, cd, l_idx, query_start_loc, query_lens, context_blocks,
                context_rows, context_lens, scale, sliding_window, soft_cap, invariant, out, a);
}

// The same over an 8-bit pool: codes [L, 2, K, P, S, H] (int8, or with `fp8` the bit
// patterns of float8_e4m3fn codes as uint8) and scales f32[L, 2, K, P, S].
ffi::Error PagedAttentionQuantizedImpl(
    ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_new,
    ffi::Buffer<ffi::F32> v_new, ffi::AnyBuffer codes, ffi::Buffer<ffi::F32> scales,
    ffi::Buffer<ffi::S32> layer,
    ffi::Buffer<ffi::S32> query_start_loc, ffi::Buffer<ffi::S32> query_lens,
    ffi::Buffer<ffi::S32> context_blocks, ffi::Buffer<ffi::S32> context_rows,
    ffi::Buffer<ffi::S32> context_lens, float scale, int32_t sliding_window, float soft_cap,
    int32_t invariant, int32_t fp8, ffi::ResultBuffer<ffi::F32> out,
    ffi::Result<ffi::AnyBuffer> codes_out,
    ffi::ResultBuffer<ffi::F32> scales_out) {
  PassThrough(codes.untyped_data(), codes_out->untyped_data(), codes.size_bytes());
  PassThrough(scales.untyped_data(), scales_out->untyped_data(), scales.size_bytes());
  auto cd = codes.dimensions();
  auto sd = scales.dimensions();
  if (ffi::ByteWidth(codes.element_type()) != 1 || cd.size() != 6 || sd.size() != 5 ||
      !std::equal(sd.begin(), sd.end(), cd.begin()))
    return ffi::Error::InvalidArgument(
        "paged_attention_cpu: an 8-bit pool must be codes [L, 2, K, P, S, H] of one byte and "
        "scales f32[L, 2, K, P, S]");
  const int64_t l_idx = layer.typed_data()[0];
  Args a{};
  if (l_idx >= 0 && l_idx < cd[0]) {
    const int64_t layer_tokens = 2 * cd[2] * cd[3] * cd[4];
    a.k_codes = static_cast<const uint8_t*>(codes.untyped_data()) + l_idx * layer_tokens * cd[5];
    a.v_codes = a.k_codes + layer_tokens / 2 * cd[5];
    a.k_scales = scales.typed_data() + l_idx * layer_tokens;
    a.v_scales = a.k_scales + layer_tokens / 2;
    a.fp8 = fp8 != 0;
  }
  return Attend(pool, q, k_new, v_new, cd, l_idx, query_start_loc, query_lens, context_blocks,
                context_rows, context_lens, scale, sliding_window, soft_cap, invariant, out, a);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedPagedAttention, PagedAttentionImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_new
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_new
                                  .Arg<ffi::Buffer<ffi::F32>>()  // kv_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // context_blocks
                                  .Arg<ffi::Buffer<ffi::S32>>()  // context_rows
                                  .Arg<ffi::Buffer<ffi::S32>>()  // context_lens
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("invariant")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // kv_cache, aliased
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedPagedAttentionQuantized, PagedAttentionQuantizedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // k_new
                                  .Arg<ffi::Buffer<ffi::F32>>()  // v_new
                                  .Arg<ffi::AnyBuffer>()         // codes
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scales
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // context_blocks
                                  .Arg<ffi::Buffer<ffi::S32>>()  // context_rows
                                  .Arg<ffi::Buffer<ffi::S32>>()  // context_lens
                                  .Attr<float>("scale")
                                  .Attr<int32_t>("sliding_window")
                                  .Attr<float>("soft_cap")
                                  .Attr<int32_t>("invariant")
                                  .Attr<int32_t>("fp8")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::AnyBuffer>()         // codes, aliased
                                  .Ret<ffi::Buffer<ffi::F32>>()  // scales, aliased
);
