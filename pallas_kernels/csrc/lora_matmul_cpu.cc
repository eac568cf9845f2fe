// LoRA adapters' products for XLA on CPU (an XLA FFI custom call): `lora_matmul.lora_matmul`,
// each token through its own adapter only (S-LoRA's and Punica's "shrink" and "expand").
//
// The jnp path (`lora_matmul_reference`) multiplies every token by every slot's A and then masks
// the slots the token does not use, max_loras times the products needed. Here the tokens are
// grouped by slot first (a counting sort of `slots`), and each slot's rows go through that
// slot's adapter alone, in register tiles of up to kTileRows rows sharing its weights:
//
// - shrink: h = x_rows @ A[s], f32[rows, P * R] (every part at once: they read the same x);
// - expand: y_rows[:, off_p : off_p + O_p] = h[:, p * R : (p + 1) * R] @ B_p[s], part by part.
//
// A task is one register tile of rows of one slot: its shrink, then its expand, so h stays in
// the task's small buffer (L1). A tile is R rows by up to 64 columns (NV vectors of 16, those
// past the width masked off, so any width works) and walks the reduction axis, broadcasting one
// x value against the NV weight vectors of that row of the weight. The tiles of a slot read its
// A and B from L2 after the first. Rows whose slot is not in 1..S (0: no adapter) are zeros.
//
// Inputs: x f32[T, I], slots i32[T], a f32[S, I, P * R], then P buffers b_p f32[S, R, O_p].
// Output: y f32[T, O_0 + ... + O_{P-1}], the parts side by side.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#define JAXPAGED_AVX512 1
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kTileRows = 6;   // rows per register tile (6 x 4 accumulators at most)
constexpr int64_t kCols = 64;  // columns per register tile (4 vectors of 16)
constexpr int kMaxVectors = 4;

// y[r][y0 + c] = sum_k x[r][k] * w[k * ldw + c] for the R rows and c < cols (1..64, in NV
// vectors of 16): `w` points at the tile's first column of the weight's row 0.
template <int R, int NV>
void Tile(const float* const* x, int64_t K, const float* w, int64_t ldw, int64_t cols,
          float* const* y, int64_t y0) {
#ifdef JAXPAGED_AVX512
  // Every loop over r and v unrolled up front, so that GCC keeps acc in registers.
  __mmask16 mask[NV];
#pragma GCC unroll 4
  for (int v = 0; v < NV; ++v) {
    const int64_t left = cols - 16 * v;  // at least 1: NV vectors cover cols
    mask[v] = left >= 16 ? static_cast<__mmask16>(0xFFFF)
                         : static_cast<__mmask16>((1u << left) - 1);
  }
  __m512 acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* wk = w + k * ldw;
    __m512 wv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) wv[v] = _mm512_maskz_loadu_ps(mask[v], wk + 16 * v);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const __m512 xb = _mm512_set1_ps(x[r][k]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_fmadd_ps(xb, wv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) _mm512_mask_storeu_ps(y[r] + y0 + 16 * v, mask[v], acc[r][v]);
#else
  float acc[R][kCols] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r) {
      const float xv = x[r][k];
      const float* wk = w + k * ldw;
#pragma omp simd
      for (int64_t j = 0; j < cols; ++j) acc[r][j] += xv * wk[j];
    }
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < cols; ++j) y[r][y0 + j] = acc[r][j];
#endif
}

using TileFn = void (*)(const float* const*, int64_t, const float*, int64_t, int64_t,
                        float* const*, int64_t);

#define JAXPAGED_TILES(R) {Tile<R, 1>, Tile<R, 2>, Tile<R, 3>, Tile<R, 4>}
// The tile for (rows - 1, vectors - 1).
constexpr TileFn kTiles[kTileRows][kMaxVectors] = {
    JAXPAGED_TILES(1), JAXPAGED_TILES(2), JAXPAGED_TILES(3),
    JAXPAGED_TILES(4), JAXPAGED_TILES(5), JAXPAGED_TILES(6)};
#undef JAXPAGED_TILES

// y[r][y0 + c] = (x[r] @ w)[c] for c < N: w is f32[K, N] with rows ldw apart.
void RowsMatmul(int rows, const float* const* x, int64_t K, const float* w, int64_t ldw,
                int64_t N, float* const* y, int64_t y0) {
  for (int64_t c = 0; c < N; c += kCols) {
    const int64_t cols = std::min(kCols, N - c);
    kTiles[rows - 1][(cols + 15) / 16 - 1](x, K, w + c, ldw, cols, y, y0 + c);
  }
}

struct Task {
  int32_t slot;   // 1..S
  int32_t start;  // first of its rows in `order`
  int32_t rows;   // 1..kTileRows
};

struct Work {
  const float* x;
  const float* a;
  std::vector<const float*> b;     // each part's B
  std::vector<int64_t> width;      // O_p
  std::vector<int64_t> offset;     // first output column of part p
  float* y;
  int64_t I, R, P, N;              // input width, rank, parts, output width
  std::vector<int32_t> order;      // the rows grouped by slot
  std::vector<Task> tasks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};

  // One tile: h = x_rows @ A[s] into `h` (f32[rows, P * R]), then each part's h_p @ B_p[s].
  void RunTask(const Task& t, float* h) const {
    const float* xr[kTileRows];
    float* hr[kTileRows];
    float* yr[kTileRows];
    for (int i = 0; i < t.rows; ++i) {
      const int64_t row = order[t.start + i];
      xr[i] = x + row * I;
      hr[i] = h + i * P * R;
      yr[i] = y + row * N;
    }
    const int64_t s = t.slot - 1;
    RowsMatmul(t.rows, xr, I, a + s * I * P * R, P * R, P * R, hr, 0);
    for (int64_t p = 0; p < P; ++p) {
      const float* hp[kTileRows];
      for (int i = 0; i < t.rows; ++i) hp[i] = hr[i] + p * R;
      RowsMatmul(t.rows, hp, R, b[p] + s * R * width[p], width[p], width[p], yr, offset[p]);
    }
  }

  void Run() {
    std::vector<float> h(kTileRows * P * R);
    for (int64_t t; (t = next.fetch_add(1)) < static_cast<int64_t>(tasks.size());) {
      RunTask(tasks[t], h.data());
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

// Groups the rows by slot (`order`: slot 0's and out-of-range rows first, then slot 1's, ...)
// and cuts each slot's rows into tiles of near-equal size, at most kTileRows each. Returns how
// many rows have no adapter (the first ones of `order`).
int64_t Plan(const int32_t* slots, int64_t T, int64_t S, Work& work) {
  std::vector<int64_t> start(S + 2, 0);
  auto group = [S](int32_t s) { return (s >= 1 && s <= S) ? s : 0; };
  for (int64_t t = 0; t < T; ++t) ++start[group(slots[t]) + 1];
  for (int64_t g = 0; g <= S; ++g) start[g + 1] += start[g];
  work.order.resize(T);
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t t = 0; t < T; ++t) work.order[fill[group(slots[t])]++] = static_cast<int32_t>(t);
  for (int64_t g = 1; g <= S; ++g) {
    const int64_t n = start[g + 1] - start[g];
    const int64_t tiles = (n + kTileRows - 1) / kTileRows;
    for (int64_t i = 0, first = start[g]; i < tiles; ++i) {
      const int64_t rows = n / tiles + (i < n % tiles ? 1 : 0);
      work.tasks.push_back({static_cast<int32_t>(g), static_cast<int32_t>(first),
                            static_cast<int32_t>(rows)});
      first += rows;
    }
  }
  return start[1];
}

// Reads the shapes into `work`; an error names what does not fit.
ffi::Error Check(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> slots,
                 ffi::Buffer<ffi::F32> a, ffi::RemainingArgs bs, Work& work, int64_t y_cols) {
  auto xd = x.dimensions();
  auto ad = a.dimensions();
  const int64_t P = static_cast<int64_t>(bs.size());
  if (xd.size() != 2 || slots.dimensions().size() != 1 || slots.dimensions()[0] != xd[0] ||
      ad.size() != 3 || ad[1] != xd[1] || P == 0 || ad[2] % P != 0)
    return ffi::Error::InvalidArgument(
        "lora_matmul_cpu: x must be [T, I], slots [T], a [S, I, P * R] with P >= 1 B's");
  work.I = xd[1];
  work.P = P;
  work.R = ad[2] / P;
  work.N = 0;
  for (int64_t p = 0; p < P; ++p) {
    auto b = bs.get<ffi::Buffer<ffi::F32>>(p);
    if (!b.has_value()) return b.error();
    auto bd = b->dimensions();
    if (bd.size() != 3 || bd[0] != ad[0] || bd[1] != work.R)
      return ffi::Error::InvalidArgument("lora_matmul_cpu: each b must be [S, R, O_p]");
    work.b.push_back(b->typed_data());
    work.width.push_back(bd[2]);
    work.offset.push_back(work.N);
    work.N += bd[2];
  }
  if (y_cols != work.N)
    return ffi::Error::InvalidArgument("lora_matmul_cpu: y must be [T, O_0 + ... + O_{P-1}]");
  return ffi::Error::Success();
}

ffi::Error LoraMatmul(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S32> slots,
                      ffi::Buffer<ffi::F32> a, ffi::RemainingArgs bs,
                      ffi::ResultBuffer<ffi::F32> y) {
  auto work = std::make_shared<Work>();
  auto yd = y->dimensions();
  if (yd.size() != 2 || yd[0] != x.dimensions()[0])
    return ffi::Error::InvalidArgument("lora_matmul_cpu: y must be [T, sum of O_p]");
  if (auto error = Check(x, slots, a, bs, *work, yd[1]); error.failure()) return error;
  const int64_t T = yd[0];
  work->x = x.typed_data();
  work->a = a.typed_data();
  work->y = y->typed_data();
  const int64_t plain = Plan(slots.typed_data(), T, a.dimensions()[0], *work);
  const int64_t num_tasks = static_cast<int64_t>(work->tasks.size());
  const int64_t helpers = std::max<int64_t>(
      0, std::min<int64_t>(pool.num_threads(), num_tasks) - 1);
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Run(); });
  for (int64_t i = 0; i < plain; ++i)  // rows of no adapter, while the helpers start
    std::memset(work->y + work->order[i] * work->N, 0, sizeof(float) * work->N);
  work->Run();
  while (work->done.load(std::memory_order_acquire) < num_tasks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxpagedLoraMatmul, LoraMatmul,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()  // x [T, I]
                                  .Arg<ffi::Buffer<ffi::S32>>()  // slots [T]
                                  .Arg<ffi::Buffer<ffi::F32>>()  // a [S, I, P * R]
                                  .RemainingArgs()               // b_p [S, R, O_p], P of them
                                  .Ret<ffi::Buffer<ffi::F32>>()  // y [T, sum of O_p]
);
