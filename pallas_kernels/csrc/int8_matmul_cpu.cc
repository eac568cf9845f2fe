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
// weights), so each output is a dot product along contiguous memory. A micro-tile computes
// kRows rows of x against kCols rows of w with kRows * kCols vector accumulators; a task is a
// block of kColBlock output columns over every row of x, so that block's weights (kColBlock * K
// bytes) stay in L2 while the rows go by. Tasks are shared with XLA's intra-op thread pool.
//
// Inputs: x f32[M, K], w s8[N, K], scale f32[N]. Output: y f32[M, N].

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define JAXPAGED_AVX512 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kCols = 8;         // rows of w (output columns) per GEMV tile
constexpr int64_t kColBlock = 64;    // output columns per task
constexpr int64_t kDepth = 256;      // input features per packed panel (GEMM)
constexpr int64_t kGemmRows = 6;     // rows of x per GEMM micro-tile
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

// GEMM form: rows of x times a packed panel p[kc][kColBlock] (weights widened and scaled
// once per task and depth block, transposed so that a step along k reads kColBlock outputs'
// weights contiguously). y[0..MR, 0..nc) (+)= x[0..MR, 0..kc) . p, with the MR x kColBlock
// accumulators in registers (MR * 4 vectors) and x[i, k] broadcast.
template <int MR>
void GemmTile(const float* x, int64_t ldx, const float* p, int64_t kc, float* y, int64_t ldy,
              int64_t nc, bool first) {
#ifdef JAXPAGED_AVX512
  constexpr int V = kColBlock / 16;
  __m512 acc[MR][V];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < V; ++v) {
      const __mmask16 mask = static_cast<__mmask16>(
          nc >= 16 * (v + 1) ? 0xFFFF : nc <= 16 * v ? 0 : (1u << (nc - 16 * v)) - 1);
      acc[i][v] = first ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, y + i * ldy + 16 * v);
    }
  for (int64_t k = 0; k < kc; ++k) {
    __m512 pv[V];
    for (int v = 0; v < V; ++v) pv[v] = _mm512_loadu_ps(p + k * kColBlock + 16 * v);
    for (int i = 0; i < MR; ++i) {
      const __m512 xv = _mm512_set1_ps(x[i * ldx + k]);
      for (int v = 0; v < V; ++v) acc[i][v] = _mm512_fmadd_ps(xv, pv[v], acc[i][v]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < V; ++v) {
      const __mmask16 mask = static_cast<__mmask16>(
          nc >= 16 * (v + 1) ? 0xFFFF : nc <= 16 * v ? 0 : (1u << (nc - 16 * v)) - 1);
      _mm512_mask_storeu_ps(y + i * ldy + 16 * v, mask, acc[i][v]);
    }
#else
  float acc[MR][kColBlock];
  for (int i = 0; i < MR; ++i)
    for (int64_t j = 0; j < kColBlock; ++j) acc[i][j] = first || j >= nc ? 0.f : y[i * ldy + j];
  for (int64_t k = 0; k < kc; ++k)
    for (int i = 0; i < MR; ++i) {
      const float xv = x[i * ldx + k];
#pragma omp simd
      for (int64_t j = 0; j < kColBlock; ++j) acc[i][j] += xv * p[k * kColBlock + j];
    }
  for (int i = 0; i < MR; ++i)
    for (int64_t j = 0; j < nc; ++j) y[i * ldy + j] = acc[i][j];
#endif
}

struct Work {
  const float* x;
  const int8_t* w;
  const float* scale;
  float* y;
  int64_t M, N, K;
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
    panel.resize(kDepth * kColBlock);
    for (int64_t k0 = 0; k0 < K; k0 += kDepth) {
      const int64_t kc = std::min(kDepth, K - k0);
      for (int64_t j = 0; j < kColBlock; ++j) {  // pack: p[k][j] = w[n0 + j, k0 + k] * scale
        if (j >= nc) {
          for (int64_t k = 0; k < kc; ++k) panel[k * kColBlock + j] = 0.f;
          continue;
        }
        const int8_t* wj = w + (n0 + j) * K + k0;
        const float sj = scale[n0 + j];
        for (int64_t k = 0; k < kc; ++k) panel[k * kColBlock + j] = wj[k] * sj;
      }
      int64_t m = 0;
      for (; m + kGemmRows <= M; m += kGemmRows)
        GemmTile<kGemmRows>(x + m * K + k0, K, panel.data(), kc, y + m * N + n0, N, nc, k0 == 0);
      for (; m < M; ++m)
        GemmTile<1>(x + m * K + k0, K, panel.data(), kc, y + m * N + n0, N, nc, k0 == 0);
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
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->num_tasks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < work->num_tasks) std::this_thread::yield();
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
