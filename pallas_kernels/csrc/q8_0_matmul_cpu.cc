// GGUF Q8_0 blocks multiplied as they are, for XLA on CPU (an XLA FFI custom call):
// `quantized_matmul.q8_0_dot_kernel`, which `q8_0_matmul` takes for steps of up to
// `Q8_0_KERNEL_MAX_ROWS` rows (every step in batch-invariant mode).
//
//   y[m, n] = sum_b (dx[m, b] * dw[n, b]) * float(sum_{k in block b} xq[m, k] * w[n, k])
//
// Q8_0 (ggml's `block_q8_0`) stores each run of 32 weights along K as 32 int8 values and one
// scale; w holds the values (s8[N, K]) and dw the scales (f32[N, K / 32], widened from the
// file's f16, exactly). The activations are quantized the same way by the caller (xq, dx: one
// scale per 32 values of a row), as llama.cpp does for its Q8_0 dot product. Each block's
// product is summed exactly in int32 and then scaled in float32.
//
// With AVX-512 VNNI (checked at run time) one `vpdpbusd` multiplies two blocks (64 bytes) of a
// weight row by the row of xq into 16 int32 lanes, lanes 0-7 holding the first block's partial
// sums and 8-15 the second's. The weights are offset by 128 to be the unsigned operand (as in
// w8a8_matmul_cpu.cc), and the offset's share, 128 * xq summed over each lane's 4 bytes, is
// the same `vpdpbusd` of 0x80 bytes by xq, computed once per tile. The lanes are then widened
// to float32, multiplied by their block's two scales and accumulated; the 16 lanes are added at
// the end. The portable path adds the same products block by block in a plain loop, so its
// results equal the VNNI path's up to float32 rounding (the order of the additions differs).
//
// A task is a block of kColBlock output columns over every row; tasks are shared with XLA's
// intra-op thread pool. K must be a multiple of 32.
//
// Inputs: xq s8[M, K], dx f32[M, K / 32], w s8[N, K], dw f32[N, K / 32]. Attribute
// `portable` (bool): the portable path even where VNNI exists (tests). Output: y f32[M, N].

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define JAXPAGED_X86 1
#define JAXPAGED_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#endif

#include "xla/ffi/api/ffi.h"
#include "cpu_tasks.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlock = 32;       // values per Q8_0 block
constexpr int64_t kColBlock = 64;    // output columns per task
constexpr int64_t kGemvCols = 4;     // outputs per tile
constexpr int64_t kPrefetchTiles = 2;  // tiles prefetched ahead

struct Work {
  const int8_t* xq;
  const float* dx;
  const int8_t* w;
  const float* dw;
  float* y;
  int64_t M, N, K, B;  // B = K / kBlock
  bool vnni;
  int64_t num_tasks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void PortableTask(int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; ++m)
      for (int64_t n = n0; n < n1; ++n) {
        float acc = 0.0f;
        for (int64_t b = 0; b < B; ++b) {
          const int8_t* xr = xq + m * K + b * kBlock;
          const int8_t* wr = w + n * K + b * kBlock;
          int32_t s = 0;
#pragma omp simd reduction(+ : s)
          for (int64_t k = 0; k < kBlock; ++k) s += int32_t(xr[k]) * int32_t(wr[k]);
          acc += (dx[m * B + b] * dw[n * B + b]) * float(s);
        }
        y[m * N + n] = acc;
      }
  }

#ifdef JAXPAGED_X86
  // y[m .. m + R, n .. n + nc) for nc <= kGemvCols outputs, two blocks per instruction.
  template <int R>
  JAXPAGED_VNNI void GemvTile(int64_t m, int64_t n, int64_t nc, const int8_t* ahead,
                              int64_t ahead_bytes) {
    const int8_t* wr[kGemvCols];
    const float* dwr[kGemvCols];
    for (int64_t j = 0; j < kGemvCols; ++j) {
      const int64_t row = n + std::min(j, nc - 1);
      wr[j] = w + row * K;
      dwr[j] = dw + row * B;
    }
    const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
    // lanes 0-7 take the first scale of a pair, lanes 8-15 the second
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc[R][kGemvCols];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < kGemvCols; ++j) acc[r][j] = _mm512_setzero_ps();
    const int64_t steps = std::max<int64_t>(1, (K + 63) / 64);
    const int64_t pf_step = 64 * ((ahead_bytes / 64 + steps - 1) / steps);
    int64_t pf = 0;
    for (int64_t k = 0, b = 0; k < K; k += 64, b += 2) {
      for (const int64_t end = std::min(ahead_bytes, pf + pf_step); pf < end; pf += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead) + pf, _MM_HINT_T0);
      const bool pair = K - k >= 64;  // else one block is left
      const __mmask64 mask = pair ? ~__mmask64(0) : (__mmask64(1) << kBlock) - 1;
      const __mmask8 smask = pair ? 0x3 : 0x1;
      __m512i xv[R], corr[R];
      __m512 sx[R];
      for (int r = 0; r < R; ++r) {
        xv[r] = _mm512_maskz_loadu_epi8(mask, xq + (m + r) * K + k);
        corr[r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, xv[r]);
        sx[r] = _mm512_permutexvar_ps(
            halves, _mm512_castps128_ps512(_mm_maskz_loadu_ps(smask, dx + (m + r) * B + b)));
      }
      for (int j = 0; j < kGemvCols; ++j) {
        const __m512i wv = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, wr[j] + k), offset);
        const __m512 sw = _mm512_permutexvar_ps(
            halves, _mm512_castps128_ps512(_mm_maskz_loadu_ps(smask, dwr[j] + b)));
        for (int r = 0; r < R; ++r) {
          const __m512i dot = _mm512_sub_epi32(
              _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv[r]), corr[r]);
          acc[r][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sx[r], sw),
                                      acc[r][j]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int64_t j = 0; j < nc; ++j) y[(m + r) * N + n + j] = _mm512_reduce_add_ps(acc[r][j]);
  }

  void VnniTask(int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; m += 2)  // rows in pairs: each weight read once per pair
      for (int64_t n = n0; n < n1; n += kGemvCols) {
        const int64_t a0 = std::min(N, n + kPrefetchTiles * kGemvCols);
        const int64_t a1 = std::min(N, a0 + kGemvCols);
        const int64_t nc = std::min(kGemvCols, n1 - n);
        if (m + 1 < M)
          GemvTile<2>(m, n, nc, w + a0 * K, (a1 - a0) * K);
        else
          GemvTile<1>(m, n, nc, w + a0 * K, (a1 - a0) * K);
      }
  }
#endif

  void Run() {
    for (int64_t t; (t = next.fetch_add(1)) < num_tasks;) {
      const int64_t n0 = t * kColBlock, n1 = std::min(N, n0 + kColBlock);
#ifdef JAXPAGED_X86
      if (vnni)
        VnniTask(n0, n1);
      else
#endif
        PortableTask(n0, n1);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error Q8_0MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> xq,
                          ffi::Buffer<ffi::F32> dx, ffi::Buffer<ffi::S8> w,
                          ffi::Buffer<ffi::F32> dw, ffi::ResultBuffer<ffi::F32> y,
                          bool portable) {
  auto xd = xq.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1] || wd[1] % kBlock != 0)
    return ffi::Error::InvalidArgument(
        "q8_0_matmul_cpu: xq must be [M, K] and w [N, K] with K a multiple of 32");
  const int64_t B = wd[1] / kBlock;
  auto sxd = dx.dimensions();
  auto swd = dw.dimensions();
  if (sxd.size() != 2 || swd.size() != 2 || sxd[0] != xd[0] || sxd[1] != B ||
      swd[0] != wd[0] || swd[1] != B)
    return ffi::Error::InvalidArgument("q8_0_matmul_cpu: dx must be [M, K/32], dw [N, K/32]");
  auto work = std::make_shared<Work>();
  work->xq = reinterpret_cast<const int8_t*>(xq.typed_data());
  work->dx = dx.typed_data();
  work->w = reinterpret_cast<const int8_t*>(w.typed_data());
  work->dw = dw.typed_data();
  work->y = y->typed_data();
  work->M = xd[0];
  work->N = wd[0];
  work->K = wd[1];
  work->B = B;
  work->vnni = !portable && jaxpaged::HasAvx512Vnni();
  work->num_tasks = (work->N + kColBlock - 1) / kColBlock;
  if (work->M == 0 || work->num_tasks == 0) return ffi::Error::Success();
  jaxpaged::RunTasks(pool, work, work->num_tasks);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedQ8_0Matmul, Q8_0MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()   // xq
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dx
                                  .Arg<ffi::Buffer<ffi::S8>>()   // w
                                  .Arg<ffi::Buffer<ffi::F32>>()  // dw
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Attr<bool>("portable"));
