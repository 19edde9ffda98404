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

}  // namespace
