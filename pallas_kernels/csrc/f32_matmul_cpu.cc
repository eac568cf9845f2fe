// Float32 matmul of a few rows for XLA on CPU (an XLA FFI custom call): the linear layers of a
// step of 2 to 16 tokens, `few_row_matmul.few_row_matmul`.
//
// A decode step of one token runs XLA's GEMV, which streams the weights once at memory speed.
// A step of a few tokens (a speculative verification: 1 + k tokens) goes to XLA's GEMM, which
// packs the weights into panels first: at 2 to 16 rows it costs 1.5x to 2.4x the one-row step
// although it reads the same bytes. These kernels read each weight once from memory, straight
// from its place, and use it for every row of x while it is in registers (or L1):
//
// - KN: w is [K, N] (flax's `nnx.Linear` kernel), y = x @ w. A task is a block of 64 output
//   columns; a register tile holds R rows of x by 64 columns (R x 4 vectors of 16) and walks K,
//   broadcasting one x value against the four weight vectors of row k. Rows of w are N floats
//   apart, a stride the hardware prefetcher does not follow: row k + kAheadKN is prefetched.
//   The first tile of rows reads the block from memory; later tiles find it in L2.
// - NK: w is [N, K] (a tied embedding as LM head), y = x @ w.T. A task is a block of 64 output
//   columns (rows of w); a tile is 4 rows of w by R rows of x, dot products along K, the
//   4 x K weights staying in L1 while the tiles of x rows go by.
//
// Inputs: x f32[M, K], w f32[K, N] or f32[N, K]. Output: y f32[M, N]. Either kernel requires
// N % 64 == 0 (the caller falls back to XLA's dot otherwise).

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>

#if defined(__AVX512F__)
#include <immintrin.h>
#define JAXPAGED_AVX512 1
#endif

#include "xla/ffi/api/ffi.h"
#include "cpu_tasks.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 64;     // output columns per task
constexpr int64_t kMaxRowsKN = 6;  // rows of x per KN register tile (6 x 4 accumulators)
constexpr int64_t kRowsNK = 4;     // rows of x per NK tile
constexpr int64_t kColsNK = 4;     // rows of w per NK tile
constexpr int64_t kAheadKN = 12;   // rows of w prefetched ahead in the KN form

// y[r, n0 .. n0 + 64) for R rows of x (x + r * K) against w[:, n0 ..): `w` points at w[0, n0].
template <int R>
void TileKN(const float* x, int64_t K, const float* w, int64_t N, float* y) {
#ifdef JAXPAGED_AVX512
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * N;
    if (k + kAheadKN < K) {
      const char* ahead = reinterpret_cast<const char*>(wk + kAheadKN * N);
      for (int line = 0; line < 4; ++line) __builtin_prefetch(ahead + 64 * line, 0, 3);
    }
    const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16);
    const __m512 w2 = _mm512_loadu_ps(wk + 32), w3 = _mm512_loadu_ps(wk + 48);
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r * K + k]);
      acc[r][0] = _mm512_fmadd_ps(xb, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(xb, w1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(xb, w2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(xb, w3, acc[r][3]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(y + r * N + 16 * v, acc[r][v]);
#else
  float acc[R][kBlock] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r) {
      const float xv = x[r * K + k];
#pragma omp simd
      for (int64_t j = 0; j < kBlock; ++j) acc[r][j] += xv * w[k * N + j];
    }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < kBlock; ++j) y[r * N + j] = acc[r][j];
#endif
}

// y[r, n0 + c] for R rows of x and kColsNK rows of w (w points at w[n0, 0]), along K.
template <int R>
void TileNK(const float* x, int64_t K, const float* w, float* y, int64_t ldy) {
#ifdef JAXPAGED_AVX512
  __m512 acc[R][kColsNK];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kColsNK; ++c) acc[r][c] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[kColsNK];
    for (int c = 0; c < kColsNK; ++c) wv[c] = _mm512_loadu_ps(w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_loadu_ps(x + r * K + k);
      for (int c = 0; c < kColsNK; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 wv[kColsNK];
    for (int c = 0; c < kColsNK; ++c) wv[c] = _mm512_maskz_loadu_ps(mask, w + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_maskz_loadu_ps(mask, x + r * K + k);
      for (int c = 0; c < kColsNK; ++c) acc[r][c] = _mm512_fmadd_ps(xv, wv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kColsNK; ++c) y[r * ldy + c] = _mm512_reduce_add_ps(acc[r][c]);
#else
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kColsNK; ++c) {
      float a = 0.f;
#pragma omp simd reduction(+ : a)
      for (int64_t kk = 0; kk < K; ++kk) a += x[r * K + kk] * w[c * K + kk];
      y[r * ldy + c] = a;
    }
#endif
}

template <int R>
void TileNKAny(int rows, const float* x, int64_t K, const float* w, float* y, int64_t ldy);

template <>
void TileNKAny<0>(int, const float*, int64_t, const float*, float*, int64_t) {}

template <int R>
void TileNKAny(int rows, const float* x, int64_t K, const float* w, float* y, int64_t ldy) {
  if (rows == R) return TileNK<R>(x, K, w, y, ldy);
  TileNKAny<R - 1>(rows, x, K, w, y, ldy);
}

template <int R>
void TileKNAny(int rows, const float* x, int64_t K, const float* w, int64_t N, float* y);

template <>
void TileKNAny<0>(int, const float*, int64_t, const float*, int64_t, float*) {}

template <int R>
void TileKNAny(int rows, const float* x, int64_t K, const float* w, int64_t N, float* y) {
  if (rows == R) return TileKN<R>(x, K, w, N, y);
  TileKNAny<R - 1>(rows, x, K, w, N, y);
}

struct Work {
  const float* x;
  const float* w;
  float* y;
  int64_t M, N, K;
  bool nk;  // w is [N, K]
  int64_t num_tasks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void RunTask(int64_t t) {
    const int64_t n0 = t * kBlock;
    if (!nk) {
      for (int64_t m = 0; m < M; m += kMaxRowsKN) {
        const int rows = static_cast<int>(std::min(kMaxRowsKN, M - m));
        TileKNAny<kMaxRowsKN>(rows, x + m * K, K, w + n0, N, y + m * N + n0);
      }
      return;
    }
    for (int64_t c = n0; c < n0 + kBlock; c += kColsNK) {
      if (c + 2 * kColsNK < N) {  // the next tiles' rows of w, about a line per k step
        const char* ahead = reinterpret_cast<const char*>(w + (c + 2 * kColsNK) * K);
        for (int64_t b = 0; b < kColsNK * K * 4; b += 64) __builtin_prefetch(ahead + b, 0, 2);
      }
      for (int64_t m = 0; m < M; m += kRowsNK) {
        const int rows = static_cast<int>(std::min(kRowsNK, M - m));
        TileNKAny<kRowsNK>(rows, x + m * K, K, w + c * K, y + m * N + c, N);
      }
    }
  }

  void Run() {
    for (int64_t t; (t = next.fetch_add(1)) < num_tasks;) {
      RunTask(t);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Run(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
               ffi::ResultBuffer<ffi::F32> y, bool nk) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  const int64_t N = nk ? wd[0] : wd[1], K = nk ? wd[1] : wd[0];
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != K || N % kBlock != 0)
    return ffi::Error::InvalidArgument(
        "f32_matmul_cpu: x must be [M, K], w [K, N] (or [N, K]) with N a multiple of 64");
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->w = w.typed_data();
  work->y = y->typed_data();
  work->M = xd[0];
  work->N = N;
  work->K = K;
  work->nk = nk;
  work->num_tasks = N / kBlock;
  if (work->M == 0 || work->num_tasks == 0) return ffi::Error::Success();
  jaxpaged::RunTasks(pool, work, work->num_tasks);
  return ffi::Error::Success();
}

ffi::Error MatmulKN(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                    ffi::ResultBuffer<ffi::F32> y) {
  return Run(pool, x, w, y, false);
}

ffi::Error MatmulNK(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                    ffi::ResultBuffer<ffi::F32> y) {
  return Run(pool, x, w, y, true);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedF32MatmulKN, MatmulKN,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [K, N]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
);

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedF32MatmulNK, MatmulNK,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::F32>>()  // w [N, K]
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
);
