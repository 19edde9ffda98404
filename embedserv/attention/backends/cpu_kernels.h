// What cpu_varlen.cpp and cpu_paged_decode.cpp share: at::vec's float vectors for this build's CPU_CAPABILITY,
// and widening bfloat16 rows to float32 (both kernels accumulate in float32).
#pragma once

// The tensor and at::empty alone, not all of ATen: each source compiles in a third less time.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <utility>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int VL = Vec::size();
constexpr float NEG_INF = -std::numeric_limits<float>::infinity();

template <typename T>
inline void widen(const T* src, float* dst, int n) {
  for (int i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// bfloat16 a whole vector at a time: a decode widens every key and value row it reads, and the scalar loop of
// casts cost more than the products (one sequence of 1,000-2,000 keys, 32 / 8 heads of 64: 1.4x float32's time).
inline void widen(const at::BFloat16* src, float* dst, int n) {
  using BVec = at::vec::Vectorized<at::BFloat16>;
  int i = 0;
  for (; i + BVec::size() <= n; i += BVec::size()) {
    auto [lo, hi] = at::vec::convert_bfloat16_float(BVec::loadu(src + i));
    lo.store(dst + i);
    hi.store(dst + i + Vec::size());
  }
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// f(T*{}) with T = float or at::BFloat16, as `dtype` says; any other dtype is refused.
template <typename F>
inline void dispatch_float_or_bf16(at::ScalarType dtype, F&& f) {
  if (dtype == at::kFloat) {
    f(static_cast<float*>(nullptr));
  } else {
    TORCH_CHECK(dtype == at::kBFloat16, "cpu_varlen runs float32 and bfloat16");
    f(static_cast<at::BFloat16*>(nullptr));
  }
}

// task(i, scratch) for every i in [0, n) on torch's threads, each thread taking the next task as it finishes one
// (tasks differ in length); a thread makes its scratch once, with make_scratch().
template <typename MakeScratch, typename Task>
inline void run_tasks(int64_t n, MakeScratch&& make_scratch, Task&& task) {
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) {
    auto scratch = make_scratch();
    for (int64_t i = next++; i < n; i = next++) task(i, scratch);
  });
}

}  // namespace
