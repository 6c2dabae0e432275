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
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
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

// ---- int8 weights times int8 rows (`int8_linear_w8a8`, `--quantize w8a8`) ----
// Each row is quantized at the call as Q8_0 quantizes weights, which is what llama.cpp's Q8_0 path does to its
// activations: every 32 inputs scaled by d = max |x| / 127 (kept in float32: a float16 one overflows past 8.3e6),
// q = x * (1 / d) rounded to nearest even and clamped to +-127 (a group of zeros is all 0). Then for each output, group after group
// in order: S = the group's 32 products q_x * q_w summed exactly in int32, and sum = fma(float(S), d_w * d_x, sum),
// d_w * d_x rounded to float32 first. A row's bits are its own (its quantization, the groups' order and each fma are
// fixed by K alone), on every CPU kind: with AVX-512 VNNI the 64-column panels are read four inputs at a time
// (VPDPBUSD: 64 products an instruction, twice VDPBF16PS's), arranged for it once at load (int8_w8a8_arrange_) or a
// chunk at a time in the call; elsewhere a plain loop computes the same bits slowly.
constexpr int64_t W8A8_KC = 512;  // inputs of a panel rearranged for VPDPBUSD at a time (32 KiB)
constexpr int64_t W8A8_ROWS = 6;  // rows a micro-kernel call: 6 x 2 int32 and 6 x 2 float32 vectors in registers

struct QuantizedRows {
  std::vector<int8_t> q;     // [m, k]
  std::vector<float> d;      // [m, k / 32]: each group's scale
  std::vector<int32_t> low;  // [m, k / 32]: -128 x the group's sum of q (the weights are read as q_w + 128)
};

template <typename T>
void quantize_rows_portable(const T* x, int64_t first, int64_t last, int64_t k, QuantizedRows& rows) {
  for (int64_t r = first; r < last; ++r) {
    for (int64_t g = 0; g < k / GROUP; ++g) {
      const T* in = x + r * k + g * GROUP;
      float top = 0.f;
      for (int64_t i = 0; i < GROUP; ++i) top = std::max(top, std::abs(static_cast<float>(in[i])));
      const float d = top / 127.f;
      const float inverse = d > 0.f ? 1.f / d : 0.f;
      int32_t sum = 0;
      for (int64_t i = 0; i < GROUP; ++i) {
        const float v = std::nearbyint(static_cast<float>(in[i]) * inverse);
        const int32_t q = static_cast<int32_t>(std::min(127.f, std::max(-127.f, v)));
        rows.q[r * k + g * GROUP + i] = static_cast<int8_t>(q);
        sum += q;
      }
      rows.d[r * (k / GROUP) + g] = d;
      rows.low[r * (k / GROUP) + g] = -128 * sum;
    }
  }
}

#ifdef CBGEN_DEQUANTIZE_BF16
inline __m512 load_16(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load_16(const at::BFloat16* x) {  // exact: a bfloat16 is a float32's upper half
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x))), 16));
}

inline __m512i quantize_16(__m512 v, __m512 inverse) {
  const __m512i q = _mm512_cvt_roundps_epi32(_mm512_mul_ps(v, inverse), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_min_epi32(_mm512_max_epi32(q, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
}

// quantize_rows_portable's arithmetic, 32 inputs at a time
template <typename T>
void quantize_rows_512(const T* x, int64_t first, int64_t last, int64_t k, QuantizedRows& rows) {
  for (int64_t r = first; r < last; ++r) {
    for (int64_t g = 0; g < k / GROUP; ++g) {
      const T* in = x + r * k + g * GROUP;
      const __m512 a = load_16(in), b = load_16(in + 16);
      const float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
      const float d = top / 127.f;
      const __m512 inverse = _mm512_set1_ps(d > 0.f ? 1.f / d : 0.f);
      const __m512i qa = quantize_16(a, inverse), qb = quantize_16(b, inverse);
      int8_t* out = rows.q.data() + r * k + g * GROUP;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm512_cvtepi32_epi8(qa));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16), _mm512_cvtepi32_epi8(qb));
      rows.d[r * (k / GROUP) + g] = d;
      rows.low[r * (k / GROUP) + g] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    }
  }
}

// `quads` x 4 inputs of a 64-column panel as VPDPBUSD reads them: for each four inputs, four vectors of 16 columns x
// 4 inputs, each value q_w + 128 as an unsigned byte (q_w ^ 0x80); vector v's dword j holds column 16 (j / 4) + 4 v +
// j % 4 (the order two rounds of unpacking give). Each 256 bytes become the same 256 bytes' places, so `in` may be
// `out` (int8_w8a8_arrange_ does it once at load; otherwise each call does it a chunk at a time).
void arrange_quads_64(const int8_t* in, int64_t quads, uint8_t* out) {
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
  for (int64_t t = 0; t < quads; ++t) {
    const int8_t* r = in + t * 256;
    const __m512i r0 = _mm512_loadu_si512(r), r1 = _mm512_loadu_si512(r + 64);
    const __m512i r2 = _mm512_loadu_si512(r + 128), r3 = _mm512_loadu_si512(r + 192);
    const __m512i a = _mm512_unpacklo_epi8(r0, r1), b = _mm512_unpackhi_epi8(r0, r1);
    const __m512i c = _mm512_unpacklo_epi8(r2, r3), d = _mm512_unpackhi_epi8(r2, r3);
    uint8_t* o = out + t * 256;
    _mm512_storeu_si512(o, _mm512_xor_si512(_mm512_unpacklo_epi16(a, c), flip));
    _mm512_storeu_si512(o + 64, _mm512_xor_si512(_mm512_unpackhi_epi16(a, c), flip));
    _mm512_storeu_si512(o + 128, _mm512_xor_si512(_mm512_unpacklo_epi16(b, d), flip));
    _mm512_storeu_si512(o + 192, _mm512_xor_si512(_mm512_unpackhi_epi16(b, d), flip));
  }
}

// the scales of groups [k0 / 32, (k0 + kc) / 32) of a 64-column panel as float32, in arrange_quads_64's column order
void arrange_scales_64(const at::Half* __restrict__ scales, int64_t k0, int64_t kc, float* __restrict__ out_scales) {
  // vector v's 128-bit lane L holds columns 16 L + 4 v .. + 3: lane v of the L-th 16 scales (a 4 x 4 lane transpose)
  for (int64_t g = k0 / GROUP; g < (k0 + kc) / GROUP; ++g) {
    const __m256i* half = reinterpret_cast<const __m256i*>(scales + g * 64);
    const __m512 s0 = _mm512_cvtph_ps(_mm256_loadu_si256(half)), s1 = _mm512_cvtph_ps(_mm256_loadu_si256(half + 1));
    const __m512 s2 = _mm512_cvtph_ps(_mm256_loadu_si256(half + 2)), s3 = _mm512_cvtph_ps(_mm256_loadu_si256(half + 3));
    const __m512 t0 = _mm512_shuffle_f32x4(s0, s1, 0x44), t1 = _mm512_shuffle_f32x4(s0, s1, 0xEE);
    const __m512 t2 = _mm512_shuffle_f32x4(s2, s3, 0x44), t3 = _mm512_shuffle_f32x4(s2, s3, 0xEE);
    float* o = out_scales + (g - k0 / GROUP) * 64;
    _mm512_storeu_ps(o, _mm512_shuffle_f32x4(t0, t2, 0x88));
    _mm512_storeu_ps(o + 16, _mm512_shuffle_f32x4(t0, t2, 0xDD));
    _mm512_storeu_ps(o + 32, _mm512_shuffle_f32x4(t1, t3, 0x88));
    _mm512_storeu_ps(o + 48, _mm512_shuffle_f32x4(t1, t3, 0xDD));
  }
}

// R rows x 32 columns (vectors 2 half and 2 half + 1 of the rearranged chunk) over the chunk's groups, into `sums`
// (R rows of 64, in the rearranged column order)
template <int R>
__attribute__((target("avx512vnni"))) void w8a8_rows(const uint8_t* __restrict__ chunk,
                                                      const float* __restrict__ chunk_scales, int64_t groups,
                                                      const int8_t* __restrict__ xq, int64_t k,
                                                      const float* __restrict__ xd, const int32_t* __restrict__ xlow,
                                                      int64_t row_groups, int half, bool first,
                                                      float* __restrict__ sums) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) {
    for (int h = 0; h < 2; ++h) {
      acc[r][h] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(sums + r * 64 + (2 * half + h) * 16);
    }
  }
  for (int64_t g = 0; g < groups; ++g) {
    __m512i s[R][2];
    for (int r = 0; r < R; ++r) s[r][0] = s[r][1] = _mm512_set1_epi32(xlow[r * row_groups + g]);
    for (int64_t t = 0; t < GROUP / 4; ++t) {
      const uint8_t* b = chunk + (g * (GROUP / 4) + t) * 256 + half * 128;
      const __m512i b0 = _mm512_loadu_si512(b), b1 = _mm512_loadu_si512(b + 64);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, xq + r * k + g * GROUP + t * 4, 4);
        const __m512i a = _mm512_set1_epi32(four);
        s[r][0] = _mm512_dpbusd_epi32(s[r][0], b0, a);
        s[r][1] = _mm512_dpbusd_epi32(s[r][1], b1, a);
      }
    }
    const __m512 w0 = _mm512_loadu_ps(chunk_scales + g * 64 + half * 32);
    const __m512 w1 = _mm512_loadu_ps(chunk_scales + g * 64 + half * 32 + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 dx = _mm512_set1_ps(xd[r * row_groups + g]);
      acc[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][0]), _mm512_mul_ps(w0, dx), acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[r][1]), _mm512_mul_ps(w1, dx), acc[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int h = 0; h < 2; ++h) _mm512_storeu_ps(sums + r * 64 + (2 * half + h) * 16, acc[r][h]);
  }
}

// w8a8_rows for 1 .. W8A8_ROWS rows
constexpr decltype(&w8a8_rows<1>) W8A8_ROWS_OF[W8A8_ROWS] = {w8a8_rows<1>, w8a8_rows<2>, w8a8_rows<3>,
                                                             w8a8_rows<4>, w8a8_rows<5>, w8a8_rows<6>};

// a machine held to AVX-512 without VNNI (cbgen.config.cpu.HOLDS: oneDNN's AVX512_CORE) runs the plain loop, as
// that machine would
bool held_below_vnni() {
  const char* isa = std::getenv("ONEDNN_MAX_CPU_ISA");
  return isa != nullptr && std::strcmp(isa, "AVX512_CORE") == 0;
}
const bool VNNI_UNITS = __builtin_cpu_supports("avx512vnni") && !held_below_vnni();
#endif

// rows [first, last) of one panel over inputs [0, k), the plain loop: the same operations as w8a8_rows, column by
// column (sums in the panel's own column order)
void w8a8_portable(const int8_t* __restrict__ panel, const at::Half* __restrict__ scales, int64_t k,
                   int64_t block_n, const QuantizedRows& rows, int64_t first, int64_t last,
                   float* __restrict__ sums) {
  const int64_t groups = k / GROUP;
  for (int64_t r = first; r < last; ++r) {
    for (int64_t c = 0; c < block_n; ++c) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        int32_t s = rows.low[r * groups + g];
        for (int64_t i = 0; i < GROUP; ++i) {
          s += static_cast<int32_t>(rows.q[r * k + g * GROUP + i]) *
               (static_cast<int32_t>(panel[(g * GROUP + i) * block_n + c]) + 128);
        }
        const float w = static_cast<float>(scales[g * block_n + c]) * rows.d[r * groups + g];
        acc = std::fma(static_cast<float>(s), w, acc);
      }
      sums[(r - first) * block_n + c] = acc;
    }
  }
}

// whether this build and CPU run the VPDPBUSD loop for panels of `block_n` columns (else the plain loop)
bool w8a8_vnni(int64_t block_n) {
#ifdef CBGEN_DEQUANTIZE_BF16
  return VNNI_UNITS && block_n == 64;
#else
  (void)block_n;
  return false;
#endif
}

template <typename T>
void run_w8a8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& packed_scales, const float* bias_ptr,
              bool arranged, at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), n = out.size(1);
  const int64_t panels = packed.size(0), block_n = packed.size(2), groups = k / GROUP;
  const bool vnni = w8a8_vnni(block_n);
  TORCH_CHECK(vnni || !arranged, "int8_linear_w8a8: panels arranged for VPDPBUSD on a CPU or build without it");
  const T* a = x.data_ptr<T>();
  QuantizedRows rows{std::vector<int8_t>(m * k), std::vector<float>(m * groups), std::vector<int32_t>(m * groups)};
  at::parallel_for(0, m, 1, [&](int64_t first, int64_t last) {
#ifdef CBGEN_DEQUANTIZE_BF16
    if (vnni) return quantize_rows_512(a, first, last, k, rows);
#endif
    quantize_rows_portable(a, first, last, k, rows);
  });
  const int8_t* b = packed.data_ptr<int8_t>();
  const at::Half* s = packed_scales.data_ptr<at::Half>();
  T* o = out.data_ptr<T>();
  // tasks as in run(): one panel and a group of rows, group by group (a group's quantized rows stay in cache)
  const int64_t group = std::max<int64_t>(BLOCK_M, ROWS_CACHED / k / BLOCK_M * BLOCK_M);
  const int64_t groups_m = (m + group - 1) / group;
  at::parallel_for(0, groups_m * panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> chunk(vnni && !arranged ? W8A8_KC * 64 : 0);
    std::vector<float> chunk_scales(vnni ? W8A8_KC / GROUP * 64 : 0);
    std::vector<float> sums(std::min(group, m) * block_n);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t p = task % panels, first_row = (task / panels) * group;
      const int64_t last_row = std::min(m, first_row + group);
      const int8_t* panel = b + p * k * block_n;
      const at::Half* panel_scales = s + p * groups * block_n;
      if (!vnni) {
        w8a8_portable(panel, panel_scales, k, block_n, rows, first_row, last_row, sums.data());
      }
#ifdef CBGEN_DEQUANTIZE_BF16
      for (int64_t k0 = 0; vnni && k0 < k; k0 += W8A8_KC) {
        const int64_t kc = std::min(W8A8_KC, k - k0), g0 = k0 / GROUP;
        const uint8_t* quads = reinterpret_cast<const uint8_t*>(panel + k0 * 64);  // arranged at load
        if (!arranged) {
          arrange_quads_64(panel + k0 * 64, kc / 4, chunk.data());
          quads = chunk.data();
        }
        arrange_scales_64(panel_scales, k0, kc, chunk_scales.data());
        for (int64_t r0 = first_row; r0 < last_row; r0 += W8A8_ROWS) {
          const int64_t count = std::min(W8A8_ROWS, last_row - r0);
          const int8_t* xq = rows.q.data() + r0 * k + k0;
          const float* xd = rows.d.data() + r0 * groups + g0;
          const int32_t* xlow = rows.low.data() + r0 * groups + g0;
          float* target = sums.data() + (r0 - first_row) * 64;
          for (int half = 0; half < 2; ++half) {
            W8A8_ROWS_OF[count - 1](quads, chunk_scales.data(), kc / GROUP, xq, k, xd, xlow, groups, half, k0 == 0,
                                    target);
          }
        }
      }
#endif
      const int64_t width = std::min(block_n, n - p * block_n);
      const float* panel_bias = bias_ptr == nullptr ? nullptr : bias_ptr + p * block_n;
      for (int64_t row = first_row; row < last_row; ++row) {
        const float* src = sums.data() + (row - first_row) * block_n;
        T* dst = o + row * n + p * block_n;
        for (int64_t i = 0; i < block_n; ++i) {
          // the sums' order: the rearranged one (vector i / 16, dword i % 16) after VPDPBUSD, the panel's otherwise
          const int64_t c = vnni ? 16 * ((i % 16) / 4) + 4 * (i / 16) + i % 4 : i;
          if (c < width) dst[c] = static_cast<T>(panel_bias == nullptr ? src[i] : src[i] + panel_bias[c]);
        }
      }
    }
  });
}

enum class Arithmetic { float32, bf16, w8a8 };

at::Tensor linear(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& packed_scales,
                  const std::optional<at::Tensor>& bias, int64_t out_features, Arithmetic arithmetic,
                  bool arranged = false) {
  const bool bf16 = arithmetic == Arithmetic::bf16;
  TORCH_CHECK(x_in.dim() == 2, "int8_linear: rows of features");
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar && packed.size(1) == x_in.size(1),
              "int8_linear: the weight packed by cbgen.model.int8.pack for these rows");
  TORCH_CHECK(packed_scales.scalar_type() == at::kHalf && packed_scales.size(0) == packed.size(0) &&
              packed_scales.size(1) * GROUP == packed.size(1) && packed_scales.size(2) == packed.size(2),
              "int8_linear: the scales packed with the weight");
  TORCH_CHECK(packed.size(0) * packed.size(2) >= out_features, "int8_linear: more output features than packed");
  TORCH_CHECK(!bf16 || x_in.scalar_type() == at::kBFloat16, "int8_linear_bf16: bfloat16 rows");
  // float32 rows: the caller's, or converted once a call; w8a8 quantizes bfloat16 rows as they are
  const bool keep_bf16 = bf16 || (arithmetic == Arithmetic::w8a8 && x_in.scalar_type() == at::kBFloat16);
  const at::Tensor x = x_in.to(keep_bf16 ? at::kBFloat16 : at::kFloat).contiguous();
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
  if (arithmetic == Arithmetic::w8a8) {
    TORCH_CHECK(x.size(1) % GROUP == 0, "int8_linear_w8a8: inputs in whole groups of 32");
    if (keep_bf16) {
      run_w8a8<at::BFloat16>(x, packed, packed_scales, bias_ptr, arranged, out);
    } else {
      run_w8a8<float>(x, packed, packed_scales, bias_ptr, arranged, out);
    }
  } else if (bf16) {
    run<at::BFloat16>(x, packed, packed_scales, bias_ptr, out);
  } else {
    run<float>(x, packed, packed_scales, bias_ptr, out);
  }
  return out.to(x_in.scalar_type());
}

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& packed_scales,
                       const std::optional<at::Tensor>& bias, int64_t out_features) {
  return linear(x, packed, packed_scales, bias, out_features, Arithmetic::float32);
}

at::Tensor int8_linear_bf16(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& packed_scales,
                            const std::optional<at::Tensor>& bias, int64_t out_features) {
  return linear(x, packed, packed_scales, bias, out_features, Arithmetic::bf16);
}

at::Tensor int8_linear_w8a8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& packed_scales,
                            const std::optional<at::Tensor>& bias, int64_t out_features, bool arranged) {
  return linear(x, packed, packed_scales, bias, out_features, Arithmetic::w8a8, arranged);
}

// a layer's 64-column panels arranged for VPDPBUSD in place, once (they then serve int8_linear_w8a8 alone)
void int8_w8a8_arrange_(at::Tensor packed) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kChar && packed.is_contiguous() &&
              packed.size(1) % 4 == 0 && w8a8_vnni(packed.size(2)),
              "int8_w8a8_arrange_: contiguous 64-column panels, on a CPU with AVX-512 VNNI");
#ifdef CBGEN_DEQUANTIZE_BF16
  int8_t* b = packed.data_ptr<int8_t>();
  const int64_t quads = packed.size(1) / 4;
  at::parallel_for(0, packed.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      int8_t* panel = b + p * packed.size(1) * 64;
      arrange_quads_64(panel, quads, reinterpret_cast<uint8_t*>(panel));
    }
  });
#endif
}

bool int8_w8a8_vnni(int64_t block_n) { return w8a8_vnni(block_n); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(cbgen_kernels, m) {
  m.def("int8_linear(Tensor x, Tensor packed, Tensor packed_scales, Tensor? bias, int out_features) -> Tensor");
  m.def("int8_linear_bf16(Tensor x, Tensor packed, Tensor packed_scales, Tensor? bias, int out_features) -> Tensor");
  m.def("int8_linear_w8a8(Tensor x, Tensor packed, Tensor packed_scales, Tensor? bias, int out_features, "
        "bool arranged=False) -> Tensor");
  m.def("int8_w8a8_arrange_(Tensor(a!) packed) -> ()");
  m.def("int8_w8a8_vnni(int block_n) -> bool", &int8_w8a8_vnni);  // no tensor: one kernel for every device
}

TORCH_LIBRARY_IMPL(cbgen_kernels, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int8_linear_bf16", &int8_linear_bf16);
  m.impl("int8_linear_w8a8", &int8_linear_w8a8);
  m.impl("int8_w8a8_arrange_", &int8_w8a8_arrange_);
}

}  // namespace cbgen_kernels
