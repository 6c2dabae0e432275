// Linear layers over 8-bit weights: out = x W^T + bias, where W is held as int8 with one float16 scale per 32 inputs
// of each output (GGUF's Q8_0 layout; cbgen.model.int8 makes it from float weights), and never as a whole float copy.
//
// The weight is packed once (cbgen.model.int8.pack) into panels of block_n output columns (32 or 64:
// cbgen.model.int8.block_n), each K x block_n int8 values and K/32 x block_n scales. Every output block of BLOCK_M rows
// x block_n columns is one thread's: the panel's inputs are dequantized KC at a time (q * scale, exact in float32: a
// scale of 11 significant bits times 8 bits) into a buffer that stays in the core's cache, and oneDNN's brgemm
// micro-kernel (at::native::cpublas::brgemm) adds those KC products of each output to its float32 sum, chunk after
// chunk. The order of every output's sum is fixed by K and KC, never by the rows that share the call, the threads
// that run or the panel width: a row's bits are its own (batch invariance holds by construction, as in
// linear_tiles.cpp). `int8_linear` takes rows in float32 or bfloat16 (converted to float32 once a call) and its
// arithmetic is float32 on every CPU kind with AVX2 or more. `int8_linear_bf16`, for bfloat16 rows on a CPU with
// bfloat16 units (cbgen.model.int8 says which), dequantizes into bfloat16 instead (q * scale rounded to nearest even:
// the weight a bfloat16 model of the dequantized weights holds) in the layout the bfloat16 micro-kernel reads, and
// sums in float32 at the bfloat16 rate (twice float32's on an AVX-512 BF16 CPU).

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>
#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>  // the 32-column dequantization below (x86 builds of AVX2 and up)
#define CBGEN_DEQUANTIZE_32 1
#endif
#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>  // the bfloat16 dequantization below (AVX-512 builds: the CPUs with bfloat16 units)
#define CBGEN_DEQUANTIZE_BF16 1
#endif

namespace cbgen_kernels {
namespace {

namespace cpublas = at::native::cpublas;
constexpr int64_t BLOCK_M = 64;  // rows a micro-kernel call: a decode step's
constexpr int64_t GROUP = 32;    // inputs that share a scale
constexpr int64_t KC = 256;      // inputs dequantized at a time: KC x block_n floats stay in L1/L2
constexpr int64_t ROWS_CACHED = int64_t{4} << 20;  // bytes of rows a group of row blocks holds (stays in L3)

// inputs [k0, k0 + kc) of one 32-column panel as float32 with AVX2 and F16C, the loop below written out: a group's
// 32 scales converted once into four registers, each input's 32 values sign-extended, converted and scaled (alone on
// a Zen 3 core over panels in cache: 0.19 cycles a weight, against 0.29 for the compiled loop)
#ifdef CBGEN_DEQUANTIZE_32
void dequantize_32(const int8_t* __restrict__ q, const at::Half* __restrict__ scales, int64_t k0, int64_t kc,
                   float* __restrict__ out) {
  for (int64_t g = k0; g < k0 + kc; g += GROUP) {
    const __m128i* group = reinterpret_cast<const __m128i*>(scales + (g / GROUP) * 32);
    const __m256 s0 = _mm256_cvtph_ps(_mm_loadu_si128(group)), s1 = _mm256_cvtph_ps(_mm_loadu_si128(group + 1)),
                 s2 = _mm256_cvtph_ps(_mm_loadu_si128(group + 2)), s3 = _mm256_cvtph_ps(_mm_loadu_si128(group + 3));
    for (int64_t i = g; i < g + GROUP; ++i) {
      const __m128i low = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i * 32));
      const __m128i high = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i * 32 + 16));
      float* target = out + (i - k0) * 32;
      _mm256_storeu_ps(target, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(low)), s0));
      _mm256_storeu_ps(target + 8, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(low, 8))), s1));
      _mm256_storeu_ps(target + 16, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(high)), s2));
      _mm256_storeu_ps(target + 24, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(high, 8))),
                                                  s3));
    }
  }
}
#endif

// inputs [k0, k0 + kc) of one panel as float32, kc x block_n; `scale` holds block_n floats (a group's scales, made
// once per group of 32 inputs; k0 and kc are multiples of 32)
void dequantize(const int8_t* __restrict__ q, const at::Half* __restrict__ scales, int64_t k0, int64_t kc,
                int64_t block_n, float* __restrict__ scale, float* __restrict__ out) {
#ifdef CBGEN_DEQUANTIZE_32
  if (block_n == 32) {  // the same products (each exact), faster
    return dequantize_32(q, scales, k0, kc, out);
  }
#endif
  for (int64_t i = 0; i < kc; ++i) {
    if ((k0 + i) % GROUP == 0) {
      const at::Half* group = scales + ((k0 + i) / GROUP) * block_n;
      for (int64_t j = 0; j < block_n; ++j) {
        scale[j] = static_cast<float>(group[j]);
      }
    }
    const int8_t* __restrict__ row = q + (k0 + i) * block_n;
    float* __restrict__ target = out + i * block_n;
    for (int64_t j = 0; j < block_n; ++j) {  // vectorized by the compiler: widen, convert, multiply
      target[j] = static_cast<float>(row[j]) * scale[j];
    }
  }
}

// inputs [k0, k0 + kc) of one panel as bfloat16 in pairs of inputs, the layout the bfloat16 micro-kernel reads
// without AMX: input i of column j at ((i / 2) * block_n + j) * 2 + i % 2. Each value is the float32 product q * scale
// (exact) rounded to nearest even, as torch rounds float32 to bfloat16. k0 and kc are multiples of 32.
void dequantize_pairs(const int8_t* __restrict__ q, const at::Half* __restrict__ scales, int64_t k0, int64_t kc,
                      int64_t block_n, at::BFloat16* __restrict__ out) {
#ifdef CBGEN_DEQUANTIZE_BF16
  if (block_n % 16 == 0) {  // 16 columns of two inputs a step: two products rounded, their upper halves paired
    const __m512i half = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1), high = _mm512_set1_epi32(~0xFFFF);
    const auto rounded = [&](__m512 v) {  // the float32 bits rounded to nearest even at bit 16
      const __m512i bits = _mm512_castps_si512(v);
      return _mm512_add_epi32(bits, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(bits, 16), one)));
    };
    for (int64_t g = k0; g < k0 + kc; g += GROUP) {
      const at::Half* group = scales + (g / GROUP) * block_n;
      for (int64_t j = 0; j < block_n; j += 16) {
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + j)));
        for (int64_t i = g; i < g + GROUP; i += 2) {
          const __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i * block_n + j)))), s);
          const __m512 b = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (i + 1) * block_n + j)))), s);
          const __m512i pairs = _mm512_or_si512(_mm512_srli_epi32(rounded(a), 16), _mm512_and_si512(rounded(b), high));
          _mm512_storeu_si512(out + (((i - k0) / 2) * block_n + j) * 2, pairs);
        }
      }
    }
    return;
  }
#endif
  for (int64_t i = 0; i < kc; ++i) {
    const at::Half* group = scales + ((k0 + i) / GROUP) * block_n;
    const int8_t* row = q + (k0 + i) * block_n;
    at::BFloat16* target = out + (i / 2) * block_n * 2 + i % 2;
    for (int64_t j = 0; j < block_n; ++j) {
      target[j * 2] = at::BFloat16(static_cast<float>(row[j]) * static_cast<float>(group[j]));
    }
  }
}

// The same chunk in ATen's packed layout for AMX (the one linear_pack makes there): pairs made plain, then packed
void dequantize_amx(const int8_t* q, const at::Half* scales, int64_t k0, int64_t kc, int64_t block_n,
                    at::BFloat16* plain, at::BFloat16* out) {
  for (int64_t i = 0; i < kc; ++i) {
    const at::Half* group = scales + ((k0 + i) / GROUP) * block_n;
    const int8_t* row = q + (k0 + i) * block_n;
    for (int64_t j = 0; j < block_n; ++j) {
      plain[i * block_n + j] = at::BFloat16(static_cast<float>(row[j]) * static_cast<float>(group[j]));
    }
  }
  cpublas::pack(kc, block_n, block_n, block_n, at::kBFloat16, at::kBFloat16, plain, out);
}

// The kernel's loop (see the file's head) over rows of T, float or bfloat16, the type the chunks are dequantized into
template <typename T>
void run(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& packed_scales, const float* bias_ptr,
         at::Tensor& out) {
  constexpr bool vnni = std::is_same_v<T, at::BFloat16>;
  const bool amx = vnni && cpublas::could_pack(at::kBFloat16);  // ATen's packed layout, as linear_pack makes it
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  const int64_t panels = packed.size(0), block_n = packed.size(2), groups = k / GROUP;
  const int64_t row_blocks = (m + BLOCK_M - 1) / BLOCK_M;
  const T* a = x.data_ptr<T>();
  const int8_t* b = packed.data_ptr<int8_t>();
  const at::Half* s = packed_scales.data_ptr<at::Half>();
  T* o = out.data_ptr<T>();
  // a task is one panel and a group of row blocks: the panel is dequantized once per chunk and met by the group's
  // rows (a decode step has one row block, so one group). Tasks run group by group, so a thread's consecutive tasks
  // read the same rows, which stay in cache across panels; one group for all rows re-read every row from memory for
  // each panel (at 1,024 rows of 8,192 inputs, 1.7x the float32 tiles' time)
  const int64_t group = std::max<int64_t>(1, ROWS_CACHED / (BLOCK_M * k * static_cast<int64_t>(sizeof(T))));
  const int64_t groups_m = (row_blocks + group - 1) / group;
  at::parallel_for(0, groups_m * panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> weights(KC * block_n);
    std::vector<T> plain(amx ? KC * block_n : 0);
    std::vector<float> scale(block_n);
    std::vector<float> sums(std::min(group, row_blocks) * BLOCK_M * block_n);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t p = task % panels, g = task / panels;
      const int64_t first_block = g * group, blocks = std::min(group, row_blocks - first_block);
      const int8_t* panel = b + p * k * block_n;
      const at::Half* panel_scales = s + p * groups * block_n;
      for (int64_t k0 = 0; k0 < k; k0 += KC) {
        const int64_t kc = std::min(KC, k - k0);
        if constexpr (vnni) {
          if (amx) {
            dequantize_amx(panel, panel_scales, k0, kc, block_n, plain.data(), weights.data());
          } else {
            dequantize_pairs(panel, panel_scales, k0, kc, block_n, weights.data());
          }
        } else {
          dequantize(panel, panel_scales, k0, kc, block_n, scale.data(), weights.data());
        }
        for (int64_t r = 0; r < blocks; ++r) {
          const int64_t first = (first_block + r) * BLOCK_M, rows = std::min(BLOCK_M, m - first);
          cpublas::brgemm(rows, block_n, kc, k, block_n, block_n, k0 > 0, a + first * k + k0, weights.data(),
                          sums.data() + r * BLOCK_M * block_n, vnni);
        }
      }
      const int64_t width = std::min(block_n, n - p * block_n);
      const int64_t first_row = first_block * BLOCK_M, last_row = std::min(m, (first_block + blocks) * BLOCK_M);
      const float* panel_bias = bias_ptr == nullptr ? nullptr : bias_ptr + p * block_n;
      for (int64_t row = first_row; row < last_row; ++row) {
        const float* src = sums.data() + (row - first_row) * block_n;
        T* dst = o + row * n + p * block_n;
        for (int64_t c = 0; c < width; ++c) {
          dst[c] = static_cast<T>(panel_bias == nullptr ? src[c] : src[c] + panel_bias[c]);
        }
      }
    }
    if (vnni) {
      cpublas::brgemm_release(vnni);
    }
  });
}

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& packed_scales,
                  const std::optional<at::Tensor>& bias, int64_t out_features, bool bf16) {
  TORCH_CHECK(x_in.dim() == 2, "int8_linear: rows of features");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar && packed.size(1) == x_in.size(1),
              "int8_linear: the weight packed by cbgen.model.int8.pack for these rows");
  TORCH_CHECK(packed_scales.scalar_type() == at::kHalf && packed_scales.size(0) == packed.size(0) &&
              packed_scales.size(1) * GROUP == packed.size(1) && packed_scales.size(2) == packed.size(2),
              "int8_linear: the scales packed with the weight");
  TORCH_CHECK(packed.size(0) * packed.size(2) >= out_features, "int8_linear: more output features than packed");
  TORCH_CHECK(!bf16 || x_in.scalar_type() == at::kBFloat16, "int8_linear_bf16: bfloat16 rows");
  const at::ScalarType type = bf16 ? at::kBFloat16 : at::kFloat;
  const at::Tensor x = x_in.to(type).contiguous();  // float32 rows: the caller's, or converted once a call
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) {
    return out.to(x_in.scalar_type());
  }
  at::Tensor bias_f;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == out_features, "int8_linear: a bias of out_features");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const float* bias_ptr = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  if (bf16) {
    run<at::BFloat16>(x, packed, packed_scales, bias_ptr, out);
  } else {
    run<float>(x, packed, packed_scales, bias_ptr, out);
  }
  return out.to(x_in.scalar_type());
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& packed_scales,
                       const std::optional<at::Tensor>& bias, int64_t out_features) {
  return linear(x, packed, packed_scales, bias, out_features, false);
}

at::Tensor int8_linear_bf16(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& packed_scales,
                            const std::optional<at::Tensor>& bias, int64_t out_features) {
  return linear(x, packed, packed_scales, bias, out_features, true);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cbgen_kernels, m) {
  m.def("int8_linear(Tensor x, Tensor packed, Tensor packed_scales, Tensor? bias, int out_features) -> Tensor");
  m.def("int8_linear_bf16(Tensor x, Tensor packed, Tensor packed_scales, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(cbgen_kernels, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_linear_bf16", &int8_linear_bf16);
}

}  // namespace cbgen_kernels
