// The small operators of a decoder layer, each one pass over its rows: RMSNorm (with the residual addition before
// it), the rotary embedding of queries and keys in place, and SiLU(gate) * up. cbgen's fused decoder layers
// (cbgen.model.fused) call them between their matmuls instead of some 25 eager operators a layer, each of which cost
// tens of microseconds on a decode step's few rows (threads woken, a result allocated) for a microsecond's work.
//
// Invariant by construction: every row is computed by one thread, from that row alone, in one fixed order, so a
// row's bits do not depend on how many rows the step has, where the row sits or how many threads run.
//
// Numerics follow transformers' eager operators: RMSNorm in float32 (the input converted, its mean square, the
// reciprocal square root, the product, converted back, then the weight's product in the model's dtype); the rotary
// embedding as x * cos + rotate_half(x) * sin with each product and the sum rounded to the model's dtype, as the
// eager operators round them; SiLU computed in float32 and rounded, then the product with up rounded. The
// elementwise ones are bitwise transformers'; RMSNorm's mean square sums the row in its own order (eight float32
// lanes of the vector, then the lanes in order), so it may differ from torch's mean in the last bit of float32.

#include <ATen/core/Tensor.h>  // not ATen/ATen.h: only what is used, a third of the build time less
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>
#include <type_traits>

namespace cbgen_kernels {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
constexpr int64_t GRAIN = 4;  // rows a thread takes at a time

template <typename T>
inline float to_float(T x) {
  return static_cast<float>(x);
}

template <typename T>
inline T round_to(float x) {  // what an eager operator's result in dtype T holds (to nearest, ties to even)
  return static_cast<T>(x);
}

// Elements move in chunks of C = 2 W: two float vectors, one vector of a 16-bit type (ATen's own conversions,
// rounding to nearest, ties to even, as the scalar conversion rounds)
constexpr int64_t C = 2 * W;

template <typename T>
inline void load_f(const T* src, Vec& a, Vec& b) {  // C elements, as float
  if constexpr (std::is_same_v<T, float>) {
    a = Vec::loadu(src);
    b = Vec::loadu(src + W);
  } else {
    std::tie(a, b) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(src));
  }
}

template <typename T>
inline void store_f(const Vec& a, const Vec& b, T* dst) {  // C elements, rounded to T
  if constexpr (std::is_same_v<T, float>) {
    a.store(dst);
    b.store(dst + W);
  } else {
    at::vec::convert_from_float<T>(a, b).store(dst);
  }
}

template <typename T>
inline void rounded(Vec& a, Vec& b) {  // a and b as an eager operator's result in T holds them, back as float
  if constexpr (!std::is_same_v<T, float>) {
    std::tie(a, b) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(a, b));
  }
}

// One row's RMSNorm: out = weight * (x * rsqrt(mean(x^2) + eps)) in T, the normalised value rounded to T first
template <typename T>
void norm_row(const T* x, const T* weight, T* out, int64_t n, float eps) {
  Vec acc(0.f), a, b;
  int64_t i = 0;
  alignas(64) float buffer[W];
  for (; i + C <= n; i += C) {
    load_f<T>(x + i, a, b);
    acc = acc + a * a;
    acc = acc + b * b;
  }
  acc.store(buffer);
  float sum = 0.f;
  for (int64_t l = 0; l < W; ++l) sum += buffer[l];
  for (; i < n; ++i) sum += to_float(x[i]) * to_float(x[i]);
  const float scale = 1.f / std::sqrt(sum / static_cast<float>(n) + eps);
  const Vec factor(scale);
  int64_t j = 0;
  for (; j + C <= n; j += C) {
    Vec w0, w1;
    load_f<T>(x + j, a, b);
    a = a * factor;
    b = b * factor;
    rounded<T>(a, b);
    load_f<T>(weight + j, w0, w1);
    store_f<T>(w0 * a, w1 * b, out + j);
  }
  for (; j < n; ++j) {
    const T normalised = round_to<T>(to_float(x[j]) * scale);
    out[j] = round_to<T>(to_float(weight[j]) * to_float(normalised));
  }
}

template <typename T>
void rms_norm_impl(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out, double eps,
                   const at::Tensor* residual) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  T* xs = x.mutable_data_ptr<T>();
  const T* ws = weight.const_data_ptr<T>();
  T* os = out.mutable_data_ptr<T>();
  const T* rs = residual != nullptr ? residual->const_data_ptr<T>() : nullptr;
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* row = xs + r * n;
      if (rs != nullptr) {  // x += residual, in T (the eager in-place addition)
        const T* add = rs + r * n;
        int64_t j = 0;
        for (; j + C <= n; j += C) {
          Vec a, b, c, d;
          load_f<T>(row + j, a, b);
          load_f<T>(add + j, c, d);
          store_f<T>(a + c, b + d, row + j);
        }
        for (; j < n; ++j) row[j] = round_to<T>(to_float(row[j]) + to_float(add[j]));
      }
      norm_row<T>(row, ws, os + r * n, n, static_cast<float>(eps));
    }
  });
}

void check_rows(const at::Tensor& x, const at::Tensor& weight, const char* what) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous() && weight.dim() == 1 && x.size(-1) == weight.size(0),
              what, ": contiguous rows and a weight of their width");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), what, ": the input and the weight share one dtype");
}

template <typename F>
void dispatch(at::ScalarType dtype, const char* what, F&& f) {
  if (dtype == at::kFloat) {
    f(float{});
  } else if (dtype == at::kBFloat16) {
    f(at::BFloat16{});
  } else if (dtype == at::kHalf) {
    f(at::Half{});
  } else {
    TORCH_CHECK(false, what, ": float32, bfloat16 or float16 only");
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "rms_norm");
  at::Tensor out = at::empty_like(x);
  dispatch(x.scalar_type(), "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_impl<T>(x, weight, out, eps, nullptr);
  });
  return out;
}

// x += residual, then RMSNorm of the sum: returns the norm, x holds the sum (the layer's next residual)
at::Tensor add_rms_norm(at::Tensor x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "add_rms_norm");
  TORCH_CHECK(residual.is_contiguous() && residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: a contiguous residual of the input's shape and dtype");
  at::Tensor out = at::empty_like(x);
  dispatch(x.scalar_type(), "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_impl<T>(x, weight, out, eps, &residual);
  });
  return out;
}

// In place on the first `heads` heads of each row of `qkv` ([tokens, width], heads of `dim` side by side):
// x * cos + rotate_half(x) * sin, with cos and sin [tokens, dim]
template <typename T>
void rope_impl(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t dim) {
  const int64_t tokens = qkv.size(0), width = qkv.stride(0), half = dim / 2;
  T* q = qkv.mutable_data_ptr<T>();
  const T* cs = cos.const_data_ptr<T>();
  const T* sn = sin.const_data_ptr<T>();
  const int64_t c_row = cos.stride(0), s_row = sin.stride(0);
  const bool vectors = half % C == 0;
  at::parallel_for(0, tokens, GRAIN, [&](int64_t begin, int64_t end) {
    alignas(64) float x[512];
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cs + t * c_row;
      const T* s = sn + t * s_row;
      for (int64_t h = 0; h < heads; ++h) {
        T* row = q + t * width + h * dim;
        if (vectors) {  // the halves in whole vectors: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), each rounded
          for (int64_t i = 0; i < half; i += C) {
            Vec x1a, x1b, x2a, x2b, c1a, c1b, c2a, c2b, s1a, s1b, s2a, s2b;
            load_f<T>(row + i, x1a, x1b);
            load_f<T>(row + half + i, x2a, x2b);
            load_f<T>(c + i, c1a, c1b);
            load_f<T>(c + half + i, c2a, c2b);
            load_f<T>(s + i, s1a, s1b);
            load_f<T>(s + half + i, s2a, s2b);
            Vec p1a = x1a * c1a, p1b = x1b * c1b, q1a = x2a.neg() * s1a, q1b = x2b.neg() * s1b;
            Vec p2a = x2a * c2a, p2b = x2b * c2b, q2a = x1a * s2a, q2b = x1b * s2b;
            rounded<T>(p1a, p1b);
            rounded<T>(q1a, q1b);
            rounded<T>(p2a, p2b);
            rounded<T>(q2a, q2b);
            store_f<T>(p1a + q1a, p1b + q1b, row + i);
            store_f<T>(p2a + q2a, p2b + q2b, row + half + i);
          }
          continue;
        }
        for (int64_t i = 0; i < dim; ++i) x[i] = to_float(row[i]);
        for (int64_t i = 0; i < dim; ++i) {
          const float rotated = i < half ? -x[i + half] : x[i - half];
          const T a = round_to<T>(x[i] * to_float(c[i]));
          const T b = round_to<T>(rotated * to_float(s[i]));
          row[i] = round_to<T>(to_float(a) + to_float(b));
        }
      }
    }
  });
}

void rope_(at::Tensor qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t heads, int64_t dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && heads * dim <= qkv.size(1), "rope_: [tokens, width] rows");
  TORCH_CHECK(dim % 2 == 0 && dim <= 512, "rope_: an even head dimension of at most 512");
  TORCH_CHECK(cos.dim() == 2 && sin.dim() == 2 && cos.size(0) == qkv.size(0) && sin.size(0) == qkv.size(0) &&
                  cos.size(1) == dim && sin.size(1) == dim && cos.stride(1) == 1 && sin.stride(1) == 1,
              "rope_: cos and sin [tokens, dim]");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "rope_: cos, sin and the rows share one dtype");
  dispatch(qkv.scalar_type(), "rope_", [&](auto tag) {
    using T = decltype(tag);
    rope_impl<T>(qkv, cos, sin, heads, dim);
  });
}

// SiLU(gate) * up for rows [gate | up] of width 2 * intermediate: silu rounded to T, then the product rounded
template <typename T>
void silu_mul_impl(const at::Tensor& gate_up, at::Tensor& out, int64_t intermediate) {
  const int64_t rows = gate_up.size(0), width = gate_up.stride(0);
  const T* g = gate_up.const_data_ptr<T>();
  T* o = out.mutable_data_ptr<T>();
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = g + r * width;
      const T* up = gate + intermediate;
      T* row = o + r * intermediate;
      int64_t i = 0;
      for (; i + C <= intermediate; i += C) {
        Vec xa, xb, ua, ub;
        load_f<T>(gate + i, xa, xb);
        load_f<T>(up + i, ua, ub);
        Vec sa = xa / (Vec(1.f) + xa.neg().exp()), sb = xb / (Vec(1.f) + xb.neg().exp());
        rounded<T>(sa, sb);
        store_f<T>(sa * ua, sb * ub, row + i);
      }
      for (; i < intermediate; ++i) {
        const float x = to_float(gate[i]);
        row[i] = round_to<T>(to_float(round_to<T>(x / (1.f + std::exp(-x)))) * to_float(up[i]));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up, int64_t intermediate) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) == 2 * intermediate,
              "silu_mul: [rows, 2 * intermediate] rows, gate then up");
  at::Tensor out = at::empty({gate_up.size(0), intermediate}, gate_up.options());
  dispatch(gate_up.scalar_type(), "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    silu_mul_impl<T>(gate_up, out, intermediate);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cbgen_kernels, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor residual, Tensor weight, float eps) -> Tensor");
  m.def("rope_(Tensor(a!) qkv, Tensor cos, Tensor sin, int heads, int dim) -> ()");
  m.def("silu_mul(Tensor gate_up, int intermediate) -> Tensor");
}

TORCH_LIBRARY_IMPL(cbgen_kernels, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", &silu_mul);
}

}  // namespace cbgen_kernels
