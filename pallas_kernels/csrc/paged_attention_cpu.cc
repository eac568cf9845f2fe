// Paged attention over each row's cached blocks, for XLA on CPU (an XLA FFI custom call).
//
// The pure-jnp path (`reference.paged_attention_xla_flat`) gathers every listed block's K and V
// into a new buffer and then runs thousands of tiny [G, H] x [H, S] dots; on CPU both cost far
// more than reading the blocks once. This kernel walks each row's blocks in place in the pool:
// for a (row, kv head) pair it loads one block's K and V (S x H floats each) and applies them to
// all of the row's queries of that head (G query heads times the row's new tokens), with the
// online softmax of flash attention (one running max and sum per query, rescaled once per
// block). It covers only the cached context; the caller merges in the new tokens' attention with
// the returned log-sum-exp (the combine step of flash-decoding's split-K).
//
// Built with -ffast-math so that the exp loop vectorizes (glibc's libmvec); no value here is
// infinite or NaN for finite inputs (the running max starts at -1e30, not -inf).
//
// Axis letters follow `pallas_kernels/reference.py`. Inputs:
//   q               f32[B, Q, N, H]   queries, not pre-scaled
//   kv_cache        f32[L, 2, K, P, S, H] the whole pool (0 = keys, 1 = values)
//   layer           s32[]             which layer of the pool to read
//   context_blocks  s32[NB]           the rows' cached blocks, row by row, in logical order
//   context_rows    s32[NB]           row of each entry, non-decreasing; >= B for padding
//   context_lens    s32[NB]           cached tokens in each entry (<= S)
//   query_lens      s32[B]            new tokens per row; query slots past it are not computed
//   scale (attr)    f32               softmax scale
// Outputs:
//   out             f32[B, Q, N, H]   softmax(q k^T * scale) v over the cached tokens only
//   lse             f32[B, Q, N]      log of the softmax denominator (plus the max); -1e30 where
//                                     the row has no cached tokens or the slot is padding
//                                     (out is 0 there)

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kMaskValue = -1e30f;  // matches reference._MASK_VALUE

struct Shapes {
  int64_t B, Q, N, H, K, G, P, S, L, NB;
};

struct Args {
  Shapes d;
  const float* q;
  const float* k_pages;  // this layer's keys:   [K, P, S, H]
  const float* v_pages;  // this layer's values: [K, P, S, H]
  const int32_t* blocks;
  const int32_t* lens;
  const int32_t* query_lens;
  const int64_t* row_start;  // [B + 1] each row's first entry in the flat list
  float scale;
  float* out;
  float* lse;
};

inline float Dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// One (row b, kv head k) pair: all G * query_lens[b] queries of that head over the row's blocks.
void AttendRowHead(const Args& a, int64_t b, int64_t k, std::vector<float>& scratch) {
  const Shapes& d = a.d;
  const int64_t nq = std::min<int64_t>(a.query_lens[b], d.Q);
  const int64_t R = nq * d.G;  // query vectors: r = i * G + g
  const int64_t H = d.H, S = d.S;

  // Layout of the scratch space: scaled queries [R, H], accumulators [R, H], max [R], sum [R],
  // scores [S].
  scratch.assign(2 * R * H + 2 * R + S, 0.f);
  float* qs = scratch.data();
  float* acc = qs + R * H;
  float* m = acc + R * H;
  float* l = m + R;
  float* s = l + R;
  for (int64_t i = 0; i < nq; ++i)
    for (int64_t g = 0; g < d.G; ++g) {
      const float* src = a.q + ((b * d.Q + i) * d.N + k * d.G + g) * H;
      float* dst = qs + (i * d.G + g) * H;
      for (int64_t h = 0; h < H; ++h) dst[h] = src[h] * a.scale;
    }
  std::fill(m, m + R, kMaskValue);

  for (int64_t e = a.row_start[b]; e < a.row_start[b + 1]; ++e) {
    const int64_t n = std::clamp<int64_t>(a.lens[e], 0, S);
    if (n == 0) continue;
    const float* kb = a.k_pages + (k * d.P + a.blocks[e]) * S * H;
    const float* vb = a.v_pages + (k * d.P + a.blocks[e]) * S * H;
    for (int64_t r = 0; r < R; ++r) {
      const float* qr = qs + r * H;
      float block_max = kMaskValue;
      for (int64_t t = 0; t < n; ++t) {
        s[t] = Dot(qr, kb + t * H, H);
        block_max = std::max(block_max, s[t]);
      }
      float* ar = acc + r * H;
      if (block_max > m[r]) {  // rescale what was accumulated against the old max
        const float c = std::exp(m[r] - block_max);
        l[r] *= c;
#pragma omp simd
        for (int64_t h = 0; h < H; ++h) ar[h] *= c;
        m[r] = block_max;
      }
      const float mr = m[r];
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < n; ++t) {
        s[t] = std::exp(s[t] - mr);
        sum += s[t];
      }
      l[r] += sum;
      for (int64_t t = 0; t < n; ++t) {
        const float p = s[t];
        const float* vt = vb + t * H;
#pragma omp simd
        for (int64_t h = 0; h < H; ++h) ar[h] += p * vt[h];
      }
    }
  }

  for (int64_t i = 0; i < d.Q; ++i)
    for (int64_t g = 0; g < d.G; ++g) {
      const int64_t r = i * d.G + g;
      const int64_t n_idx = (b * d.Q + i) * d.N + k * d.G + g;
      float* o = a.out + n_idx * H;
      if (i < nq && l[r] > 0.f) {
        const float inv = 1.f / l[r];
        for (int64_t h = 0; h < H; ++h) o[h] = acc[r * H + h] * inv;
        a.lse[n_idx] = m[r] + std::log(l[r]);
      } else {
        std::fill(o, o + H, 0.f);
        a.lse[n_idx] = kMaskValue;
      }
    }
}

// Work shared between the calling thread and the helpers it schedules on XLA's thread pool.
// Tasks are (row, kv head) pairs handed out through an atomic counter, so a helper that starts
// late finds no work and returns; the caller waits only for tasks that were claimed.
struct Work {
  Args args;
  std::vector<int64_t> row_start;
  int64_t num_tasks = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Run() {
    std::vector<float> scratch;
    for (int64_t t; (t = next.fetch_add(1)) < num_tasks;) {
      AttendRowHead(args, t / args.d.K, t % args.d.K, scratch);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error PagedAttentionContextImpl(
    ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> kv_cache,
    ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> context_blocks,
    ffi::Buffer<ffi::S32> context_rows, ffi::Buffer<ffi::S32> context_lens,
    ffi::Buffer<ffi::S32> query_lens, float scale, ffi::ResultBuffer<ffi::F32> out,
    ffi::ResultBuffer<ffi::F32> lse) {
  auto qd = q.dimensions();
  auto cd = kv_cache.dimensions();
  if (qd.size() != 4 || cd.size() != 6 || cd[1] != 2 || cd[5] != qd[3] || qd[2] % cd[2] != 0)
    return ffi::Error::InvalidArgument("paged_attention_cpu: q must be [B, Q, N, H] and "
                                       "kv_cache [L, 2, K, P, S, H] with N % K == 0");
  auto w = std::make_shared<Work>();
  Shapes& d = w->args.d;
  d = Shapes{qd[0], qd[1], qd[2], qd[3], cd[2], qd[2] / cd[2], cd[3], cd[4], cd[0],
             static_cast<int64_t>(context_blocks.element_count())};
  const int64_t l_idx = layer.typed_data()[0];
  if (l_idx < 0 || l_idx >= d.L) return ffi::Error::InvalidArgument("layer out of range");

  // Each row's entries are contiguous (rows non-decreasing, padding entries last with
  // row >= B); row_start[B] is the first padding entry.
  const int32_t* rows = context_rows.typed_data();
  const int32_t* blocks = context_blocks.typed_data();
  w->row_start.assign(d.B + 1, d.NB);
  for (int64_t e = d.NB - 1; e >= 0; --e)
    w->row_start[std::clamp<int64_t>(rows[e], 0, d.B)] = e;
  for (int64_t b = d.B - 1; b >= 0; --b)
    w->row_start[b] = std::min(w->row_start[b], w->row_start[b + 1]);
  for (int64_t e = 0; e < d.NB; ++e)
    if (rows[e] >= 0 && rows[e] < d.B && (blocks[e] < 0 || blocks[e] >= d.P))
      return ffi::Error::InvalidArgument("context block id out of range");

  const int64_t layer_size = 2 * d.K * d.P * d.S * d.H;
  const float* pool_layer = kv_cache.typed_data() + l_idx * layer_size;
  w->args = Args{d, q.typed_data(), pool_layer, pool_layer + layer_size / 2, blocks,
                 context_lens.typed_data(), query_lens.typed_data(), w->row_start.data(), scale,
                 out->typed_data(), lse->typed_data()};
  w->num_tasks = d.B * d.K;

  const int64_t helpers = std::min<int64_t>(pool.num_threads(), w->num_tasks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([w] { w->Run(); });
  w->Run();
  while (w->done.load(std::memory_order_acquire) < w->num_tasks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedPagedAttentionContext, PagedAttentionContextImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // q
                                  .Arg<ffi::Buffer<ffi::F32>>()  // kv_cache
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer
                                  .Arg<ffi::Buffer<ffi::S32>>()  // context_blocks
                                  .Arg<ffi::Buffer<ffi::S32>>()  // context_rows
                                  .Arg<ffi::Buffer<ffi::S32>>()  // context_lens
                                  .Arg<ffi::Buffer<ffi::S32>>()  // query_lens
                                  .Attr<float>("scale")
                                  .Ret<ffi::Buffer<ffi::F32>>()  // out
                                  .Ret<ffi::Buffer<ffi::F32>>()  // lse
);
