// What the C++ kernels share: the run-time check for AVX-512 VNNI, and running a kernel's
// tasks on XLA's intra-op thread pool.

#ifndef JAXPAGED_CPU_TASKS_H_
#define JAXPAGED_CPU_TASKS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace jaxpaged {

// Whether this CPU has AVX-512 F, BW, VL and VNNI (`__builtin_cpu_supports`, checked once).
inline bool HasAvx512Vnni() {
#if defined(__x86_64__)
  static const bool has = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512vnni");
  return has;
#else
  return false;
#endif
}

// Runs `work->Run()` on the calling thread and on up to `pool.num_threads() - 1` helpers, and
// returns once `work->done` counts `num_tasks`. `Work::Run` takes tasks from a shared counter
// until none is left and adds one to `done` (memory_order_release) after each; the helpers
// hold `work` alive until they return.
template <class Work>
void RunTasks(xla::ffi::ThreadPool& pool, const std::shared_ptr<Work>& work,
              int64_t num_tasks) {
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), num_tasks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Run(); });
  work->Run();
  while (work->done.load(std::memory_order_acquire) < num_tasks) std::this_thread::yield();
}

}  // namespace jaxpaged

#endif  // JAXPAGED_CPU_TASKS_H_
