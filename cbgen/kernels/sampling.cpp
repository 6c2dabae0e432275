// The sampled draw of a decoding step: one token per row of the scores, drawn from softmax(scores) by the row's
// uniform number u in [0, 1), as the first token whose cumulative weight passes u times the row's total weight.
// cbgen's step control (cbgen.control.processor) calls it for every sampled row of a step at once.
//
// Weights are fixed-point integers: w = floor(exp(x - max) * 2^44), summed in int64. Integer sums are exact in any
// order, so the row's blocks are summed in vectors and the cumulative weight of a token is the same however it is
// added up: the search walks the blocks' sums, then the one block it lands in, and finds the token the whole row's
// cumulative sum would. A token more than 30.5 nats below the row's best gets weight 0 and is never drawn (its
// probability is below 6e-14; all of them together below 3e-9 of the row). exp is ATen's vector exp for every
// element, the last partial vector of a row padded, so a token's weight is a function of its score and the row's
// maximum alone.
//
// Invariant by construction: each row is drawn by one thread from its own scores and u, so a row's token does not
// depend on the other rows of the step, their number or the threads. One pass over the row (its maximum is a
// second, cheap one), no vocabulary-sized buffer: the eager draw (a float64 cumulative sum of the whole step, 25 MB
// at 64 rows of 49,152) cost 10-13 ms of a 75 ms step on a 2-core AMX Xeon.

#include <ATen/core/Tensor.h>  // not ATen/ATen.h: only what is used, a third of the build time less
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace cbgen_kernels {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
constexpr int64_t BLOCK = 256;  // tokens a block sum covers: a multiple of every vector width
constexpr float SCALE = 17592186044416.f;  // 2^44: a weight of 1 (the row's best token) is 2^44

// The weights of tokens [begin, end) of a row (end - begin <= BLOCK), into `out`; returns their sum
inline int64_t block_weights(const float* x, int64_t begin, int64_t end, float top, int64_t* out) {
  alignas(64) float e[W];
  int64_t sum = 0;
  const Vec vtop(top);
  for (int64_t i = begin; i < end; i += W) {
    const int64_t n = std::min<int64_t>(W, end - i);
    // a partial vector is padded with the row's maximum (weight 1), and those lanes are not read
    Vec v = n == W ? Vec::loadu(x + i) : Vec::set(vtop, Vec::loadu(x + i, n), n);
    (v - vtop).exp().store(e);
    for (int64_t l = 0; l < n; ++l) {
      const int64_t q = static_cast<int64_t>(e[l] * SCALE);  // e in [0, 1]: exact scaling, truncated
      if (out != nullptr) out[i - begin + l] = q;
      sum += q;
    }
  }
  return sum;
}

// The row's maximum, NaN where any score is NaN (-inf for a row of -inf scores)
inline float row_max(const float* x, int64_t vocab) {
  Vec acc(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + W <= vocab; i += W) acc = at::vec::maximum(acc, Vec::loadu(x + i));
  alignas(64) float lanes[W];
  acc.store(lanes);
  float top = lanes[0];
  for (int64_t l = 1; l < W; ++l) top = std::isnan(top) || std::isnan(lanes[l]) ? NAN : std::max(top, lanes[l]);
  for (; i < vocab; ++i) top = std::isnan(top) || std::isnan(x[i]) ? NAN : std::max(top, x[i]);
  return top;
}

int64_t draw_row(const float* x, int64_t vocab, double u, std::vector<int64_t>& sums) {
  // the maximum (-inf tokens, masked ones, have weight 0); where it is not finite (NaN or +inf scores, or every
  // token masked) nothing can be drawn by weight, and the first best token is taken
  const float top = row_max(x, vocab);
  if (!std::isfinite(top)) {
    int64_t best = 0;
    float seen = -std::numeric_limits<float>::infinity();
    for (int64_t k = 0; k < vocab; ++k) {
      if (x[k] > seen) {
        seen = x[k];
        best = k;
      }
    }
    return best;
  }
  const int64_t blocks = (vocab + BLOCK - 1) / BLOCK;
  sums.resize(blocks);
  int64_t total = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    sums[b] = block_weights(x, b * BLOCK, std::min(vocab, (b + 1) * BLOCK), top, nullptr);
    total += sums[b];
  }
  // the target below the total: u < 1, and u * total rounded may reach it
  int64_t target = static_cast<int64_t>(u * static_cast<double>(total));
  target = std::min(std::max<int64_t>(target, 0), total - 1);
  int64_t before = 0, b = 0;
  while (b + 1 < blocks && before + sums[b] <= target) before += sums[b++];
  int64_t weights[BLOCK];
  const int64_t begin = b * BLOCK, end = std::min(vocab, begin + BLOCK);
  block_weights(x, begin, end, top, weights);
  for (int64_t i = begin; i < end; ++i) {
    before += weights[i - begin];
    if (before > target) return i;
  }
  return end - 1;  // not reached: the block's weights add up to its sum
}

at::Tensor draw_rows(const at::Tensor& scores, const at::Tensor& uniforms) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == at::kFloat && scores.stride(1) == 1,
              "draw_rows: float32 scores [rows, vocab] with contiguous rows");
  TORCH_CHECK(uniforms.dim() == 1 && uniforms.scalar_type() == at::kDouble && uniforms.size(0) == scores.size(0),
              "draw_rows: one float64 uniform number per row");
  const int64_t rows = scores.size(0), vocab = scores.size(1), stride = scores.stride(0);
  TORCH_CHECK(vocab > 0 && vocab < (int64_t{1} << 19), "draw_rows: 1 to 524,287 tokens a row");
  at::Tensor out = at::empty({rows}, scores.options().dtype(at::kLong));
  const float* x = scores.const_data_ptr<float>();
  const at::Tensor u = uniforms.contiguous();
  const double* us = u.const_data_ptr<double>();
  int64_t* o = out.mutable_data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> sums;
    for (int64_t r = begin; r < end; ++r) o[r] = draw_row(x + r * stride, vocab, us[r], sums);
  });
  return out;
}

// min_p's filter, in place, on the rows `rows` of `scores` (T: float, BFloat16 or Half): every token whose score
// is below the row's best plus its floor (ln min_p; in float32, as torch adds a float32 tensor to the maximum) becomes
// -inf. The decisions of torch's `picked < picked.amax(-1).float() + floor` (a NaN maximum masks nothing): one
// pass for the maximum and one for the mask, a row a thread, where the torch operators make three passes and a
// boolean mask over the whole step
template <typename T>
void min_p_row(T* x, int64_t vocab, float floor) {
  float top = -std::numeric_limits<float>::infinity();
  if constexpr (std::is_same_v<T, float>) {
    top = row_max(x, vocab);
  } else {
    for (int64_t i = 0; i < vocab; ++i) {
      const float v = static_cast<float>(x[i]);
      top = std::isnan(top) || std::isnan(v) ? NAN : std::max(top, v);
    }
  }
  const float threshold = top + floor;
  const T masked = static_cast<T>(-std::numeric_limits<float>::infinity());
  for (int64_t k = 0; k < vocab; ++k) {
    if (static_cast<float>(x[k]) < threshold) x[k] = masked;
  }
}

void min_p_rows_(at::Tensor scores, const at::Tensor& rows, const at::Tensor& floors) {
  TORCH_CHECK(scores.dim() == 2 && scores.stride(1) == 1, "min_p_rows_: scores [rows, vocab] with contiguous rows");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && floors.dim() == 1 &&
                  floors.scalar_type() == at::kFloat && floors.size(0) == rows.size(0),
              "min_p_rows_: int64 row indices and one float32 floor per row");
  const at::Tensor at_rows = rows.contiguous(), at_floors = floors.contiguous();
  const int64_t* index = at_rows.const_data_ptr<int64_t>();
  const float* floor = at_floors.const_data_ptr<float>();
  const int64_t n = rows.size(0), vocab = scores.size(1), stride = scores.stride(0), all = scores.size(0);
  for (int64_t r = 0; r < n; ++r) TORCH_CHECK(index[r] >= 0 && index[r] < all, "min_p_rows_: a row out of range");
  const auto run = [&](auto* x) {
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) min_p_row(x + index[r] * stride, vocab, floor[r]);
    });
  };
  switch (scores.scalar_type()) {
    case at::kFloat: return run(scores.mutable_data_ptr<float>());
    case at::kBFloat16: return run(scores.mutable_data_ptr<at::BFloat16>());
    case at::kHalf: return run(scores.mutable_data_ptr<at::Half>());
    default: TORCH_CHECK(false, "min_p_rows_: float32, bfloat16 or float16 scores");
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cbgen_kernels, m) {
  m.def("draw_rows(Tensor scores, Tensor uniforms) -> Tensor");
  m.def("min_p_rows_(Tensor(a!) scores, Tensor rows, Tensor floors) -> ()");
}

TORCH_LIBRARY_IMPL(cbgen_kernels, CPU, m) {
  m.impl("draw_rows", &draw_rows);
  m.impl("min_p_rows_", &min_p_rows_);
}

}  // namespace cbgen_kernels
