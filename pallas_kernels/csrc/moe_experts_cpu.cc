// Mixture-of-Experts experts for XLA on CPU (an XLA FFI custom call): `moe_experts.experts_cpu`,
// each (token, expert) pair through its own expert's gated MLP, `down(silu(gate(x)) * up(x))`,
// the pairs' outputs summed per token by their routing weights.
//
// XLA has no grouped matmul of its own on CPU (`lax.ragged_dot` runs every group on every row),
// so `models.moe`'s jnp paths either run every expert on every token or copy the experts'
// matrices per token or per tile. Here the pairs are grouped by expert first (a counting sort
// of `ids`, stable: each expert's pairs in token order), and each expert's rows go through its
// own matrices, read in place: a decode step reads each expert it uses once, a prefill runs
// each expert's rows as one GEMM.
//
//   1. xs = x[token of each sorted pair]                            f32[P, D]   (P = T * k)
//   2. h = xs_e @ gate_up[e] for each expert e's rows               f32[P, 2F]
//   3. h[:, :F] = silu(h_gate) * h_up (int8: each column scaled first)
//   4. o = h[:, :F]_e @ down[e]                                     f32[P, D]
//   5. y[t] = sum_j weights[t, j] * o[pair (t, j)] (int8: times down's column scales), j in order
//
// Steps 2 and 4 are tasks of (expert, up to kRowChunk of its rows, 64 output columns); a task
// walks the reduction axis in chunks of kKChunk (that chunk of its 64 weight columns stays in L1
// / L2 while its rows go by in register tiles of up to kTileRows rows, each row's sums kept in
// the tile's accumulators and in its output row between chunks). A row's sums run over the
// reduction axis in order whatever the other rows are, so a token's outputs do not depend on the
// rest of its step. The weights are float32, or int8 (`models.quantization`: per expert and
// output column scales) widened to float32 in the registers.
//
// Inputs: x f32[T, D], weights f32[T, k], ids i32[T, k] (each in [0, E)), gate_up W[E, D, 2F]
// (gate then up columns), down W[E, F, D], then for int8 W: gate_up_scale f32[E, 2F],
// down_scale f32[E, D]. Output: y f32[T, D]. D and F must be multiples of 64.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <new>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define JAXPAGED_AVX512 1
#endif

#include "xla/ffi/api/ffi.h"
#include "cpu_tasks.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kCols = 64;       // output columns per task (4 vectors of 16)
constexpr int kTileRows = 6;        // rows per register tile (6 x 4 accumulators)
constexpr int64_t kRowChunk = 96;   // rows of one expert per task
constexpr int64_t kKChunk = 256;    // reduction steps per pass over a task's rows
constexpr int64_t kAhead = 12;      // weight rows prefetched ahead

#ifdef JAXPAGED_AVX512
inline __m512 Load16(const float* w) { return _mm512_loadu_ps(w); }
inline __m512 Load16(const int8_t* w) {
  return _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w))));
}
#endif

// y[r, 0 .. 64) (+)= sum over k in [0, K) of x[r, k] * w[k, 0 .. 64), for R rows: x rows ldx
// apart, w rows ldw apart (w points at its first column), y rows ldy apart.
template <int R, class W>
void Tile(const float* x, int64_t ldx, int64_t K, const W* w, int64_t ldw, float* y,
          int64_t ldy, bool accumulate) {
#ifdef JAXPAGED_AVX512
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v)
      acc[r][v] = accumulate ? _mm512_loadu_ps(y + r * ldy + 16 * v) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const W* wk = w + k * ldw;
    if (k + kAhead < K) {
      const char* ahead = reinterpret_cast<const char*>(wk + kAhead * ldw);
      for (int64_t b = 0; b < kCols * static_cast<int64_t>(sizeof(W)); b += 64)
        __builtin_prefetch(ahead + b, 0, 3);
    }
    const __m512 w0 = Load16(wk), w1 = Load16(wk + 16);
    const __m512 w2 = Load16(wk + 32), w3 = Load16(wk + 48);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xb, w2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(xb, w3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(y + r * ldy + 16 * v, acc[r][v]);
#else
  float acc[R][kCols];
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < kCols; ++j) acc[r][j] = accumulate ? y[r * ldy + j] : 0.f;
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * ldx + k];
#pragma omp simd
      for (int64_t j = 0; j < kCols; ++j)
        acc[r][j] += xv * static_cast<float>(w[k * ldw + j]);
    }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < kCols; ++j) y[r * ldy + j] = acc[r][j];
#endif
}

template <int R, class W>
void TileAny(int rows, const float* x, int64_t ldx, int64_t K, const W* w, int64_t ldw,
             float* y, int64_t ldy, bool accumulate) {
  if constexpr (R > 0) {
    if (rows == R) return Tile<R, W>(x, ldx, K, w, ldw, y, ldy, accumulate);
    TileAny<R - 1, W>(rows, x, ldx, K, w, ldw, y, ldy, accumulate);
  }
}

// One GEMM task: rows [row0, row0 + rows) of an expert (rows of `a`, ld `lda`, K wide) times
// columns [col, col + 64) of its matrix w (K x N, row-major) into out (ld `ldo`).
struct Task {
  int64_t expert, row0, rows, col;
};

template <class W>
struct Gemm {
  const float* a;
  int64_t lda, K;
  const W* w;  // [E, K, N]
  int64_t N;
  float* out;
  int64_t ldo;
  std::vector<Task> tasks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void RunTask(const Task& t) {
    const W* we = w + t.expert * K * N + t.col;
    for (int64_t k0 = 0; k0 < K; k0 += kKChunk) {
      const int64_t kc = std::min(kKChunk, K - k0);
      for (int64_t r = 0; r < t.rows; r += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, t.rows - r));
        const int64_t row = t.row0 + r;
        TileAny<kTileRows, W>(rows, a + row * lda + k0, lda, kc, we + k0 * N, N,
                              out + row * ldo + t.col, ldo, k0 > 0);
      }
    }
  }

  void Run() {
    const int64_t n = static_cast<int64_t>(tasks.size());
    for (int64_t i; (i = next.fetch_add(1)) < n;) {
      RunTask(tasks[i]);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Tasks covering every expert's rows (first[e] .. first[e + 1]) by N / 64 column blocks.
std::vector<Task> GemmTasks(const std::vector<int64_t>& first, int64_t N) {
  std::vector<Task> tasks;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(first.size()); ++e)
    for (int64_t r = first[e]; r < first[e + 1]; r += kRowChunk)
      for (int64_t c = 0; c < N; c += kCols)
        tasks.push_back({e, r, std::min(kRowChunk, first[e + 1] - r), c});
  return tasks;
}

template <class W>
void RunGemm(ffi::ThreadPool& pool, const float* a, int64_t lda, int64_t K, const W* w,
             int64_t N, float* out, int64_t ldo, const std::vector<int64_t>& first) {
  auto gemm = std::make_shared<Gemm<W>>();
  gemm->a = a;
  gemm->lda = lda;
  gemm->K = K;
  gemm->w = w;
  gemm->N = N;
  gemm->out = out;
  gemm->ldo = ldo;
  gemm->tasks = GemmTasks(first, N);
  const int64_t n = static_cast<int64_t>(gemm->tasks.size());
  if (n) jaxpaged::RunTasks(pool, gemm, n);
}

// fn(begin, end) over rows [0, rows) in tasks of `per_task` rows, on the calling thread and
// the pool's.
template <class Fn>
struct RowWork {
  RowWork(Fn fn, int64_t rows, int64_t per_task)
      : fn(fn), rows(rows), per_task(per_task), num_tasks((rows + per_task - 1) / per_task) {}
  Fn fn;
  int64_t rows, per_task, num_tasks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Run() {
    for (int64_t i; (i = next.fetch_add(1)) < num_tasks;) {
      fn(i * per_task, std::min(rows, (i + 1) * per_task));
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

template <class Fn>
void ForRows(ffi::ThreadPool& pool, int64_t rows, int64_t per_task, Fn fn) {
  if (rows == 0) return;
  auto work = std::make_shared<RowWork<Fn>>(fn, rows, per_task);
  jaxpaged::RunTasks(pool, work, work->num_tasks);
}

template <class W>
ffi::Error ExpertsOrThrow(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                          ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> ids,
                          const W* gate_up, const W* down, const float* gate_up_scale,
                          const float* down_scale, int64_t E, int64_t F,
                          ffi::ResultBuffer<ffi::F32> y) {
  const int64_t T = x.dimensions()[0], D = x.dimensions()[1], k = ids.dimensions()[1];
  const int64_t P = T * k;
  const int32_t* id = ids.typed_data();
  for (int64_t p = 0; p < P; ++p)
    if (id[p] < 0 || id[p] >= E)
      return ffi::Error::InvalidArgument("moe_experts_cpu: an expert id is out of range");
  // 1. The pairs by expert (counting sort) and their rows of x.
  std::vector<int64_t> first(E + 1, 0), pos(P), token(P);
  for (int64_t p = 0; p < P; ++p) ++first[id[p] + 1];
  for (int64_t e = 0; e < E; ++e) first[e + 1] += first[e];
  std::vector<int64_t> fill(first.begin(), first.end() - 1);
  for (int64_t p = 0; p < P; ++p) {
    pos[p] = fill[id[p]]++;
    token[pos[p]] = p / k;
  }
  std::unique_ptr<float[]> xs(new float[P * D]), h(new float[P * 2 * F]), o(new float[P * D]);
  const float* xd = x.typed_data();
  ForRows(pool, P, 64, [&](int64_t b, int64_t e) {
    for (int64_t s = b; s < e; ++s) std::copy_n(xd + token[s] * D, D, xs.get() + s * D);
  });
  // 2. gate and up.
  RunGemm(pool, xs.get(), D, D, gate_up, 2 * F, h.get(), 2 * F, first);
  // 3. silu(gate) * up, into gate's columns.
  std::vector<int64_t> expert_of(P);
  for (int64_t e = 0; e < E; ++e)
    std::fill(expert_of.begin() + first[e], expert_of.begin() + first[e + 1], e);
  ForRows(pool, P, 16, [&](int64_t b, int64_t e) {
    for (int64_t s = b; s < e; ++s) {
      float* hs = h.get() + s * 2 * F;
      if (gate_up_scale) {
        const float* gs = gate_up_scale + expert_of[s] * 2 * F;
#pragma omp simd
        for (int64_t f = 0; f < 2 * F; ++f) hs[f] *= gs[f];
      }
#pragma omp simd
      for (int64_t f = 0; f < F; ++f) hs[f] = hs[f] / (1.f + std::exp(-hs[f])) * hs[F + f];
    }
  });
  // 4. down.
  RunGemm(pool, h.get(), 2 * F, F, down, D, o.get(), D, first);
  // 5. Each token's pairs, weighted, in the order of its k experts.
  const float* wt = weights.typed_data();
  float* yd = y->typed_data();
  ForRows(pool, T, 8, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* yt = yd + t * D;
      std::fill_n(yt, D, 0.f);
      for (int64_t j = 0; j < k; ++j) {
        const int64_t s = pos[t * k + j];
        const float* os = o.get() + s * D;
        const float wj = wt[t * k + j];
        if (down_scale) {
          const float* ds = down_scale + id[t * k + j] * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) yt[d] += wj * (os[d] * ds[d]);
        } else {
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) yt[d] += wj * os[d];
        }
      }
    }
  });
  return ffi::Error::Success();
}

// `ExpertsOrThrow`, its scratch buffers' allocation failing as an error (an exception must not
// cross the FFI boundary).
template <class W>
ffi::Error Experts(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> weights,
                   ffi::Buffer<ffi::S32> ids, const W* gate_up, const W* down,
                   const float* gate_up_scale, const float* down_scale, int64_t E, int64_t F,
                   ffi::ResultBuffer<ffi::F32> y) {
  try {
    return ExpertsOrThrow<W>(pool, x, weights, ids, gate_up, down, gate_up_scale, down_scale,
                             E, F, y);
  } catch (const std::bad_alloc&) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "moe_experts_cpu: out of memory for the step's scratch buffers");
  }
}

// The shapes every caller's buffers must have; an error names what differs.
ffi::Error Check(ffi::Buffer<ffi::F32>& x, ffi::Buffer<ffi::F32>& weights,
                 ffi::Buffer<ffi::S32>& ids, ffi::Span<const int64_t> gu,
                 ffi::Span<const int64_t> dn) {
  auto xd = x.dimensions(), wd = weights.dimensions(), id = ids.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || id.size() != 2 || gu.size() != 3 || dn.size() != 3 ||
      wd[0] != xd[0] || id[0] != xd[0] || wd[1] != id[1] || gu[1] != xd[1] ||
      gu[2] != 2 * dn[1] || dn[0] != gu[0] || dn[2] != xd[1] || xd[1] % kCols ||
      dn[1] % kCols)
    return ffi::Error::InvalidArgument(
        "moe_experts_cpu: need x [T, D], weights and ids [T, k], gate_up [E, D, 2F], "
        "down [E, F, D], D and F multiples of 64");
  return ffi::Error::Success();
}

ffi::Error ExpertsF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                      ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> ids,
                      ffi::Buffer<ffi::F32> gate_up, ffi::Buffer<ffi::F32> down,
                      ffi::ResultBuffer<ffi::F32> y) {
  if (auto err = Check(x, weights, ids, gate_up.dimensions(), down.dimensions()); !err.success())
    return err;
  return Experts<float>(pool, x, weights, ids, gate_up.typed_data(), down.typed_data(), nullptr,
                        nullptr, gate_up.dimensions()[0], down.dimensions()[1], y);
}

ffi::Error ExpertsI8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                     ffi::Buffer<ffi::F32> weights, ffi::Buffer<ffi::S32> ids,
                     ffi::Buffer<ffi::S8> gate_up, ffi::Buffer<ffi::S8> down,
                     ffi::Buffer<ffi::F32> gate_up_scale, ffi::Buffer<ffi::F32> down_scale,
                     ffi::ResultBuffer<ffi::F32> y) {
  if (auto err = Check(x, weights, ids, gate_up.dimensions(), down.dimensions()); !err.success())
    return err;
  const int64_t E = gate_up.dimensions()[0], F = down.dimensions()[1], D = x.dimensions()[1];
  auto gs = gate_up_scale.dimensions(), ds = down_scale.dimensions();
  if (gs.size() != 2 || ds.size() != 2 || gs[0] != E || gs[1] != 2 * F || ds[0] != E ||
      ds[1] != D)
    return ffi::Error::InvalidArgument(
        "moe_experts_cpu: int8 scales must be gate_up_scale [E, 2F], down_scale [E, D]");
  return Experts<int8_t>(pool, x, weights, ids, gate_up.typed_data(), down.typed_data(),
                         gate_up_scale.typed_data(), down_scale.typed_data(), E, F, y);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedMoeExpertsF32, ExpertsF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weights
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gate_up
                                  .Arg<ffi::Buffer<ffi::F32>>()  // down
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedMoeExpertsI8, ExpertsI8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // weights
                                  .Arg<ffi::Buffer<ffi::S32>>()  // ids
                                  .Arg<ffi::Buffer<ffi::S8>>()   // gate_up
                                  .Arg<ffi::Buffer<ffi::S8>>()   // down
                                  .Arg<ffi::Buffer<ffi::F32>>()  // gate_up_scale
                                  .Arg<ffi::Buffer<ffi::F32>>()  // down_scale
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
);
