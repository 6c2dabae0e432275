// Batch-invariant linear layers: out = x W^T + bias, every output block of BLOCK_M rows x block_n columns computed
// by one thread with oneDNN's brgemm micro-kernel (through ATen's at::native::cpublas::brgemm): one call per chunk of
// inputs, each adding to the sums the one before left (bfloat16 on AMX: one call over the whole reduction).
//
// Invariant by construction. A micro-kernel call adds each output's products in one order, fixed by the layer's K and
// block_n (its chunks, its register blocking over K, AMX tiles of 32 bfloat16 pairs or one FMA per k): the rows of the
// call only say how many accumulators it fills, never in what order one of them sums. Each block is computed by one
// thread, chunk after chunk, so a row's bits do not depend on how many rows share the layer's call, where it sits among
// them or how many threads run; the float32 sum is rounded once, with the bias added before (as oneDNN's linear does).
// A chunk is 64 KiB of the panel (CHUNK_FLOATS / block_n float32 inputs, twice as many bfloat16 ones), kept in a
// core's L2 with the block's rows for those inputs: over the whole reduction at once, a 1B model's down projection
// (K 8192) ran at a third of the speed in float32 on AVX2, and at 0.6-0.7x in bfloat16 on an AVX-512 BF16 CPU.
// Measured (the tests): a row alone, among 1-600 others and on one or two threads, bitwise; float32 within rounding of
// torch's linear, at every panel width.
//
// Why this and not oneDNN's linear primitive in fixed tiles (cbgen.model.invariant's fallback): a primitive picks
// its kernel, blocking and thread split by the call's shape, so invariance there needs every call padded to a few
// probed tile shapes, a call each; here the loop is ours. On a 2-core Sapphire Rapids (AMX) in bfloat16 at a decode
// step's 64 rows the embedded model's projections cost 0.4-0.6x one stock call (the fixed tiles 0.9-1.0x), and at
// 200-1,024 rows 0.5-1.4x (the tiles 1.2-2x).
//
// The weight is packed once (linear_pack): split into panels of block_n output columns (the last zero-padded),
// each stored K x block_n; in bfloat16 in the pair-interleaved (VNNI) layout the micro-kernel reads: ATen's own
// pack on AMX, the plain pair interleave on other CPUs with bfloat16 units. The kernel serves float32 on AVX2 and
// up, bfloat16 with bfloat16 units (cbgen.model.tiles_kernel says which): elsewhere ATen would fall back to a BLAS
// call, whose bits move with the shape.

#include <ATen/core/Tensor.h>  // not ATen/ATen.h: only what is used, a third of the build time less
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>
#if defined(CPU_CAPABILITY_AVX2) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>  // the float32 decode-step kernel below: AVX2 builds (AVX-512 ones keep brgemm: unmeasured)
#define CBGEN_DECODE_32 1
#endif

namespace cbgen_kernels {
namespace {

namespace cpublas = at::native::cpublas;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t W = Vec::size();
constexpr int64_t BLOCK_M = 64;  // rows a call: a decode step's; a call's last block has its own row count
constexpr int64_t CHUNK_FLOATS = 16384;  // a call adds 64 KiB of the panel: CHUNK_FLOATS / block_n float32 inputs
// bfloat16 layers of up to this many inputs add them in one call (2-core Zen 4: chunked calls cost 1.03-1.08x at
// SmolLM2's K of 576 and 1.01-1.02x at 1,536, alike at 2,048, 0.6-0.75x at 8,192)
constexpr int64_t BF16_WHOLE_K = 2048;
constexpr int64_t PANELS_CACHED = 1 << 18;  // bytes of weight panels a group of blocks shares: half of a Zen 3's L2

// Panel p of the weight [N, K] as K x block_n (output columns past N zero): `pairs` interleaves each two rows of K
template <typename T>
void panel(const T* weight, int64_t n, int64_t k, int64_t p, int64_t block_n, bool pairs, T* out) {
  const int64_t columns = std::max<int64_t>(0, std::min(block_n, n - p * block_n));
  const T* first = weight + p * block_n * k;
  for (int64_t i = 0; i < k; ++i) {  // written in order; the block_n rows read stay in L1 across 16 or more i
    T* target = pairs ? out + (i / 2) * block_n * 2 + i % 2 : out + i * block_n;
    const int64_t step = pairs ? 2 : 1;
    for (int64_t j = 0; j < columns; ++j) {
      target[j * step] = first[j * k + i];
    }
    for (int64_t j = columns; j < block_n; ++j) {
      target[j * step] = T(0);
    }
  }
}

// [N, K] -> [P, K, block_n]: panels of block_n output columns, the last zero-padded; bfloat16 pair-interleaved
// (ATen's pack on AMX), one panel per task
at::Tensor linear_pack(const at::Tensor& weight_in, int64_t block_n) {
  TORCH_CHECK(weight_in.dim() == 2 && weight_in.device().is_cpu(), "linear_pack: a 2-D CPU weight");
  const at::Tensor weight = weight_in.contiguous();
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + block_n - 1) / block_n;
  at::Tensor out = at::empty({panels, k, block_n}, weight.options());
  if (weight.scalar_type() == at::kFloat) {
    at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        panel(weight.data_ptr<float>(), n, k, p, block_n, false, out.data_ptr<float>() + p * k * block_n);
      }
    });
    return out;
  }
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16, "linear_pack: float32 or bfloat16");
  TORCH_CHECK(k % 2 == 0, "linear_pack: bfloat16 needs an even number of input features");
  const bool amx = cpublas::could_pack(at::kBFloat16);  // ATen packs bfloat16 for AMX only
  using BF16 = at::BFloat16;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<BF16> plain(amx ? k * block_n : 0);
    for (int64_t p = begin; p < end; ++p) {
      BF16* target = out.data_ptr<BF16>() + p * k * block_n;
      if (!amx) {
        panel(weight.data_ptr<BF16>(), n, k, p, block_n, true, target);
        continue;
      }
      panel(weight.data_ptr<BF16>(), n, k, p, block_n, false, plain.data());
      cpublas::pack(k, block_n, block_n, block_n, at::kBFloat16, at::kBFloat16, plain.data(), target);
    }
  });
  return out;
}

// One block's float32 sums (rows x block_n, ld block_n) plus the bias, rounded into `width` columns of the output
template <typename T>
void store_block(const float* sums, int64_t rows, int64_t block_n, int64_t width, const float* bias, T* out,
                 int64_t ld_out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = sums + r * block_n;
    T* dst = out + r * ld_out;
    int64_t c = 0;
    for (; c + 2 * W <= width; c += 2 * W) {
      Vec a = Vec::loadu(src + c), b = Vec::loadu(src + c + W);
      if (bias != nullptr) {
        a = a + Vec::loadu(bias + c);
        b = b + Vec::loadu(bias + c + W);
      }
      if constexpr (std::is_same_v<T, float>) {
        a.store(dst + c);
        b.store(dst + c + W);
      } else {
        at::vec::convert_from_float<T>(a, b).store(dst + c);
      }
    }
    for (; c < width; ++c) {
      dst[c] = static_cast<T>(bias != nullptr ? src[c] + bias[c] : src[c]);
    }
  }
}

#ifdef CBGEN_DECODE_32
// Decode-sized float32 calls over 32-column panels, written out so that the weight stream overlaps the arithmetic.
// brgemm reads a chunk's panel from memory while its first rows compute, then computes the other rows from cache: at
// a decode step's 16 rows (about 8 flops a weight byte, near this kind of machine's balance) memory and arithmetic
// ran one after the other. Here a chunk is computed 64 inputs at a time (their 8 KiB of panel stays in L1 while every
// row block passes over it), and each row block's loop prefetches a share of the next 64 inputs' panel, so that the
// next lines arrive while these compute. Same arithmetic as brgemm's, so the same bits (the tests compare the two at
// every decode row count, and with a row alone): per chunk each output's products summed from zero in input order,
// one FMA each (3 rows x 32 columns of accumulators, the panel's vectors as the FMAs' memory operands, as brgemm's
// AVX2 kernel), then added to the sums of the chunks before. Measured (2-core AMD EPYC Zen 3, Llama-3.2-1B's
// projections, weights from memory, alternating rounds): 0.70-0.85x brgemm's time at 16 rows; mixed at 8, 24 and 32;
// slower at 1-4 and 64 rows: so used for DECODE_MIN_ROWS to DECODE_MAX_ROWS only.
constexpr int64_t DECODE_MIN_ROWS = 12, DECODE_MAX_ROWS = 24;
constexpr int64_t DECODE_STEP = 64;  // inputs a pass: 8 KiB of a 32-column panel
constexpr int64_t DECODE_PREFETCH = 22;  // lines of the next pass a row block's loop asks for: 128 over ~6 blocks

template <int R>  // R rows (1-3) x 32 columns over `kn` inputs; `acc` (ld 32) zeroed first or added to
inline void decode_block(const float* a, int64_t lda, const float* b, int64_t kn, float* acc, bool zero,
                         uintptr_t& prefetch, uintptr_t prefetch_end) {
  __m256 c[R][4];
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 4; ++v) {
      c[r][v] = zero ? _mm256_setzero_ps() : _mm256_loadu_ps(acc + r * 32 + v * 8);
    }
  }
  const int64_t left = prefetch < prefetch_end ? static_cast<int64_t>(prefetch_end - prefetch) / 64 : 0;
  const int64_t lines = std::min<int64_t>(DECODE_PREFETCH, left);
  uintptr_t next = prefetch;
  for (int64_t k = 0; k < kn; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(next), _MM_HINT_T0);
    next += k < lines ? 64 : 0;
    const float* row = b + k * 32;
    for (int r = 0; r < R; ++r) {  // unrolled by the compiler (R and 4 are constants)
      const __m256 x = _mm256_broadcast_ss(a + r * lda + k);
      for (int v = 0; v < 4; ++v) {
        c[r][v] = _mm256_fmadd_ps(x, _mm256_loadu_ps(row + v * 8), c[r][v]);
      }
    }
  }
  prefetch = next;
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < 4; ++v) {
      _mm256_storeu_ps(acc + r * 32 + v * 8, c[r][v]);
    }
  }
}

void run_decode(const at::Tensor& x, const at::Tensor& packed, const float* bias, at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), ld_x = x.stride(0), n = out.size(1);
  const int64_t panels = packed.size(0), chunk = CHUNK_FLOATS / 32;
  const float* a = x.data_ptr<float>();
  const float* b = packed.data_ptr<float>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(m * 32), acc(m * 32);
    for (int64_t p = begin; p < end; ++p) {  // a thread's panels lie one after another: the last pass of one
      // prefetches the first of the next
      const float* panel = b + p * k * 32;
      for (int64_t k0 = 0; k0 < k; k0 += chunk) {
        const int64_t kk = std::min(chunk, k - k0);
        for (int64_t s = 0; s < kk; s += DECODE_STEP) {
          const int64_t kn = std::min(DECODE_STEP, kk - s);
          const float* step = panel + (k0 + s) * 32;
          uintptr_t prefetch = reinterpret_cast<uintptr_t>(step + kn * 32);  // the next pass's panel lines
          const uintptr_t prefetch_end = prefetch + DECODE_STEP * 32 * sizeof(float);
          const float* rows = a + k0 + s;
          int64_t r = 0;
          for (; r + 3 <= m; r += 3) {
            decode_block<3>(rows + r * ld_x, ld_x, step, kn, acc.data() + r * 32, s == 0, prefetch, prefetch_end);
          }
          if (m - r == 2) {
            decode_block<2>(rows + r * ld_x, ld_x, step, kn, acc.data() + r * 32, s == 0, prefetch, prefetch_end);
          } else if (m - r == 1) {
            decode_block<1>(rows + r * ld_x, ld_x, step, kn, acc.data() + r * 32, s == 0, prefetch, prefetch_end);
          }
        }
        for (int64_t i = 0; i < m * 32; ++i) {  // brgemm's C + acc (the first chunk: acc)
          sums[i] = k0 == 0 ? acc[i] : sums[i] + acc[i];
        }
      }
      const float* panel_bias = bias == nullptr ? nullptr : bias + p * 32;
      store_block<float>(sums.data(), m, 32, std::min<int64_t>(32, n - p * 32), panel_bias, o + p * 32, n);
    }
  });
}
#endif

template <typename T>
void run(const at::Tensor& x, const at::Tensor& packed, const float* bias, at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), ld_x = x.stride(0), n = out.size(1);
  const int64_t panels = packed.size(0), block_n = packed.size(2);
  const int64_t row_blocks = (m + BLOCK_M - 1) / BLOCK_M;
  const bool vnni = std::is_same_v<T, at::BFloat16>;
  // float32 adds a row's products a chunk of inputs at a time (each chunk's A and B stay in a core's L2), chunk after
  // chunk into the same sums: an order fixed by K and block_n alone. bfloat16 too, in chunks of the same bytes (the
  // pair-interleaved layout's chunks are its rows of pairs), where K is over BF16_WHOLE_K; on AMX, whose packed
  // layout ATen owns, in one call
  const bool whole = vnni && (k <= BF16_WHOLE_K || cpublas::could_pack(at::kBFloat16));
  const int64_t step = whole ? k : std::max<int64_t>(vnni ? 2 : 1, CHUNK_FLOATS * 4 / (block_n * x.element_size()));
  const T* a = x.data_ptr<T>();
  const T* b = packed.data_ptr<T>();
  T* o = out.data_ptr<T>();
  // blocks in groups of `chunk` panels: within a group row block by row block, so that the group's panels stay in
  // a core's cache while the rows pass over them, and a row block while it meets the group's panels
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(panels, PANELS_CACHED / (k * block_n * x.element_size())));
  at::parallel_for(0, panels * row_blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(BLOCK_M * block_n);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t group = task / (chunk * row_blocks), in_group = task % (chunk * row_blocks);
      const int64_t width_g = std::min(chunk, panels - group * chunk);
      const int64_t p = group * chunk + in_group % width_g, first = (in_group / width_g) * BLOCK_M;
      const int64_t rows = std::min(BLOCK_M, m - first), width = std::min(block_n, n - p * block_n);
      for (int64_t k0 = 0; k0 < k; k0 += step) {
        cpublas::brgemm(rows, block_n, std::min(step, k - k0), ld_x, block_n, block_n, k0 > 0,
                        a + first * ld_x + k0, b + p * k * block_n + k0 * block_n, sums.data(), vnni);
      }
      store_block<T>(sums.data(), rows, block_n, width, bias == nullptr ? nullptr : bias + p * block_n,
                     o + first * n + p * block_n, n);
    }
    if (vnni) {
      cpublas::brgemm_release(vnni);
    }
  });
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                  int64_t out_features, bool decode) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear_tiles: rows of contiguous features");
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == x.size(1) && packed.scalar_type() == x.scalar_type(),
              "linear_tiles: the weight packed by linear_pack for these rows");
  TORCH_CHECK(packed.size(0) * packed.size(2) >= out_features, "linear_tiles: more output features than packed");
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) {
    return out;
  }
  at::Tensor bias_f;  // float32: the caller's, or a converted copy (cbgen.model.tiles_kernel converts it once)
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == out_features, "linear_tiles: a bias of out_features");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const float* bias_ptr = bias_f.defined() ? bias_f.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kBFloat16) {
    run<at::BFloat16>(x, packed, bias_ptr, out);
  } else {
    TORCH_CHECK(x.scalar_type() == at::kFloat, "linear_tiles: float32 or bfloat16");
#ifdef CBGEN_DECODE_32
    if (decode && packed.size(2) == 32 && x.size(0) >= DECODE_MIN_ROWS && x.size(0) <= DECODE_MAX_ROWS) {
      run_decode(x, packed, bias_ptr, out);
      return out;
    }
#endif
    run<float>(x, packed, bias_ptr, out);
  }
  return out;
}

at::Tensor linear_tiles(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                        int64_t out_features) {
  return linear(x, packed, bias, out_features, true);
}

// brgemm at every row count (the decode-step kernel off): the tests and benchmarks/linear_kernels.py compare the two
at::Tensor linear_tiles_brgemm(const at::Tensor& x, const at::Tensor& packed, const std::optional<at::Tensor>& bias,
                               int64_t out_features) {
  return linear(x, packed, bias, out_features, false);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(cbgen_kernels, m) {
  m.def("linear_pack(Tensor weight, int block_n) -> Tensor");
  m.def("linear_tiles(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
  m.def("linear_tiles_brgemm(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor");
}

TORCH_LIBRARY_IMPL(cbgen_kernels, CPU, m) {
  m.impl("linear_pack", &linear_pack);
  m.impl("linear_tiles", &linear_tiles);
  m.impl("linear_tiles_brgemm", &linear_tiles_brgemm);
}

}  // namespace cbgen_kernels
