// Decode attention over the paged KV cache on CPU, one call per layer and step (cpu_varlen's second op).
//
// One query per sequence, at position p, sees its keys j <= p (and p - j < window), read in place through the
// sequence's block table: never gathered, so each key and value row of the step is read once per group of query
// heads that shares it. One task per (sequence, KV head): scores for every key, one softmax, then the values
// weighted by the probabilities. The step is bound by reading the cache. Float32 accumulation; bfloat16 rows are
// widened on load. Built into the same library as cpu_varlen.cpp (cpu_varlen_kernel.py).
#include "cpu_kernels.h"

namespace {

template <typename T>
struct Decode {
  const T *q, *k, *v;  // q [n, heads, D]; k and v: the cache's two halves, [blocks, block_size, kv_heads, D]
  T* out;
  int64_t q_seq, q_head, o_seq, o_head, block_stride, slot_stride, kv_head_stride;
  const int64_t *tables, *positions;
  int64_t table_stride, block_size, window;
  int D, group;
  float scale;
};

inline const float* as_float(const float* row, float*, int) { return row; }

inline const float* as_float(const at::BFloat16* row, float* buf, int D) {
  widen(row, buf, D);
  return buf;
}

inline float dot(const float* a, const float* b, int D) {
  Vec acc(0.f);
  int d = 0;
  for (; d + VL <= D; d += VL) acc = at::vec::fmadd(Vec::loadu(a + d), Vec::loadu(b + d), acc);
  float sum = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; d < D; ++d) sum += a[d] * b[d];
  return sum;
}

// acc += p * row, D floats.
inline void axpy(float p, const float* row, float* acc, int D) {
  int d = 0;
  for (; d + VL <= D; d += VL) at::vec::fmadd(Vec(p), Vec::loadu(row + d), Vec::loadu(acc + d)).store(acc + d);
  for (; d < D; ++d) acc[d] += p * row[d];
}

template <typename T>
void decode_group(const Decode<T>& pb, int64_t seq, int64_t kv_head, std::vector<float>& s, std::vector<float>& buf) {
  const int D = pb.D, G = pb.group;
  const int64_t pos = pb.positions[seq];
  const int64_t lo = pb.window > 0 ? std::max<int64_t>(0, pos - pb.window + 1) : 0;
  const int64_t n = pos + 1 - lo, padded = (n + VL - 1) / VL * VL;
  s.assign(G * padded, NEG_INF);  // padding keys score -inf: probability 0
  buf.resize(2 * G * D + D);
  float *qf = buf.data(), *acc = qf + G * D, *row = acc + G * D;
  for (int g = 0; g < G; ++g) {
    const T* qr = pb.q + seq * pb.q_seq + (kv_head * G + g) * pb.q_head;
    for (int d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(qr[d]) * pb.scale;
  }
  // f(j, offset of key j's row in either half of the cache) for j in [lo, pos], a block at a time (no division
  // per key).
  const int64_t* table = pb.tables + seq * pb.table_stride;
  auto each_key = [&](auto&& f) {
    for (int64_t j = lo; j <= pos;) {
      const int64_t block = j / pb.block_size, end = std::min(pos + 1, (block + 1) * pb.block_size);
      int64_t offset = table[block] * pb.block_stride + (j - block * pb.block_size) * pb.slot_stride +
                       kv_head * pb.kv_head_stride;
      for (; j < end; ++j, offset += pb.slot_stride) f(j, offset);
    }
  };
  each_key([&](int64_t j, int64_t offset) {
    const float* key = as_float(pb.k + offset, row, D);
    for (int g = 0; g < G; ++g) s[g * padded + (j - lo)] = dot(qf + g * D, key, D);
  });
  for (int g = 0; g < G; ++g) {
    float* sg = s.data() + g * padded;
    Vec top(NEG_INF);
    for (int64_t j = 0; j < padded; j += VL) top = at::vec::maximum(top, Vec::loadu(sg + j));
    // Finite: the query sees at least its own key.
    const Vec m(at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return at::vec::maximum(x, y); }, top));
    Vec sum(0.f);
    for (int64_t j = 0; j < padded; j += VL) {
      const Vec p = (Vec::loadu(sg + j) - m).exp_u20();
      p.store(sg + j);
      sum = sum + p;
    }
    const float inv = 1.f / at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, sum);
    for (int64_t j = 0; j < n; ++j) sg[j] *= inv;
  }
  std::fill(acc, acc + G * D, 0.f);
  each_key([&](int64_t j, int64_t offset) {
    const float* value = as_float(pb.v + offset, row, D);
    for (int g = 0; g < G; ++g) axpy(s[g * padded + (j - lo)], value, acc + g * D, D);
  });
  for (int g = 0; g < G; ++g) {
    T* out = pb.out + seq * pb.o_seq + (kv_head * G + g) * pb.o_head;
    for (int d = 0; d < D; ++d) out[d] = static_cast<T>(acc[g * D + d]);
  }
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& kv_cache, const at::Tensor& block_tables,
                        const at::Tensor& positions, int64_t window, double scale) {
  TORCH_CHECK(q.device().is_cpu() && kv_cache.device().is_cpu(), "cpu_varlen runs on CPU");
  TORCH_CHECK(q.dim() == 3 && kv_cache.dim() == 5, "q [n, heads, D], kv_cache [2, blocks, block_size, kv_heads, D]");
  TORCH_CHECK(q.scalar_type() == kv_cache.scalar_type(), "q and the cache of one dtype");
  TORCH_CHECK(q.stride(2) == 1 && kv_cache.stride(4) == 1, "head_size must be the contiguous dim");
  TORCH_CHECK(kv_cache.size(4) == q.size(2) && q.size(1) % kv_cache.size(3) == 0, "query heads in groups of KV heads");
  const at::Tensor tables = block_tables.to(at::kLong).contiguous(), pos = positions.to(at::kLong).contiguous();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == q.size(0) && pos.numel() == q.size(0), "one table, one position a query");
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  const int64_t n = q.size(0), kv_heads = kv_cache.size(3);
  auto run = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    const T* cache = kv_cache.const_data_ptr<T>();
    Decode<T> pb{q.const_data_ptr<T>(), cache, cache + kv_cache.stride(0), out.mutable_data_ptr<T>(), q.stride(0),
                 q.stride(1), out.stride(0), out.stride(1), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
                 tables.const_data_ptr<int64_t>(), pos.const_data_ptr<int64_t>(), tables.size(1), kv_cache.size(2),
                 window, static_cast<int>(q.size(2)), static_cast<int>(q.size(1) / kv_heads), static_cast<float>(scale)};
    // One task per (sequence, KV head); sequences differ in length. Scratch: scores, then queries and sums.
    run_tasks(
        n * kv_heads, [] { return std::pair<std::vector<float>, std::vector<float>>(); },
        [&](int64_t i, auto& scratch) { decode_group(pb, i / kv_heads, i % kv_heads, scratch.first, scratch.second); });
  };
  dispatch_float_or_bf16(q.scalar_type(), run);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(embedserv_cpu_varlen, m) {
  m.def("paged_decode(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor positions, int window, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(embedserv_cpu_varlen, CPU, m) { m.impl("paged_decode", &paged_decode); }
