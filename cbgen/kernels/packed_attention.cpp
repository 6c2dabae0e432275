// Bidirectional attention over packed sequences: an encoder's batch laid end to end, no padding, each sequence
// attending to its own tokens only (`cu_seqlens`: where each one starts). cbgen's packed encoder forward
// (cbgen.encoders.packed) calls it through transformers' attention registry, so that an embedding model's linear
// layers run over the batch's real tokens alone, in one large matmul, where padded batches computed the padding too.
//
// One (sequence, head) is one task, computed by one thread: the keys transposed into a buffer of its own ([dim,
// length]), then four queries at a time in registers: their scores (`dim` vector multiply-adds per 16 keys, the
// keys loaded once for the four), a float32 softmax, and the output as the softmax-weighted sum of the value rows. At the lengths of sentence embeddings (tens to a few
// hundred tokens, heads of 32 to 64) that is a few microseconds a task, where CPU SDPA spent most of its time in
// per-task costs over padded batches. Tasks are dealt to threads longest first, round robin, so that long sequences
// are spread. A row's result depends on its own sequence alone (never on the batch or the threads).

#include <ATen/core/Tensor.h>  // not ATen/ATen.h: only what is used, a third of the build time less
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace cbgen_kernels {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();

template <typename T>
inline float f32(T x) {
  return static_cast<float>(x);
}

struct Buffers {
  std::vector<float> kt, v, scores, out, q;
};

constexpr int QB = 4;  // queries a register tile computes at once
constexpr int DB = 4;  // output vectors (of W dims) a register tile holds per query

// Scores of queries [i, i + n) (n <= QB) against every key, scaled: s[r * padded + j]. Two vectors of keys at a time,
// so that eight independent sums keep the multiply-add units busy
template <int N>
inline void score_tile(const float* qrows, int64_t dim, const float* kt, int64_t padded, int64_t length, float* s,
                       Vec* top) {
  const Vec minus_inf(-std::numeric_limits<float>::infinity());
  for (int r = 0; r < N; ++r) top[r] = minus_inf;
  int64_t j = 0;
  for (; j + 2 * W <= length; j += 2 * W) {
    Vec a[N], c[N];
    for (int r = 0; r < N; ++r) a[r] = c[r] = Vec(0.f);
    for (int64_t d = 0; d < dim; ++d) {
      const Vec k0 = Vec::loadu(kt + d * padded + j), k1 = Vec::loadu(kt + d * padded + j + W);
      for (int r = 0; r < N; ++r) {
        const Vec qd(qrows[r * dim + d]);
        a[r] = at::vec::fmadd(qd, k0, a[r]);
        c[r] = at::vec::fmadd(qd, k1, c[r]);
      }
    }
    for (int r = 0; r < N; ++r) {
      a[r].store(s + r * padded + j);
      c[r].store(s + r * padded + j + W);
      top[r] = at::vec::maximum(top[r], at::vec::maximum(a[r], c[r]));
    }
  }
  for (; j < padded; j += W) {
    Vec acc[N];
    for (int r = 0; r < N; ++r) acc[r] = Vec(0.f);
    for (int64_t d = 0; d < dim; ++d) {
      const Vec key = Vec::loadu(kt + d * padded + j);
      for (int r = 0; r < N; ++r) acc[r] = at::vec::fmadd(Vec(qrows[r * dim + d]), key, acc[r]);
    }
    for (int r = 0; r < N; ++r) {
      // keys past the sequence's end (the last vector's padding) score -inf
      if (j + W > length) acc[r] = Vec::set(minus_inf, acc[r], length - j);
      acc[r].store(s + r * padded + j);
      top[r] = at::vec::maximum(top[r], acc[r]);
    }
  }
}

// Outputs of queries [i, i + n): o[r * dim + d] = sum over keys of p[r][j] * v[j][d], dims [d0, d0 + NV * W); the
// counts are compile-time constants, so that the accumulators stay in registers
template <int N, int NV>
inline void output_tile(const float* p, int64_t padded, const float* v, int64_t vstride, int64_t length, int64_t d0,
                        int64_t dim, float* o) {
  Vec acc[N][NV];
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c] = Vec(0.f);
  for (int64_t j = 0; j < length; ++j) {
    const float* value = v + j * vstride + d0;
    Vec vals[NV];
    for (int c = 0; c < NV; ++c) vals[c] = Vec::loadu(value + c * W);
    for (int r = 0; r < N; ++r) {
      const Vec weight(p[r * padded + j]);
      for (int c = 0; c < NV; ++c) acc[r][c] = at::vec::fmadd(weight, vals[c], acc[r][c]);
    }
  }
  for (int r = 0; r < N; ++r)
    for (int c = 0; c < NV; ++c) acc[r][c].store(o + r * dim + d0 + c * W);
}

template <int N>
inline void output_tiles(const float* p, int64_t padded, const float* v, int64_t vstride, int64_t length, int64_t dim,
                         float* o) {
  const int64_t vec_dim = dim / W * W;
  for (int64_t d0 = 0; d0 < vec_dim; d0 += DB * W) {
    switch (std::min<int64_t>(DB, (vec_dim - d0) / W)) {
      case 4: output_tile<N, 4>(p, padded, v, vstride, length, d0, dim, o); break;
      case 3: output_tile<N, 3>(p, padded, v, vstride, length, d0, dim, o); break;
      case 2: output_tile<N, 2>(p, padded, v, vstride, length, d0, dim, o); break;
      default: output_tile<N, 1>(p, padded, v, vstride, length, d0, dim, o); break;
    }
  }
  for (int r = 0; r < N; ++r)
    for (int64_t d = vec_dim; d < dim; ++d) {
      float acc = 0.f;
      for (int64_t j = 0; j < length; ++j) acc += p[r * padded + j] * v[j * vstride + d];
      o[r * dim + d] = acc;
    }
}

template <int N>
void query_tile(const float* qrows, const float* kt, const float* v, int64_t vstride, int64_t length, int64_t padded,
                int64_t dim, float* s, float* o) {
  Vec top[N];
  score_tile<N>(qrows, dim, kt, padded, length, s, top);
  float inv[N];
  for (int r = 0; r < N; ++r) {  // the softmax's numerators in place; the output is divided by their sum after
    float* row = s + r * padded;
    const Vec m(at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return at::vec::maximum(a, b); },
                                               top[r]));
    Vec total(0.f);
    for (int64_t j = 0; j < padded; j += W) {
      const Vec e = (Vec::loadu(row + j) - m).exp();
      e.store(row + j);
      total = total + e;
    }
    inv[r] = 1.f / at::vec::vec_reduce_all<float>([](const Vec& a, const Vec& b) { return a + b; }, total);
  }
  output_tiles<N>(s, padded, v, vstride, length, dim, o);
  for (int r = 0; r < N; ++r)
    for (int64_t d = 0; d < dim; ++d) o[r * dim + d] *= inv[r];
}

// One (sequence, head): rows [start, start + length) of q, k, v ([tokens, heads, dim] with strides), into out
template <typename T>
void attend(const T* q, const T* k, const T* v, T* out, int64_t start, int64_t length, int64_t head, int64_t kv_head,
            int64_t dim, const int64_t* qs, const int64_t* ks, const int64_t* vs, const int64_t* os, float scale,
            Buffers& b) {
  const int64_t padded = (length + W - 1) / W * W;
  b.kt.assign(dim * padded, 0.f);
  b.scores.resize(QB * padded);
  b.out.resize(QB * dim);
  b.q.resize(QB * dim);
  float* kt = b.kt.data();
  const T* keys = k + start * ks[0] + kv_head * ks[1];
  if (ks[2] == 1) {
    for (int64_t j = 0; j < length; ++j) {
      const T* key = keys + j * ks[0];
      for (int64_t d = 0; d < dim; ++d) kt[d * padded + j] = f32(key[d]);
    }
  } else {
    for (int64_t j = 0; j < length; ++j)
      for (int64_t d = 0; d < dim; ++d) kt[d * padded + j] = f32(keys[j * ks[0] + d * ks[2]]);
  }
  // value rows in place where they are float32 with their dims side by side, else converted into a buffer
  const T* values = v + start * vs[0] + kv_head * vs[1];
  const float* vrows;
  int64_t vstride;
  if constexpr (std::is_same_v<T, float>) {
    if (vs[2] == 1) {
      vrows = values;
      vstride = vs[0];
    }
  }
  if (!std::is_same_v<T, float> || vs[2] != 1) {
    b.v.resize(length * dim);
    for (int64_t j = 0; j < length; ++j)
      for (int64_t d = 0; d < dim; ++d) b.v[j * dim + d] = f32(values[j * vs[0] + d * vs[2]]);
    vrows = b.v.data();
    vstride = dim;
  }
  for (int64_t i = 0; i < length; i += QB) {
    const int n = static_cast<int>(std::min<int64_t>(QB, length - i));
    for (int r = 0; r < n; ++r) {
      const T* query = q + (start + i + r) * qs[0] + head * qs[1];
      for (int64_t d = 0; d < dim; ++d) b.q[r * dim + d] = f32(query[d * qs[2]]) * scale;
    }
    float* s = b.scores.data();
    float* o = b.out.data();
    switch (n) {
      case 4: query_tile<4>(b.q.data(), kt, vrows, vstride, length, padded, dim, s, o); break;
      case 3: query_tile<3>(b.q.data(), kt, vrows, vstride, length, padded, dim, s, o); break;
      case 2: query_tile<2>(b.q.data(), kt, vrows, vstride, length, padded, dim, s, o); break;
      default: query_tile<1>(b.q.data(), kt, vrows, vstride, length, padded, dim, s, o); break;
    }
    for (int r = 0; r < n; ++r) {
      T* dst = out + (start + i + r) * os[0] + head * os[1];
      for (int64_t d = 0; d < dim; ++d) dst[d * os[2]] = static_cast<T>(o[r * dim + d]);
    }
  }
}

template <typename T>
void packed_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& out,
                 const std::vector<int64_t>& cu, double scale) {
  const int64_t heads = q.size(1), kv_heads = k.size(1), dim = q.size(2), sequences = cu.size() - 1;
  const int64_t group = heads / kv_heads;
  const int64_t qs[3] = {q.stride(0), q.stride(1), q.stride(2)}, ks[3] = {k.stride(0), k.stride(1), k.stride(2)},
                vs[3] = {v.stride(0), v.stride(1), v.stride(2)}, os[3] = {out.stride(0), out.stride(1), out.stride(2)};
  // tasks longest first, dealt round robin to the threads
  std::vector<int64_t> order(sequences);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return cu[a + 1] - cu[a] > cu[b + 1] - cu[b]; });
  const int64_t tasks = sequences * heads;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks));
  const T* qp = q.const_data_ptr<T>();
  const T* kp = k.const_data_ptr<T>();
  const T* vp = v.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    Buffers buffers;
    for (int64_t t = begin; t < end; ++t) {
      for (int64_t task = t; task < tasks; task += threads) {
        const int64_t sequence = order[task / heads], head = task % heads;
        const int64_t start = cu[sequence], length = cu[sequence + 1] - start;
        if (length > 0)
          attend<T>(qp, kp, vp, op, start, length, head, head / group, dim, qs, ks, vs, os,
                    static_cast<float>(scale), buffers);
      }
    }
  });
}

// q [tokens, heads, dim], k and v [tokens, kv_heads, dim] (any strides), cu_seqlens [sequences + 1] (int64, from 0
// to tokens): the attention output [tokens, heads, dim], contiguous, in q's dtype
at::Tensor packed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_seqlens,
                            double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "packed_attention: [tokens, heads, dim] tensors");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) == q.size(0) && k.size(2) == q.size(2) &&
                  q.size(1) % k.size(1) == 0,
              "packed_attention: keys and values of the queries' tokens and dim, heads dividing theirs");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(),
              "packed_attention: one dtype for q, k and v");
  const at::Tensor cu_tensor = cu_seqlens.to(at::kLong).contiguous();
  std::vector<int64_t> cu(cu_tensor.const_data_ptr<int64_t>(), cu_tensor.const_data_ptr<int64_t>() + cu_tensor.numel());
  TORCH_CHECK(cu.size() >= 2 && cu.front() == 0 && cu.back() == q.size(0) && std::is_sorted(cu.begin(), cu.end()),
              "packed_attention: cu_seqlens rise from 0 to the number of tokens");
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (q.scalar_type() == at::kFloat) {
    packed_impl<float>(q, k, v, out, cu, scale);
  } else if (q.scalar_type() == at::kBFloat16) {
    packed_impl<at::BFloat16>(q, k, v, out, cu, scale);
  } else if (q.scalar_type() == at::kHalf) {
    packed_impl<at::Half>(q, k, v, out, cu, scale);
  } else {
    TORCH_CHECK(false, "packed_attention: float32, bfloat16 or float16 only");
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cbgen_kernels, m) {
  m.def("packed_attention(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(cbgen_kernels, CPU, m) {
  m.impl("packed_attention", &packed_attention);
}

}  // namespace cbgen_kernels
