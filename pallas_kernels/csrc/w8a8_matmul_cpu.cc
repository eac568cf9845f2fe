// The int8 dot of W8A8 for XLA on CPU (an XLA FFI custom call): int8 activations times int8
// weights summed in int32, `quantized_matmul.int8_dot`.
//
//   acc[m, n] = sum_k xq[m, k] * w[n, k]
//
// xq are the activations quantized per row (per token) by the caller, w the weights quantized
// per output channel (both symmetric, in [-127, 127]); the caller applies the scales. The sum
// is exact in int32, so it equals XLA's int8 dot bit for bit whichever path runs, and a row's
// sums do not depend on the other rows of the step.
//
// It serves the steps of one or two tokens (a decode of one sequence), where the weights are
// read once per token and memory bandwidth decides; larger steps are XLA's int8 dot, which
// quantized_matmul.py routes elsewhere. With AVX-512 VNNI (checked at run time:
// `__builtin_cpu_supports`), one `vpdpbusd` does 64 multiply-adds of u8 x s8 bytes into 16
// int32 lanes, four times a float32 FMA's 16, so the int8 weights are read at memory speed with
// no widening. Its first operand is unsigned: the weights are offset by 128 in registers
// (w ^ 0x80 == w + 128 as a u8), and 128 * sum_k xq[m, k] is subtracted from each row's sums
// at the end. Each output is a dot product along K, 64 weight bytes per instruction straight
// from memory (once for two rows of x), kGemvCols rows of w side by side, the tiles ahead
// prefetched (the hardware prefetcher does not follow short rows read side by side). Without
// VNNI the portable path computes the same int32 sums with plain loops (which the compiler
// vectorizes for the machine it builds on): the same results, slower.
//
// A task is a block of kColBlock output columns over every row of x; tasks are shared with
// XLA's intra-op thread pool.
//
// Inputs: xq s8[M, K], w s8[N, K]. Attribute `portable` (bool): take the portable path even
// where VNNI exists (tests). Output: acc s32[M, N].

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define JAXPAGED_X86 1
#define JAXPAGED_VNNI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kColBlock = 64;    // output columns per task
constexpr int64_t kGemvCols = 8;     // outputs per tile
constexpr int64_t kPrefetchTiles = 2;  // GEMV tiles prefetched ahead

bool HasVnni() {
#ifdef JAXPAGED_X86
  static const bool has = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512vnni");
  return has;
#else
  return false;
#endif
}

struct Work {
  const int8_t* xq;
  const int8_t* w;
  int32_t* y;
  int64_t M, N, K;
  bool vnni;
  std::vector<int32_t> rowsum;  // VNNI path: sum_k xq[m, k], for the offset of the weights
  int64_t num_tasks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  void Prepare() {
    if (!vnni) return;
    rowsum.assign(M, 0);
    for (int64_t m = 0; m < M; ++m) {
      int32_t s = 0;
      const int8_t* r = xq + m * K;
      for (int64_t k = 0; k < K; ++k) s += r[k];
      rowsum[m] = s;
    }
  }

  // The portable path: the same int32 sums with plain loops.
  void PortableTask(int64_t n0, int64_t n1) {
    for (int64_t m = 0; m < M; ++m) {
      const int8_t* xr = xq + m * K;
      for (int64_t n = n0; n < n1; ++n) {
        const int8_t* wr = w + n * K;
        int32_t acc = 0;
#pragma omp simd reduction(+ : acc)
        for (int64_t k = 0; k < K; ++k) acc += int32_t(xr[k]) * int32_t(wr[k]);
        y[m * N + n] = acc;
      }
    }
  }

#ifdef JAXPAGED_X86
  // acc[m .. m + R, n .. n + nc) for nc <= kGemvCols outputs, 64 bytes of K per
  // instruction, each weight vector loaded once for the R rows.
  template <int R>
  JAXPAGED_VNNI void GemvTile(int64_t m, int64_t n, int64_t nc, const int8_t* ahead,
                              int64_t ahead_bytes) {
    const int8_t* wr[kGemvCols];
    for (int64_t j = 0; j < kGemvCols; ++j) wr[j] = w + (n + std::min(j, nc - 1)) * K;
    const __m512i offset = _mm512_set1_epi8(static_cast<char>(0x80));
    __m512i acc[R][kGemvCols];
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < kGemvCols; ++j) acc[r][j] = _mm512_setzero_si512();
    const int64_t steps = std::max<int64_t>(1, (K + 63) / 64);
    const int64_t pf_step = 64 * ((ahead_bytes / 64 + steps - 1) / steps);
    int64_t pf = 0;
    for (int64_t k = 0; k < K; k += 64) {
      for (const int64_t end = std::min(ahead_bytes, pf + pf_step); pf < end; pf += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead) + pf, _MM_HINT_T0);
      const __mmask64 mask = K - k >= 64 ? ~__mmask64(0) : (__mmask64(1) << (K - k)) - 1;
      __m512i xv[R];
      for (int r = 0; r < R; ++r) xv[r] = _mm512_maskz_loadu_epi8(mask, xq + (m + r) * K + k);
      for (int j = 0; j < kGemvCols; ++j) {  // zero past K, in x and in w
        const __m512i wv = _mm512_xor_si512(_mm512_maskz_loadu_epi8(mask, wr[j] + k), offset);
        for (int r = 0; r < R; ++r) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], wv, xv[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const int32_t bias = 128 * rowsum[m + r];
      for (int64_t j = 0; j < nc; ++j)
        y[(m + r) * N + n + j] = _mm512_reduce_add_epi32(acc[r][j]) - bias;
    }
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

ffi::Error W8A8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> xq,
                          ffi::Buffer<ffi::S8> w, ffi::ResultBuffer<ffi::S32> y,
                          bool portable) {
  auto xd = xq.dimensions();
  auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument("w8a8_matmul_cpu: xq must be [M, K] and w [N, K]");
  auto work = std::make_shared<Work>();
  work->xq = reinterpret_cast<const int8_t*>(xq.typed_data());
  work->w = reinterpret_cast<const int8_t*>(w.typed_data());
  work->y = y->typed_data();
  work->M = xd[0];
  work->N = wd[0];
  work->K = wd[1];
  work->vnni = !portable && HasVnni();
  work->num_tasks = (work->N + kColBlock - 1) / kColBlock;
  if (work->M == 0 || work->num_tasks == 0) return ffi::Error::Success();
  work->Prepare();
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->num_tasks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < work->num_tasks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

// Which path `JaxpagedW8A8Matmul` takes on this CPU: "avx512-vnni" or "portable".
extern "C" const char* JaxpagedW8A8Isa() { return HasVnni() ? "avx512-vnni" : "portable"; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedW8A8Matmul, W8A8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()   // xq
                                  .Arg<ffi::Buffer<ffi::S8>>()   // w
                                  .Ret<ffi::Buffer<ffi::S32>>()  // acc
                                  .Attr<bool>("portable"));
