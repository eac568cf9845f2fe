// W8A8 for XLA on CPU (XLA FFI custom calls), two targets on one GEMM:
//
//   JaxpagedW8A8Matmul     int8 activations times int8 weights summed in int32
//                          (`quantized_matmul.int8_dot_kernel`): acc[m, n] = sum_k xq[m, k] w[n, k]
//   JaxpagedW8A8MatmulF32  the whole product (`quantized_matmul.w8a8_matmul_kernel`): float
//                          activations quantized here into `terms` int8 terms per row
//                          (`QuantizeRows`), the GEMM, the sums scaled by the activations' and
//                          the weights' scales and the terms added (`ScaleSums`): one call in
//                          place of a dozen small XLA ops around an int8 dot.
//
// Activations and weights are symmetric int8 in [-127, 127], per row and per output channel.
// The sum is exact in int32, so it equals XLA's int8 dot bit for bit whichever path runs, and
// a row's sums do not depend on the other rows of the step; `QuantizeRows` and `ScaleSums`
// repeat XLA's float operations in XLA's order, so the whole product equals XLA's too.
//
// The weights come packed once, at load time (`quantized_matmul.pack_int8`), in panels of 16
// output channels, four consecutive k of each channel side by side:
//
//   wp[p, k4, j, i] = w[16 p + j, 4 k4 + i]      (zero past N or K)
//
// so one 64-byte load holds 4 k of 16 channels, the operand layout of AVX-512 VNNI's
// `vpdpbusd`, which multiplies 4 u8 x s8 byte pairs into each of 16 int32 lanes (64
// multiply-adds, four times a float32 FMA's 16). Each activation row's 4 bytes at k4 are
// broadcast to all lanes, so a tile of up to kRows rows x 2 panels keeps 12 accumulators in
// registers and reads each weight vector once per tile: a GEMM for prefill and batched
// decode; one or two rows take 4 panels at a time (a GEMV streaming 4 weight panels). vpdpbusd's
// first operand is unsigned: the activations are offset by 128 (as u8, x + 128, in a buffer
// the calling thread keeps) and 128 * wsum[n] (wsum[n] = sum_k w[n, k], computed when
// packing) is subtracted from each sum at the end.
//
// VNNI is checked at run time (`__builtin_cpu_supports`); without it the portable path
// computes the same int32 sums with plain loops (which the compiler vectorizes for the machine
// it builds on): the same results, slower.
//
// A task is a group of kGroupPanels panels over a block of kRowBlock rows; tasks are shared
// with XLA's intra-op thread pool.
//
// Inputs: xq s8[M, K] (the whole product: x f32[M, K]), wp s8[P, K4, 16, 4] with
// P = ceil(N / 16) and K4 = ceil(K / 4), wsum s32[16 P] (the whole product: and scale f32[N]).
// Attributes: `portable` (bool): take the portable path even where VNNI exists (tests);
// `terms` (the whole product; 1 or 2). Output: acc s32[M, N], or y f32[M, N] (N from its
// shape, 16 (P - 1) < N <= 16 P).

#include <algorithm>
#include <cmath>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <new>
#include <string>
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

constexpr int64_t kPanel = 16;       // output channels per panel
constexpr int64_t kRows = 6;         // activation rows per tile
constexpr int64_t kGroupPanels = 4;  // panels per task
constexpr int64_t kRowBlock = 48;    // rows per task

// max_k |x[k]| (exact in any order, so left to -ffast-math's vectorized reduction).
__attribute__((noinline)) float RowAbsMax(const float* x, int64_t K) {
  float amax = 0.0f;
  for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  return amax;
}

// The library is built with -ffast-math; the two functions below must compute exactly what
// XLA computes (IEEE operations in the order written; -ffast-math would, for one, turn
// 1 / (amax * (1 / 127)) into 127 / amax), so they are compiled without it.
#if defined(__clang__)
#pragma float_control(precise, on, push)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("no-fast-math", "no-math-errno", "no-trapping-math")
#endif

// The activations of the whole product (`W8A8MatmulF32Impl`) as `terms` int8 terms per row,
// as `quantized_matmul.quantize_activations` computes them in XLA: term 0 of a row is
// symmetric per row, s = max|x| * (1 / 127) (1 where the row is zero), q = clip(rint(x / s),
// -127, 127) with the division taken as x * (1 / s); each further term quantizes the same way
// what the terms before it leave, x - q * s (one FMA; `rest`: f32[K] room for it). Row m's
// term t goes to row m * terms + t of q (s8[M * terms, K]) and s (f32[M * terms]). Not
// inlined, so that every path runs the same instructions and gets the same bits.
__attribute__((noinline)) void QuantizeRows(const float* x, int64_t M, int64_t K, int64_t terms,
                                            int8_t* q, float* s, float* rest) {
  for (int64_t m = 0; m < M; ++m) {
    const float* src = x + m * K;
    for (int64_t t = 0; t < terms; ++t) {
      const float amax = RowAbsMax(src, K);
      const float scale = amax > 0.0f ? amax * (1.0f / 127.0f) : 1.0f;
      const float inv = 1.0f / scale;
      int8_t* row = q + (m * terms + t) * K;
      for (int64_t k = 0; k < K; ++k) {
        const float r = __builtin_rintf(src[k] * inv);
        const float v = r < -127.0f ? -127.0f : r > 127.0f ? 127.0f : r;
        row[k] = static_cast<int8_t>(v);
        rest[k] = __builtin_fmaf(-v, scale, src[k]);
      }
      s[m * terms + t] = scale;
      src = rest;
    }
  }
}

// y[m, n] for rows [m0, m1) of the activations and columns [n0, n1): the terms' int32 sums
// (acc, row m's term t at row m * terms + t) scaled, sum_t float(acc_t) * (s_t * scale[n]),
// as XLA computes `quantized_matmul.w8a8_matmul`: the last term's product, then each term
// before it added by one FMA (the same bits as XLA's path). Not inlined, like `QuantizeRows`.
__attribute__((noinline)) void ScaleSums(const int32_t* acc, const float* s, const float* scale,
                                         float* y, int64_t N, int64_t terms, int64_t m0,
                                         int64_t m1, int64_t n0, int64_t n1) {
  for (int64_t m = m0; m < m1; ++m) {
    const int32_t* last = acc + (m * terms + terms - 1) * N;
    const float s_last = s[m * terms + terms - 1];
    float* row = y + m * N;
    for (int64_t n = n0; n < n1; ++n) row[n] = float(last[n]) * (s_last * scale[n]);
    for (int64_t t = terms - 2; t >= 0; --t) {
      const int32_t* a = acc + (m * terms + t) * N;
      const float st = s[m * terms + t];
      for (int64_t n = n0; n < n1; ++n) row[n] = __builtin_fmaf(float(a[n]), st * scale[n], row[n]);
    }
  }
}

#if defined(__clang__)
#pragma float_control(pop)
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

// Buffers up to this size are kept by the calling thread from call to call (`Scratch`).
constexpr int64_t kKeptScratchBytes = int64_t(8) << 20;

// Room for n T's: a buffer the calling thread keeps from call to call (the kernel's scratch:
// its helpers use it only while the call waits for them; `Slot` tells apart the buffers of one
// type), or for more than kKeptScratchBytes, `owned`, which the call's `Work` frees.
template <class T, int Slot>
T* Scratch(int64_t n, std::vector<T>& owned) {
  if (n * int64_t(sizeof(T)) > kKeptScratchBytes) {
    owned.resize(n);
    return owned.data();
  }
  thread_local std::vector<T> buffer;
  if (int64_t(buffer.size()) < n) buffer.resize(n);
  return buffer.data();
}

struct Work {
  const int8_t* xq;   // the quantized rows: the caller's, or `q` (the whole product)
  const int8_t* wp;
  const int32_t* wsum;
  int32_t* acc;       // int32 sums of every quantized row: the output, or scratch
  int64_t M, N, K, P, K4;  // M: quantized rows (terms per activation row in the product)
  bool vnni;
  uint8_t* xu = nullptr;  // VNNI path: xq + 128 as u8, rows of 4 * K4 bytes (128 past K)
  int64_t row_blocks, num_tasks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
  // The whole W8A8 product only (`W8A8MatmulF32Impl`): float activations in, float out.
  const float* scale = nullptr;  // f32[N] per-output weight scales
  float* y = nullptr;            // f32[M / terms, N]
  int64_t terms = 1;
  int8_t* q = nullptr;    // the activations' terms, row m's term t at row m * terms + t
  float* sx = nullptr;    // their scales
  // Scratch too large to keep (`Scratch`), freed with the call's Work.
  std::vector<uint8_t> owned_xu;
  std::vector<int8_t> owned_q;
  std::vector<float> owned_sx, owned_rest;
  std::vector<int32_t> owned_acc;

  void Prepare() {
    if (!vnni) return;
    xu = Scratch<uint8_t, 0>(M * K4 * 4, owned_xu);
    for (int64_t m = 0; m < M; ++m) {
      uint8_t* row = xu + m * K4 * 4;
      for (int64_t k = 0; k < K; ++k) row[k] = static_cast<uint8_t>(int32_t(xq[m * K + k]) + 128);
      std::fill(row + K, row + K4 * 4, uint8_t(128));
    }
  }

  // The whole product: quantizes the activations x f32[M / terms, K] and keeps their sums.
  void QuantizeActivations(const float* x) {
    q = Scratch<int8_t, 1>(M * K, owned_q);
    sx = Scratch<float, 2>(M, owned_sx);
    acc = Scratch<int32_t, 3>(M * N, owned_acc);
    QuantizeRows(x, M / terms, K, terms, q, sx, Scratch<float, 4>(K, owned_rest));
    xq = q;
  }

  // The whole product: y for quantized rows [m0, m1) (whole activation rows: kRowBlock is a
  // multiple of terms) and panels [p0, p1).
  void Scale(int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
    ScaleSums(acc, sx, scale, y, N, terms, m0 / terms, m1 / terms, p0 * kPanel,
              std::min(N, p1 * kPanel));
  }

  // The portable path: the same int32 sums with plain loops.
  void PortableTask(int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
    int32_t sum[kPanel];
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t p = p0; p < p1; ++p) {
        std::fill(sum, sum + kPanel, 0);
        const int8_t* panel = wp + p * K4 * kPanel * 4;
        for (int64_t k = 0; k < K; ++k) {
          const int32_t x = xq[m * K + k];
          const int8_t* wk = panel + (k / 4) * kPanel * 4 + k % 4;
          for (int64_t j = 0; j < kPanel; ++j) sum[j] += x * int32_t(wk[4 * j]);
        }
        for (int64_t j = 0; j < kPanel && p * kPanel + j < N; ++j)
          acc[m * N + p * kPanel + j] = sum[j];
      }
  }

#ifdef JAXPAGED_X86
  // acc[m0 .. m0 + R, panels p0 .. p0 + NP): R rows x NP panels of 16 channels.
  template <int R, int NP>
  JAXPAGED_VNNI void Tile(int64_t m0, int64_t p0) {
    const int8_t* panel[NP];
    for (int q = 0; q < NP; ++q) panel[q] = wp + (p0 + q) * K4 * kPanel * 4;
    const uint8_t* xr[R];
    for (int r = 0; r < R; ++r) xr[r] = xu + (m0 + r) * K4 * 4;
    __m512i sum[R][NP];
    for (int r = 0; r < R; ++r)
      for (int q = 0; q < NP; ++q) sum[r][q] = _mm512_setzero_si512();
    for (int64_t k4 = 0; k4 < K4; ++k4) {
      __m512i wv[NP];
      for (int q = 0; q < NP; ++q) wv[q] = _mm512_loadu_si512(panel[q] + k4 * kPanel * 4);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xr[r] + 4 * k4, 4);
        const __m512i xb = _mm512_set1_epi32(four);
        for (int q = 0; q < NP; ++q) sum[r][q] = _mm512_dpbusd_epi32(sum[r][q], xb, wv[q]);
      }
    }
    for (int q = 0; q < NP; ++q) {
      const int64_t n0 = (p0 + q) * kPanel;
      const __mmask16 mask = N - n0 >= kPanel ? __mmask16(0xFFFF)
                                              : __mmask16((1u << (N - n0)) - 1);
      const __m512i offset = _mm512_slli_epi32(_mm512_loadu_si512(wsum + n0), 7);
      for (int r = 0; r < R; ++r)
        _mm512_mask_storeu_epi32(acc + (m0 + r) * N + n0, mask,
                                 _mm512_sub_epi32(sum[r][q], offset));
    }
  }

  template <int NP>
  void Rows(int64_t m0, int64_t rows, int64_t p0) {
    switch (rows) {
      case 1: Tile<1, NP>(m0, p0); break;
      case 2: Tile<2, NP>(m0, p0); break;
      case 3: Tile<3, NP>(m0, p0); break;
      case 4: Tile<4, NP>(m0, p0); break;
      case 5: Tile<5, NP>(m0, p0); break;
      default: Tile<6, NP>(m0, p0); break;
    }
  }

  void VnniTask(int64_t m0, int64_t m1, int64_t p0, int64_t p1) {
    if (m1 - m0 <= 2) {  // a GEMV: four weight streams at a time
      int64_t p = p0;
      for (; p + 4 <= p1; p += 4) m1 - m0 == 1 ? Tile<1, 4>(m0, p) : Tile<2, 4>(m0, p);
      for (; p < p1; ++p) m1 - m0 == 1 ? Tile<1, 1>(m0, p) : Tile<2, 1>(m0, p);
      return;
    }
    for (int64_t p = p0; p < p1; p += 2)  // a panel pair stays in cache over the rows
      for (int64_t m = m0; m < m1; m += kRows) {
        const int64_t rows = std::min(kRows, m1 - m);
        if (p + 1 < p1)
          Rows<2>(m, rows, p);
        else
          Rows<1>(m, rows, p);
      }
  }
#endif

  void Run() {
    for (int64_t t; (t = next.fetch_add(1)) < num_tasks;) {
      const int64_t g = t / row_blocks, b = t % row_blocks;
      const int64_t p0 = g * kGroupPanels, p1 = std::min(P, p0 + kGroupPanels);
      const int64_t m0 = b * kRowBlock, m1 = std::min(M, m0 + kRowBlock);
#ifdef JAXPAGED_X86
      if (vnni)
        VnniTask(m0, m1, p0, p1);
      else
#endif
        PortableTask(m0, m1, p0, p1);
      if (y != nullptr) Scale(m0, m1, p0, p1);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Checks the packed weights against K input features and N outputs and sets `work` up for M
// quantized rows; an error names the expected shapes.
ffi::Error Setup(Work& work, const char* name, ffi::Buffer<ffi::S8>& wp,
                 ffi::Buffer<ffi::S32>& wsum, int64_t M, int64_t K, int64_t N, bool portable) {
  auto wd = wp.dimensions();
  if (wd.size() != 4 || wd[2] != kPanel || wd[3] != 4 || wd[1] != (K + 3) / 4 ||
      (N + kPanel - 1) / kPanel != wd[0] || wsum.element_count() != wd[0] * kPanel)
    return ffi::Error::InvalidArgument(
        std::string(name) + ": for x [M, K] and outputs [M, N], wp must be "
        "[ceil(N/16), ceil(K/4), 16, 4] and wsum [16 ceil(N/16)]");
  work.wp = reinterpret_cast<const int8_t*>(wp.typed_data());
  work.wsum = wsum.typed_data();
  work.M = M;
  work.K = K;
  work.N = N;
  work.P = wd[0];
  work.K4 = wd[1];
  work.vnni = !portable && jaxpaged::HasAvx512Vnni();
  work.row_blocks = (M + kRowBlock - 1) / kRowBlock;
  work.num_tasks = (work.P + kGroupPanels - 1) / kGroupPanels * work.row_blocks;
  return ffi::Error::Success();
}

// Quantizes the activations x (the whole product; null: the int8 product alone), then runs
// the tasks; a scratch buffer that cannot be had is an error, not a crash.
ffi::Error Run(ffi::ThreadPool& pool, const std::shared_ptr<Work>& work, const float* x) {
  try {
    if (x != nullptr) work->QuantizeActivations(x);
    work->Prepare();
  } catch (const std::bad_alloc&) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                      "w8a8_matmul_cpu: out of memory for the activations' scratch");
  }
  jaxpaged::RunTasks(pool, work, work->num_tasks);
  return ffi::Error::Success();
}

// The int8 product alone: acc s32[M, N] = xq s8[M, K] times the packed weights.
ffi::Error W8A8MatmulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> xq,
                          ffi::Buffer<ffi::S8> wp, ffi::Buffer<ffi::S32> wsum,
                          ffi::ResultBuffer<ffi::S32> acc, bool portable) {
  auto xd = xq.dimensions();
  auto ad = acc->dimensions();
  if (xd.size() != 2 || ad.size() != 2 || ad[0] != xd[0])
    return ffi::Error::InvalidArgument("w8a8_matmul_cpu: xq must be [M, K], acc [M, N]");
  auto work = std::make_shared<Work>();
  if (auto e = Setup(*work, "w8a8_matmul_cpu", wp, wsum, xd[0], xd[1], ad[1], portable);
      e.failure())
    return e;
  work->xq = reinterpret_cast<const int8_t*>(xq.typed_data());
  work->acc = acc->typed_data();
  if (work->M == 0 || work->num_tasks == 0) return ffi::Error::Success();
  return Run(pool, work, nullptr);
}

// The whole W8A8 product: y f32[M, N] from x f32[M, K] (quantized here as `terms` int8 terms
// per row), the packed weights and their scales f32[N].
ffi::Error W8A8MatmulF32Impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                             ffi::Buffer<ffi::S8> wp, ffi::Buffer<ffi::S32> wsum,
                             ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y,
                             int32_t terms, bool portable) {
  auto xd = x.dimensions();
  auto yd = y->dimensions();
  if (xd.size() != 2 || yd.size() != 2 || yd[0] != xd[0] || scale.element_count() != yd[1] ||
      (terms != 1 && terms != 2))
    return ffi::Error::InvalidArgument(
        "w8a8_matmul_f32_cpu: x must be [M, K], scale [N], y [M, N] and terms 1 or 2");
  auto work = std::make_shared<Work>();
  if (auto e = Setup(*work, "w8a8_matmul_f32_cpu", wp, wsum, xd[0] * terms, xd[1], yd[1],
                     portable);
      e.failure())
    return e;
  work->terms = terms;
  work->scale = scale.typed_data();
  work->y = y->typed_data();
  if (work->M == 0 || work->num_tasks == 0) return ffi::Error::Success();
  return Run(pool, work, x.typed_data());
}

}  // namespace

// Which path `JaxpagedW8A8Matmul` takes on this CPU: "avx512-vnni" or "portable".
extern "C" const char* JaxpagedW8A8Isa() {
  return jaxpaged::HasAvx512Vnni() ? "avx512-vnni" : "portable";
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedW8A8Matmul, W8A8MatmulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()   // xq
                                  .Arg<ffi::Buffer<ffi::S8>>()   // wp
                                  .Arg<ffi::Buffer<ffi::S32>>()  // wsum
                                  .Ret<ffi::Buffer<ffi::S32>>()  // acc
                                  .Attr<bool>("portable"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedW8A8MatmulF32, W8A8MatmulF32Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x
                                  .Arg<ffi::Buffer<ffi::S8>>()   // wp
                                  .Arg<ffi::Buffer<ffi::S32>>()  // wsum
                                  .Arg<ffi::Buffer<ffi::F32>>()  // scale
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y
                                  .Attr<int32_t>("terms")
                                  .Attr<bool>("portable"));
