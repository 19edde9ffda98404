// Varlen attention on CPU for short heads: packed [tokens, heads, head_size] q/k/v and cu_seqlens, one call.
//
// Queries run in vector lanes: a tile of up to MAX_QV vectors of queries is transposed once into
// [head_size][lanes], and every product is a broadcast of one key (or value) element times a vector of
// queries. Scores land as [key][query lane], so the online softmax (flash-style, over blocks of KEY_BLOCK
// keys) takes its maxima and sums across keys vector by vector, with no horizontal reduction; and the output
// accumulates as [head_size][query lane]. A short head (32) costs nothing extra: head_size is the loop length,
// not a vector width. Built by attention/backends/cpu_varlen_kernel.py with CPU_CAPABILITY set to AVX512,
// AVX2 or DEFAULT: at::vec::Vectorized gives each its vector width from this one source.
//
// Queries are the last len_q of their sequence's len_k positions (self-attention: len_q == len_k); the query at
// position p sees the key at j when j <= p (causal) and |p - j| < window (window > 0). Accumulation in float32;
// bfloat16 inputs are widened on load, the output rounded once.
#include "cpu_kernels.h"

namespace {

// Query vectors per tile: keys x vectors accumulators plus the loads fit the vector registers (32 on
// AVX-512, 16 on AVX2).
constexpr int MAX_QV = VL >= 16 ? 4 : 3;
constexpr int QT = MAX_QV * VL;  // queries per tile (the row length of every tile buffer)
constexpr int KEY_BLOCK = 128;
constexpr int KR = 4;  // keys per score step
constexpr int DR = 4;  // head dimensions per output step
constexpr int MAX_TILES = 4;  // tiles per task when there are enough tasks

// s[j][v] = sum_d k[j][d] * qt[d][v], NK keys (rows of k at stride ldk) by NV query vectors.
template <int NK, int NV>
inline void score_step(const float* k, int64_t ldk, const float* qt, int D, float* s) {
  Vec acc[NK][NV];
  for (int j = 0; j < NK; ++j)
    for (int v = 0; v < NV; ++v) acc[j][v] = Vec(0.f);
  for (int d = 0; d < D; ++d) {
    Vec q[NV];
    for (int v = 0; v < NV; ++v) q[v] = Vec::loadu(qt + d * QT + v * VL);
    for (int j = 0; j < NK; ++j) {
      Vec kd(k[j * ldk + d]);
      for (int v = 0; v < NV; ++v) acc[j][v] = at::vec::fmadd(kd, q[v], acc[j][v]);
    }
  }
  for (int j = 0; j < NK; ++j)
    for (int v = 0; v < NV; ++v) acc[j][v].store(s + j * QT + v * VL);
}

template <int NV>
void scores(const float* k, int64_t ldk, int nk, const float* qt, int D, float* s) {
  int j = 0;
  for (; j + KR <= nk; j += KR) score_step<KR, NV>(k + j * ldk, ldk, qt, D, s + j * QT);
  switch (nk - j) {
    case 3: score_step<3, NV>(k + j * ldk, ldk, qt, D, s + j * QT); break;
    case 2: score_step<2, NV>(k + j * ldk, ldk, qt, D, s + j * QT); break;
    case 1: score_step<1, NV>(k + j * ldk, ldk, qt, D, s + j * QT); break;
    default: break;
  }
}

// ot[d][v] += sum_j val[j][d] * p[j][v] for ND dimensions from d0, NV query vectors.
template <int ND, int NV>
inline void value_step(const float* val, int64_t ldv, int nk, const float* p, int d0, float* ot) {
  Vec acc[ND][NV];
  for (int i = 0; i < ND; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = Vec::loadu(ot + (d0 + i) * QT + v * VL);
  for (int j = 0; j < nk; ++j) {
    Vec pj[NV];
    for (int v = 0; v < NV; ++v) pj[v] = Vec::loadu(p + j * QT + v * VL);
    for (int i = 0; i < ND; ++i) {
      Vec vd(val[j * ldv + d0 + i]);
      for (int v = 0; v < NV; ++v) acc[i][v] = at::vec::fmadd(vd, pj[v], acc[i][v]);
    }
  }
  for (int i = 0; i < ND; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v].store(ot + (d0 + i) * QT + v * VL);
}

template <int NV>
void values(const float* val, int64_t ldv, int nk, const float* p, int D, float* ot) {
  int d = 0;
  for (; d + DR <= D; d += DR) value_step<DR, NV>(val, ldv, nk, p, d, ot);
  switch (D - d) {
    case 3: value_step<3, NV>(val, ldv, nk, p, d, ot); break;
    case 2: value_step<2, NV>(val, ldv, nk, p, d, ot); break;
    case 1: value_step<1, NV>(val, ldv, nk, p, d, ot); break;
    default: break;
  }
}

// Which keys a query sees: queries at positions first_pos + lane; keys from key0.
struct Visibility {
  bool causal;
  int64_t window;  // 0: no window

  // Keys [lo, hi) that a query at position p may see, of len_k.
  int64_t lo(int64_t p) const { return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0; }
  int64_t hi(int64_t p, int64_t len_k) const {
    int64_t h = causal ? p + 1 : len_k;
    return window > 0 ? std::min(h, p + window) : h;
  }
};

// One tile's running state: scores go through softmax into probabilities, the output and sums accumulate.
template <int NV>
void softmax_block(float* s, int nk, int64_t key0, bool masked, const Visibility& vis, int64_t first_pos, float* m,
                   float* l, float* ot, int D) {
  if (masked) {
    Vec pos[NV];
    for (int v = 0; v < NV; ++v)
      pos[v] = Vec::arange(static_cast<float>(first_pos + v * VL), 1.f);
    const Vec inf(NEG_INF), w(static_cast<float>(vis.window));
    for (int j = 0; j < nk; ++j) {
      const Vec key(static_cast<float>(key0 + j));
      for (int v = 0; v < NV; ++v) {
        Vec keep = vis.causal ? (key <= pos[v]) : (key == key);
        if (vis.window > 0) keep = keep & ((pos[v] - key) < w) & ((key - pos[v]) < w);
        Vec x = Vec::loadu(s + j * QT + v * VL);
        Vec::blendv(inf, x, keep).store(s + j * QT + v * VL);
      }
    }
  }
  for (int v = 0; v < NV; ++v) {
    Vec top = Vec::loadu(m + v * VL);
    for (int j = 0; j < nk; ++j) top = at::vec::maximum(top, Vec::loadu(s + j * QT + v * VL));
    // A lane that has seen no key yet subtracts 0, not -inf: its probabilities stay 0, never NaN.
    const Vec safe = Vec::blendv(top, Vec(0.f), top == Vec(NEG_INF));
    const Vec alpha = (Vec::loadu(m + v * VL) - safe).exp_u20();
    Vec sum(0.f);
    for (int j = 0; j < nk; ++j) {
      Vec p = (Vec::loadu(s + j * QT + v * VL) - safe).exp_u20();
      p.store(s + j * QT + v * VL);
      sum = sum + p;
    }
    (Vec::loadu(l + v * VL) * alpha + sum).store(l + v * VL);
    top.store(m + v * VL);
    for (int d = 0; d < D; ++d) (Vec::loadu(ot + d * QT + v * VL) * alpha).store(ot + d * QT + v * VL);
  }
}

template <int NV>
void block_step(float* s, const float* k, int64_t ldk, const float* val, int64_t ldv, int nk, int64_t key0,
                bool masked, const Visibility& vis, int64_t first_pos, const float* qt, float* m, float* l, float* ot,
                int D) {
  scores<NV>(k, ldk, nk, qt, D, s);
  softmax_block<NV>(s, nk, key0, masked, vis, first_pos, m, l, ot, D);
  values<NV>(val, ldv, nk, s, D, ot);
}

// qt[d][r] = q[r][d] for `rows` rows of q (at stride ld), through at::vec's transpose (16 x 16 blocks on
// AVX-512); bfloat16 rows are widened into `rows_buf` first.
inline void load_queries(const float* q, int64_t ld, int rows, int D, float*, float* qt) {
  at::vec::transpose_mxn<float>(q, ld, qt, QT, rows, D);
}

inline void load_queries(const at::BFloat16* q, int64_t ld, int rows, int D, float* rows_buf, float* qt) {
  for (int r = 0; r < rows; ++r) widen(q + r * ld, rows_buf + r * D, D);
  at::vec::transpose_mxn<float>(rows_buf, D, qt, QT, rows, D);
}

// out[r][d] = ot[d][r], the inverse of load_queries.
inline void store_output(const float* ot, int rows, int D, float*, float* out, int64_t ld) {
  at::vec::transpose_mxn<float>(ot, QT, out, ld, D, rows);
}

inline void store_output(const float* ot, int rows, int D, float* rows_buf, at::BFloat16* out, int64_t ld) {
  at::vec::transpose_mxn<float>(ot, QT, rows_buf, D, D, rows);
  for (int r = 0; r < rows; ++r) at::vec::convert(rows_buf + r * D, out + r * ld, D);
}

struct Task {
  int64_t seq, head, row0, rows;  // rows [row0, row0 + rows) of the sequence's queries
};

template <typename T>
struct Problem {
  const T *q, *k, *v;
  T* out;
  int64_t q_row, q_head, k_row, k_head, v_row, v_head, o_row, o_head;
  int D, group;
  float scale;
  Visibility vis;
  std::vector<int64_t> q_start, k_start;  // num_seqs + 1 offsets each
};

// Per-thread scratch: the task's tiles (queries, outputs, maxima, sums), one block of scores, widened keys.
struct Scratch {
  std::vector<float> qt, ot, m, l, s, kbuf, vbuf, rows;
  Scratch(int D) :
      qt(MAX_TILES * D * QT), ot(MAX_TILES * D * QT), m(MAX_TILES * QT), l(MAX_TILES * QT), s(KEY_BLOCK * QT),
      kbuf(KEY_BLOCK * D), vbuf(KEY_BLOCK * D), rows(QT * D) {}
};

template <typename T>
void run_task(const Problem<T>& pb, const Task& t, Scratch& sc) {
  const int D = pb.D;
  const int64_t len_q = pb.q_start[t.seq + 1] - pb.q_start[t.seq];
  const int64_t len_k = pb.k_start[t.seq + 1] - pb.k_start[t.seq];
  const int64_t offset = len_k - len_q;  // a query's position is offset + its row
  const int tiles = static_cast<int>((t.rows + QT - 1) / QT);
  const T* q = pb.q + (pb.q_start[t.seq] + t.row0) * pb.q_row + t.head * pb.q_head;
  const int64_t kv_head = t.head / pb.group;
  const T* k = pb.k + pb.k_start[t.seq] * pb.k_row + kv_head * pb.k_head;
  const T* v = pb.v + pb.k_start[t.seq] * pb.v_row + kv_head * pb.v_head;
  std::fill(sc.m.begin(), sc.m.begin() + tiles * QT, NEG_INF);
  std::fill(sc.l.begin(), sc.l.begin() + tiles * QT, 0.f);
  for (int tile = 0; tile < tiles; ++tile) {
    const int rows = static_cast<int>(std::min<int64_t>(QT, t.rows - tile * QT));
    const int lanes = (rows + VL - 1) / VL * VL;
    float* qt = sc.qt.data() + tile * D * QT;
    load_queries(q + tile * QT * pb.q_row, pb.q_row, rows, D, sc.rows.data(), qt);
    for (int d = 0; d < D; ++d) {
      float* lane = qt + d * QT;
      for (int v = 0; v < lanes; v += VL) (Vec::loadu(lane + v) * Vec(pb.scale)).store(lane + v);
      // Padding lanes hold zeros: finite scores, never written out.
      std::fill(lane + rows, lane + lanes, 0.f);
      std::fill(sc.ot.data() + tile * D * QT + d * QT, sc.ot.data() + tile * D * QT + d * QT + lanes, 0.f);
    }
  }
  const int64_t first = offset + t.row0, last = first + t.rows - 1;
  const int64_t lo = pb.vis.lo(first), hi = pb.vis.hi(last, len_k);
  for (int64_t key0 = lo - lo % KEY_BLOCK; key0 < hi; key0 += KEY_BLOCK) {
    const int nk = static_cast<int>(std::min<int64_t>(KEY_BLOCK, len_k - key0));
    const float *kb, *vb;
    int64_t ldk, ldv;
    if constexpr (std::is_same_v<T, float>) {
      kb = k + key0 * pb.k_row, vb = v + key0 * pb.v_row, ldk = pb.k_row, ldv = pb.v_row;
    } else {
      for (int j = 0; j < nk; ++j) {
        widen(k + (key0 + j) * pb.k_row, sc.kbuf.data() + j * D, D);
        widen(v + (key0 + j) * pb.v_row, sc.vbuf.data() + j * D, D);
      }
      kb = sc.kbuf.data(), vb = sc.vbuf.data(), ldk = D, ldv = D;
    }
    for (int tile = 0; tile < tiles; ++tile) {
      const int64_t rows = std::min<int64_t>(QT, t.rows - tile * QT);
      const int64_t p0 = first + tile * QT, p1 = p0 + rows - 1;
      if (key0 >= pb.vis.hi(p1, len_k) || key0 + nk <= pb.vis.lo(p0)) continue;
      // Every row of the tile sees every key of the block: from lo(p1) to hi(p0).
      const bool masked = key0 < pb.vis.lo(p1) || key0 + nk > pb.vis.hi(p0, len_k);
      const int nv = static_cast<int>((rows + VL - 1) / VL);
      float* qt = sc.qt.data() + tile * D * QT;
      float* ot = sc.ot.data() + tile * D * QT;
      float* m = sc.m.data() + tile * QT;
      float* l = sc.l.data() + tile * QT;
      switch (nv) {
        case 1: block_step<1>(sc.s.data(), kb, ldk, vb, ldv, nk, key0, masked, pb.vis, p0, qt, m, l, ot, D); break;
        case 2: block_step<2>(sc.s.data(), kb, ldk, vb, ldv, nk, key0, masked, pb.vis, p0, qt, m, l, ot, D); break;
        case 3: block_step<3>(sc.s.data(), kb, ldk, vb, ldv, nk, key0, masked, pb.vis, p0, qt, m, l, ot, D); break;
        default:
          block_step<MAX_QV>(sc.s.data(), kb, ldk, vb, ldv, nk, key0, masked, pb.vis, p0, qt, m, l, ot, D);
      }
    }
  }
  T* out = pb.out + (pb.q_start[t.seq] + t.row0) * pb.o_row + t.head * pb.o_head;
  for (int tile = 0; tile < tiles; ++tile) {
    const int rows = static_cast<int>(std::min<int64_t>(QT, t.rows - tile * QT));
    float* ot = sc.ot.data() + tile * D * QT;
    const float* l = sc.l.data() + tile * QT;
    for (int v = 0; v < rows; v += VL) {
      const Vec sum = Vec::loadu(l + v);
      // A query that saw no key (none does: each sees itself or, cross, its encoder) would give 0, not NaN.
      const Vec inv = Vec::blendv(Vec(1.f) / sum, Vec(0.f), sum == Vec(0.f));
      for (int d = 0; d < D; ++d) (Vec::loadu(ot + d * QT + v) * inv).store(ot + d * QT + v);
    }
    store_output(ot, rows, D, sc.rows.data(), out + tile * QT * pb.o_row, pb.o_row);
  }
}

std::vector<int64_t> offsets(const at::Tensor& cu) {
  at::Tensor c = cu.to(at::kCPU, at::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

template <typename T>
void attend(Problem<T>& pb, int64_t heads) {
  const int64_t num_seqs = static_cast<int64_t>(pb.q_start.size()) - 1;
  // Fewer, larger tasks (MAX_TILES tiles each) load each key block once for more queries; one tile per task
  // where that would leave threads idle.
  int64_t tiles_total = 0;
  for (int64_t b = 0; b < num_seqs; ++b) tiles_total += heads * ((pb.q_start[b + 1] - pb.q_start[b] + QT - 1) / QT);
  const int64_t threads = at::get_num_threads();
  const int64_t per_task = tiles_total >= 4 * MAX_TILES * threads ? MAX_TILES : 1;
  std::vector<Task> tasks;
  tasks.reserve(tiles_total);
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t len_q = pb.q_start[b + 1] - pb.q_start[b];
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t r = 0; r < len_q; r += per_task * QT) tasks.push_back({b, h, r, std::min(per_task * QT, len_q - r)});
  }
  // Sequences vary in length (longest first as packed): threads take the next task as they finish one.
  run_tasks(
      static_cast<int64_t>(tasks.size()), [&] { return Scratch(pb.D); },
      [&](int64_t i, Scratch& sc) { run_task(pb, tasks[i], sc); });
}

at::Tensor varlen_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q,
                            const at::Tensor& cu_k, bool causal, int64_t window, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), "cpu_varlen runs on CPU");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "q, k, v: [tokens, heads, head_size]");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), "q, k, v of one dtype");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "head_size must be the contiguous dim");
  TORCH_CHECK(k.size(2) == q.size(2) && v.size(2) == q.size(2), "one head size for q, k and v");
  TORCH_CHECK(q.size(1) % k.size(1) == 0 && k.size(1) == v.size(1), "query heads in groups of the KV heads");
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  auto fill = [&](auto* type_tag) {
    using T = std::remove_pointer_t<decltype(type_tag)>;
    Problem<T> pb{q.const_data_ptr<T>(), k.const_data_ptr<T>(), v.const_data_ptr<T>(), out.mutable_data_ptr<T>(),
                  q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0),
                  out.stride(1), static_cast<int>(q.size(2)), static_cast<int>(q.size(1) / k.size(1)),
                  static_cast<float>(scale), Visibility{causal, window}, offsets(cu_q), offsets(cu_k)};
    TORCH_CHECK(pb.q_start.size() == pb.k_start.size(), "cu_seqlens_q and cu_seqlens_k of one length");
    attend(pb, q.size(1));
  };
  dispatch_float_or_bf16(q.scalar_type(), fill);
  return out;
}

}  // namespace

TORCH_LIBRARY(embedserv_cpu_varlen, m) {
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, bool causal, int window, "
      "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(embedserv_cpu_varlen, CPU, m) { m.impl("attention", &varlen_attention); }
