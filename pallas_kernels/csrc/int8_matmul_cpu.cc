// Weight-only int8 matmul for XLA on CPU (an XLA FFI custom call): the quantized linear layers'
// matmul, `quantized_matmul.int8_matmul`.
//
//   y[m, n] = scale[n] * sum_k x[m, k] * w[n, k]
//
// The weights stay int8 in memory and are widened to float32 in registers, 16 at a time, just
// before their multiply-adds: a decode step reads a quarter of the bytes of a float32 matmul
// and never writes a float copy of the weights. XLA:CPU does not fuse a convert into its dot
// (`dot(x, convert(w))` writes the whole converted matrix first), which is why this is a
// kernel and not jnp.
//
// w is [N, K], output rows by input features (the layout of Hugging Face's and GGUF's
// weights). A task is a block of kColBlock output columns over every row of x, so that block's
// weights stay in L2 while the rows go by; tasks are shared with XLA's intra-op thread pool.
// Two forms:
// - GEMV (a decode's few rows of x): each output a dot product along K, the weights widened
//   16 at a time straight from memory, the next tiles prefetched.
// - GEMM (more rows): the task's block of weights is widened and scaled once into a float
//   panel, row by row (contiguous, vectorized), and x is transposed once per call, so that a
//   micro-tile broadcasts one weight at a time against 16 rows of x in a vector, keeping
//   kGemmCols x kGemmRowVecs * 16 outputs in registers: the register-blocked GEMM of float32
//   libraries with the roles of the two operands swapped, which spares transposing the
//   weights.
//
// Inputs: x f32[M, K], w s8[N, K], scale f32[N]. Output: y f32[M, N].

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define JAXPAGED_AVX512 1
#endif

#include "xla/ffi/api/ffi.h"
#include "cpu_tasks.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kCols = 8;         // rows of w (output columns) per GEMV tile
constexpr int64_t kColBlock = 64;    // output columns per task
constexpr int64_t kGemmCols = 6;     // output columns (rows of w) per GEMM micro-tile
constexpr int64_t kGemmRowVecs = 4;  // vectors of 16 rows of x per GEMM micro-tile
constexpr int64_t kGemvMaxRows = 3;  // up to this many rows of x: the GEMV form
constexpr int64_t kPrefetchTiles = 2;  // GEMV tiles prefetched ahead

// GEMV form (a decode's few rows): y[i, 0..nc) for row i of x against nc <= kCols rows of w,
// a dot product along K each, the weights widened 16 at a time straight from memory. The
// tile's rows are short (K bytes each) and read side by side, which the hardware prefetcher
// does not follow: the tile kPrefetchTiles ahead (contiguous, kCols * K bytes) is prefetched
// while this one is computed, about two cache lines per step along K.
void GemvTile(const float* x, const int8_t* w, const float* scale, int64_t K, int64_t nc,
              float* y, const int8_t* ahead, int64_t ahead_bytes) {
  const int8_t* wr[kCols];
  for (int64_t j = 0; j < kCols; ++j) wr[j] = w + std::min(j, nc - 1) * K;  // repeat the last
#ifdef JAXPAGED_AVX512
  __m512 acc[kCols];
  for (int j = 0; j < kCols; ++j) acc[j] = _mm512_setzero_ps();
  int64_t k = 0, pf = 0;
  const int64_t pf_step = 64 * ((ahead_bytes / 64 + K / 16) / std::max<int64_t>(1, K / 16));
  for (; k + 16 <= K; k += 16) {
    for (const int64_t end = std::min(ahead_bytes, pf + pf_step); pf < end; pf += 64)
      _mm_prefetch(reinterpret_cast<const char*>(ahead) + pf, _MM_HINT_T0);
    const __m512 xv = _mm512_loadu_ps(x + k);
    for (int j = 0; j < kCols; ++j) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wr[j] + k));
      acc[j] = _mm512_fmadd_ps(xv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), acc[j]);
    }
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1);
    const __m512 xv = _mm512_maskz_loadu_ps(mask, x + k);
    for (int j = 0; j < kCols; ++j) {
      const __m128i b = _mm_maskz_loadu_epi8(mask, wr[j] + k);
      acc[j] = _mm512_fmadd_ps(xv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), acc[j]);
    }
  }
  for (int64_t j = 0; j < nc; ++j) y[j] = _mm512_reduce_add_ps(acc[j]) * scale[j];
#else
  (void)ahead;
  (void)ahead_bytes;
  for (int64_t j = 0; j < nc; ++j) {
    float a = 0.f;
#pragma omp simd reduction(+ : a)
    for (int64_t k = 0; k < K; ++k) a += x[k] * static_cast<float>(wr[j][k]);
    y[j] = a * scale[j];
  }
#endif
}

// GEMM form: y[m0 + r, j0 + c] = sum_k xt[k][m0 + r] * p[j0 + c][k] for r < 16 * MV (the rows
// that exist: `rows`) and c < nc <= kGemmCols. xt: x transposed, [K][ldx] (ldx a multiple
// of 16, zero past M); p: the task's float panel, [kColBlock][K]; y: [M][ldy].
template <int MV>
void GemmTile(const float* xt, int64_t ldx, const float* p, int64_t K, int64_t nc, float* y,
              int64_t ldy, int64_t rows) {
  const float* pr[kGemmCols];
  for (int64_t c = 0; c < kGemmCols; ++c) pr[c] = p + std::min(c, nc - 1) * K;
#ifdef JAXPAGED_AVX512
  __m512 acc[kGemmCols][MV];
  for (int c = 0; c < kGemmCols; ++c)
    for (int v = 0; v < MV; ++v) acc[c][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    __m512 xv[MV];
    for (int v = 0; v < MV; ++v) xv[v] = _mm512_loadu_ps(xt + k * ldx + 16 * v);
    for (int c = 0; c < kGemmCols; ++c) {
      const __m512 wv = _mm512_set1_ps(pr[c][k]);
      for (int v = 0; v < MV; ++v) acc[c][v] = _mm512_fmadd_ps(wv, xv[v], acc[c][v]);
    }
  }
  alignas(64) float out[16];
  for (int64_t c = 0; c < nc; ++c)
    for (int v = 0; v < MV; ++v) {
      _mm512_store_ps(out, acc[c][v]);
      for (int64_t r = 0; r < 16 && 16 * v + r < rows; ++r) y[(16 * v + r) * ldy + c] = out[r];
    }
#else
  for (int64_t c = 0; c < nc; ++c)
    for (int64_t r = 0; r < rows; ++r) {
      float a = 0.f;
      for (int64_t k = 0; k < K; ++k) a += xt[k * ldx + r] * pr[c][k];
      y[r * ldy + c] = a;
    }
#endif
}

struct Work {
  const float* x;
  const int8_t* w;
  const float* scale;
  float* y;
  int64_t M, N, K;
  std::vector<float> xt_storage;  // GEMM: x transposed, [K][ldxt], zero past M
  const float* xt = nullptr;
  int64_t ldxt = 0;
  int64_t num_tasks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // Output columns [n0, n1) for every row of x.
  void RunTask(int64_t t, std::vector<float>& panel) {
    const int64_t n0 = t * kColBlock, n1 = std::min(N, n0 + kColBlock), nc = n1 - n0;
    if (M <= kGemvMaxRows) {
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = n0; n < n1; n += kCols) {
          const int64_t a0 = std::min(N, n + kPrefetchTiles * kCols);
          const int64_t a1 = std::min(N, a0 + kCols);
          GemvTile(x + m * K, w + n * K, scale + n, K, std::min(kCols, n1 - n), y + m * N + n,
                   w + a0 * K, (a1 - a0) * K);
        }
      return;
    }
    panel.resize(nc * K);  // p[j][k] = w[n0 + j, k] * scale[n0 + j]
    for (int64_t j = 0; j < nc; ++j) {
      const int8_t* wj = w + (n0 + j) * K;
      const float sj = scale[n0 + j];
      float* pj = panel.data() + j * K;
#pragma omp simd
      for (int64_t k = 0; k < K; ++k) pj[k] = static_cast<float>(wj[k]) * sj;
    }
    constexpr int64_t kRowsPerTile = 16 * kGemmRowVecs;
    for (int64_t m = 0; m < M; m += kRowsPerTile) {
      const int64_t rows = std::min(kRowsPerTile, M - m);
      for (int64_t j = 0; j < nc; j += kGemmCols) {
        const float* pj = panel.data() + j * K;
        const int64_t c = std::min(kGemmCols, nc - j);
        float* yj = y + m * N + n0 + j;
        switch ((rows + 15) / 16) {
          case 4: GemmTile<4>(xt + m, ldxt, pj, K, c, yj, N, rows); break;
          case 3: GemmTile<3>(xt + m, ldxt, pj, K, c, yj, N, rows); break;
          case 2: GemmTile<2>(xt + m, ldxt, pj, K, c, yj, N, rows); break;
          default: GemmTile<1>(xt + m, ldxt, pj, K, c, yj, N, rows); break;
        }
      }
    }
  }

  void Run() {
    std::vector<float> panel;
    for (int64_t t; (t = next.fetch_add(1)) < num_tasks;) {
      RunTask(t, panel);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Int8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                          ffi::Buffer<ffi::S8> w, ffi::Buffer<ffi::F32> scale,
                          ffi::ResultBuffer<ffi::F32> y) {
  auto xd = x.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] ||
      static_cast<int64_t>(scale.element_count()) != wd[0])
    return ffi::Error::InvalidArgument(
        "int8_matmul_cpu: x must be [M, K], w [N, K] and scale [N]");
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->w = reinterpret_cast<const int8_t*>(w.typed_data());
  work->scale = scale.typed_data();
  work->y = y->typed_data();
  work->M = xd[0];
  work->N = wd[0];
  work->K = wd[1];
  work->num_tasks = (work->N + kColBlock - 1) / kColBlock;
  if (work->M == 0 || work->num_tasks == 0) return ffi::Error::Success();
  if (work->M > kGemvMaxRows) {
    const int64_t M = work->M, K = work->K, ld = (M + 15) / 16 * 16;
    work->xt_storage.assign(K * ld, 0.f);
    const float* xs = work->x;
    for (int64_t m0 = 0; m0 < M; m0 += 16)  // in 16 x 16 tiles, for the caches
      for (int64_t k0 = 0; k0 < K; k0 += 16)
        for (int64_t m = m0; m < std::min(M, m0 + 16); ++m)
          for (int64_t k = k0; k < std::min(K, k0 + 16); ++k)
            work->xt_storage[k * ld + m] = xs[m * K + k];
    work->xt = work->xt_storage.data();
    work->ldxt = ld;
  }
  jaxpaged::RunTasks(pool, work, work->num_tasks);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedInt8Matmul, Int8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::S8>>()   // w
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
);
