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
#include <immintrin.h>  // the bfloat16 dequantization below (AVX-512 builds, on CPUs with bfloat16 units)
#define CBGEN_DEQUANTIZE_BF16 1
#endif

namespace cbgen_kernels {
namespace {

namespace cpublas = at::native::cpublas;
constexpr int64_t BLOCK_M = 64;  // rows a micro-kernel call: a decode step's
constexpr int64_t GROUP = 32;    // inputs that share a scale
constexpr int64_t KC = 256;      // inputs dequantized at a time: KC x block_n floats stay in L1/L2
// bfloat16 inputs dequantized at a time: the bfloat16 tiles' chunks (linear_tiles.cpp: 64 KiB of a 64-column panel,
// the whole reduction up to BF16_WHOLE_K inputs), so that off AMX a layer's bits are those of the tiles over its
// dequantized weights rounded to bfloat16
constexpr int64_t KC_BF16 = 512, BF16_WHOLE_K = 2048;
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

#ifdef CBGEN_DEQUANTIZE_BF16
// 16 consecutive int8 values times their scales, in float32 (each product exact)
inline __m512 products(const int8_t* q, __m512 scale) {
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)))),
                       scale);
}

// inputs [k0, k0 + kc) of one panel as bfloat16 by the CPU's own conversion (VCVTNE2PS2BF16: round to nearest even,
// as torch rounds; the products are never subnormal), in pairs of inputs or in plain rows (see dequantize_bf16)
__attribute__((target("avx512bf16"))) void dequantize_bf16_units(const int8_t* __restrict__ q,
                                                                 const at::Half* __restrict__ scales, int64_t k0,
                                                                 int64_t kc, int64_t block_n, bool pairs,
                                                                 at::BFloat16* __restrict__ out) {
  // the conversion gives 16 values of one input, then 16 of the next; the pairs layout wants them interleaved
  alignas(64) static const int16_t interleave[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                     8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i order = _mm512_load_si512(interleave);
  for (int64_t g = k0; g < k0 + kc; g += GROUP) {
    const at::Half* group = scales + (g / GROUP) * block_n;
    for (int64_t j = 0; j < block_n; j += 32) {
      const __m512 s0 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + j)));
      const __m512 s1 = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + j + 16)));
      if (pairs) {  // inputs i and i + 1 of 16 columns a step, twice
        for (int64_t i = g; i < g + GROUP; i += 2) {
          const int8_t* row = q + i * block_n + j;
          at::BFloat16* target = out + ((i - k0) / 2) * block_n * 2 + j * 2;
          const __m512i low = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(products(row + block_n, s0),
                                                                            products(row, s0)));
          const __m512i high = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(products(row + block_n + 16, s1),
                                                                             products(row + 16, s1)));
          _mm512_storeu_si512(target, _mm512_permutexvar_epi16(order, low));
          _mm512_storeu_si512(target + 32, _mm512_permutexvar_epi16(order, high));
        }
      } else {  // one input's 32 columns a step
        for (int64_t i = g; i < g + GROUP; ++i) {
          const int8_t* row = q + i * block_n + j;
          _mm512_storeu_si512(out + (i - k0) * block_n + j,
                              reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(products(row + 16, s1), products(row, s0))));
        }
      }
    }
  }
}

const bool BF16_UNITS = __builtin_cpu_supports("avx512bf16");
#endif

// inputs [k0, k0 + kc) of one panel as bfloat16: each value the float32 product q * scale (exact) rounded to nearest
// even, as torch rounds float32 to bfloat16. In pairs of inputs (the layout the bfloat16 micro-kernel reads without
// AMX: input i of column j at ((i / 2) * block_n + j) * 2 + i % 2), or plain rows (i * block_n + j). k0 and kc are
// multiples of 32.
void dequantize_bf16(const int8_t* __restrict__ q, const at::Half* __restrict__ scales, int64_t k0, int64_t kc,
                     int64_t block_n, bool pairs, at::BFloat16* __restrict__ out) {
#ifdef CBGEN_DEQUANTIZE_BF16
  if (BF16_UNITS && block_n % 32 == 0) {
    return dequantize_bf16_units(q, scales, k0, kc, block_n, pairs, out);
  }
#endif
  for (int64_t i = 0; i < kc; ++i) {
    const at::Half* group = scales + ((k0 + i) / GROUP) * block_n;
    const int8_t* row = q + (k0 + i) * block_n;
    at::BFloat16* target = pairs ? out + (i / 2) * block_n * 2 + i % 2 : out + i * block_n;
    const int64_t step = pairs ? 2 : 1;
    for (int64_t j = 0; j < block_n; ++j) {
      target[j * step] = at::BFloat16(static_cast<float>(row[j]) * static_cast<float>(group[j]));
    }
  }
}

// The kernel's loop (see the file's head) over rows of T, float or bfloat16, the type the chunks are dequantized into
template <typename T>
void run(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& packed_scales, const float* bias_ptr,
         at::Tensor& out) {
  constexpr bool vnni = std::is_same_v<T, at::BFloat16>;
  const bool amx = vnni && cpublas::could_pack(at::kBFloat16);  // ATen's packed layout, as linear_pack makes it
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  const int64_t chunk = !vnni ? KC : k <= BF16_WHOLE_K ? k : KC_BF16;  // inputs dequantized at a time
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
    std::vector<T> weights(chunk * block_n);
    std::vector<T> plain(amx ? chunk * block_n : 0);
    std::vector<float> scale(block_n);
    std::vector<float> sums(std::min(group, row_blocks) * BLOCK_M * block_n);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t p = task % panels, g = task / panels;
      const int64_t first_block = g * group, blocks = std::min(group, row_blocks - first_block);
      const int8_t* panel = b + p * k * block_n;
      const at::Half* panel_scales = s + p * groups * block_n;
      for (int64_t k0 = 0; k0 < k; k0 += chunk) {
        const int64_t kc = std::min(chunk, k - k0);
        if constexpr (vnni) {
          if (amx) {  // ATen's packed layout for AMX (the one linear_pack makes there): plain rows, then packed
            dequantize_bf16(panel, panel_scales, k0, kc, block_n, false, plain.data());
            cpublas::pack(kc, block_n, block_n, block_n, at::kBFloat16, at::kBFloat16, plain.data(), weights.data());
          } else {
            dequantize_bf16(panel, panel_scales, k0, kc, block_n, true, weights.data());
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
