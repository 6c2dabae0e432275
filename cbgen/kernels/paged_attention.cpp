// cbgen's paged attention for CPU: every query row of a continuous-batching step, prompt chunks and decode tokens
// together, in one call per layer, over keys and values read in place from transformers' paged cache.
//
// Invariant by construction: a query row's result is computed by one thread, from its own query and its own keys
// only, in a fixed order: its keys are visited in blocks of KEY_BLOCK whose edges lie at fixed absolute positions
// (multiples of KEY_BLOCK), each block's scores are dot products over the head dimension in one fixed order, and the
// blocks are folded into the row's running maximum, sum and accumulator (an online softmax in float32) one after the
// other. Which rows share a work item, how a prompt was chunked, how many rows the step has and how many threads run
// it change none of these operations, so none of them changes a bit of the result.
//
// Layout (what cbgen.attention.compiled passes):
//   out          [tokens, heads, dim]            written
//   query        [1, heads, tokens, dim]         any strides, dim contiguous
//   key, value   [1, kv_heads, tokens, dim]      this step's new keys and values, any strides, dim contiguous
//   k_cache      [slots, kv_heads, dim]          the layer's token view of the paged cache (rows contiguous)
//   v_cache      [slots', kv_heads, dim]        (slots' may differ from slots: only slots both hold are used)
//   read_index   [keys] int64                    each request's cached keys' slots, request by request (may be empty)
//   write_index  [tokens] int64                  where each new token's key and value go (empty: nothing written)
//   requests     [n, 5] int64                    q_start, q_length, k_start, k_length, first_position
// Request r attends its k_length keys: the first k_length - q_length are cached (slots read_index[k_start + i]), the
// last q_length are its own new tokens (rows q_start.. of key and value). Its key i lies at absolute position
// first_position + i. Query token j of the request is key k_length - q_length + j; it attends keys up to itself,
// and only the last `window` of them when window > 0. The new keys and values are written to the cache after every
// row has been attended (a sliding-window layer's new token may take the slot of a key an earlier token still reads).

#include <ATen/core/Tensor.h>  // not ATen/ATen.h: only what is used, a third of the build time less
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace cbgen_kernels {
namespace {

using Vec = at::vec::Vectorized<float>;

constexpr int64_t KEY_BLOCK = 32;  // keys folded into the online softmax at a time; edges at absolute positions
constexpr int64_t TILE_TOKENS = 4;  // query tokens of one request a work item attends (every head of each)

template <typename T>
inline Vec load_float(const T* src) {  // Vec::size() elements, as float
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(src);
  } else {
    Vec v;
    if constexpr (std::is_same_v<T, at::BFloat16>) {
      at::vec::load_fp32_from_bf16(src, v);
    } else {
      at::vec::load_fp32_from_fp16(src, v);
    }
    return v;
  }
}

template <typename T>
inline void store_float(const Vec& v, T* dst) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(dst);
  } else {
    alignas(64) float buffer[Vec::size()];
    v.store(buffer);
    at::vec::convert(buffer, dst, Vec::size());
  }
}

struct Request {
  int64_t q_start, q_length, k_start, k_length, first_position;
};

struct Item {
  int64_t request, token_begin, token_end, cost;
};

template <typename T>
struct Views {
  const T* query;
  int64_t q_head, q_token;
  const T* key;
  const T* value;
  int64_t k_head, k_token, v_head, v_token;
  const T* k_cache;
  const T* v_cache;
  int64_t kc_slot, kc_head, vc_slot, vc_head;
  const int64_t* read_index;
  T* out;
  int64_t o_token, o_head;
  int64_t heads, kv_heads, group, dim, window;
  float scale;
};

// R query rows of one token (`j` of request `r`): query heads head0 .. head0 + R - 1, which share one KV head, each
// over its keys with NV vectors of the head dimension in registers. Each key and value row is loaded (and converted)
// once for the R rows, but every row runs exactly the operations it would run alone, in the same order (see the
// top): R changes which rows share a loaded key, never a row's arithmetic.
template <typename T, int NV, int R>
void attend_rows(const Views<T>& w, const Request& r, int64_t j, int64_t head0) {
  constexpr int64_t W = Vec::size();
  const int64_t cached = r.k_length - r.q_length, own = cached + j;
  const int64_t first = w.window > 0 ? std::max<int64_t>(0, own - w.window + 1) : 0;
  const int64_t kv = head0 / w.group, token = r.q_start + j;
  const T* kc = w.k_cache + kv * w.kc_head;
  const T* vc = w.v_cache + kv * w.vc_head;
  const T* kn = w.key + kv * w.k_head + r.q_start * w.k_token;  // key i >= cached: new row i - cached
  const T* vn = w.value + kv * w.v_head + r.q_start * w.v_token;
  const int64_t* slots = w.read_index + r.k_start;

  Vec q[R][NV], acc[R][NV];
  const Vec scale(w.scale);
  for (int g = 0; g < R; ++g) {
    const T* q_row = w.query + (head0 + g) * w.q_head + token * w.q_token;
    for (int v = 0; v < NV; ++v) {
      q[g][v] = load_float(q_row + v * W) * scale;
      acc[g][v] = Vec(0.f);
    }
  }
  float row_max[R], row_sum[R];
  for (int g = 0; g < R; ++g) {
    row_max[g] = -std::numeric_limits<float>::infinity();
    row_sum[g] = 0.f;
  }
  alignas(64) float scores[R][KEY_BLOCK];
  for (int64_t a = first; a <= own;) {
    const int64_t edge = ((r.first_position + a) / KEY_BLOCK + 1) * KEY_BLOCK - r.first_position;
    const int64_t b = std::min(own + 1, edge);  // keys [a, b): these rows' part of one absolute block
    float block_max[R];
    for (int g = 0; g < R; ++g) block_max[g] = -std::numeric_limits<float>::infinity();
    for (int64_t i = a; i < b; ++i) {
      const T* k = i < cached ? kc + slots[i] * w.kc_slot : kn + (i - cached) * w.k_token;
      Vec s[R];
      for (int g = 0; g < R; ++g) s[g] = Vec(0.f);
      for (int v = 0; v < NV; ++v) {
        const Vec key = load_float(k + v * W);
        for (int g = 0; g < R; ++g) s[g] = at::vec::fmadd(q[g][v], key, s[g]);
      }
      for (int g = 0; g < R; ++g) {
        const float score = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, s[g]);
        scores[g][i - a] = score;
        block_max[g] = std::max(block_max[g], score);
      }
    }
    for (int g = 0; g < R; ++g) {
      for (int64_t i = b - a; i < KEY_BLOCK; ++i) scores[g][i] = -std::numeric_limits<float>::infinity();
      const float new_max = std::max(row_max[g], block_max[g]);
      const float alpha = std::exp(row_max[g] - new_max);  // 0 at the rows' first block
      const Vec shift(new_max);
      for (int64_t i = 0; i < KEY_BLOCK; i += W) (Vec::loadu(scores[g] + i) - shift).exp_u20().store(scores[g] + i);
      float block_sum = 0.f;
      for (int64_t i = 0; i < b - a; ++i) block_sum += scores[g][i];
      if (alpha != 1.f) {
        const Vec factor(alpha);
        for (int v = 0; v < NV; ++v) acc[g][v] = acc[g][v] * factor;
      }
      row_sum[g] = row_sum[g] * alpha + block_sum;
      row_max[g] = new_max;
    }
    for (int64_t i = a; i < b; ++i) {
      const T* val = i < cached ? vc + slots[i] * w.vc_slot : vn + (i - cached) * w.v_token;
      Vec p[R];
      for (int g = 0; g < R; ++g) p[g] = Vec(scores[g][i - a]);
      for (int v = 0; v < NV; ++v) {
        const Vec value = load_float(val + v * W);
        for (int g = 0; g < R; ++g) acc[g][v] = at::vec::fmadd(p[g], value, acc[g][v]);
      }
    }
    a = b;
  }
  for (int g = 0; g < R; ++g) {
    const Vec inverse(1.f / row_sum[g]);
    T* out = w.out + token * w.o_token + (head0 + g) * w.o_head;
    for (int v = 0; v < NV; ++v) store_float(acc[g][v] * inverse, out + v * W);
  }
}

constexpr int MAX_ROWS = 4;  // query heads of one KV head attended together (registers: MAX_ROWS x NV x 2 vectors)

template <typename T, int NV>
void attend_item(const Views<T>& w, const Request& r, const Item& item) {
  for (int64_t j = item.token_begin; j < item.token_end; ++j) {
    for (int64_t head = 0; head < w.heads;) {
      const int64_t in_group = head % w.group;
      switch (std::min<int64_t>(MAX_ROWS, w.group - in_group)) {
        case 1: attend_rows<T, NV, 1>(w, r, j, head); head += 1; break;
        case 2: attend_rows<T, NV, 2>(w, r, j, head); head += 2; break;
        case 3: attend_rows<T, NV, 3>(w, r, j, head); head += 3; break;
        default: attend_rows<T, NV, 4>(w, r, j, head); head += 4; break;
      }
    }
  }
}

template <typename T>
void write_new(const at::Tensor& key, const at::Tensor& value, const at::Tensor& k_cache, const at::Tensor& v_cache,
               const at::Tensor& write_index) {
  const int64_t tokens = write_index.numel(), kv_heads = key.size(1), dim = key.size(3);
  const T* k = key.const_data_ptr<T>();
  const T* v = value.const_data_ptr<T>();
  T* kc = k_cache.mutable_data_ptr<T>();
  T* vc = v_cache.mutable_data_ptr<T>();
  const int64_t* slots = write_index.const_data_ptr<int64_t>();
  const int64_t kh = key.stride(1), kt = key.stride(2), vh = value.stride(1), vt = value.stride(2);
  const int64_t ks = k_cache.stride(0), kch = k_cache.stride(1), vs = v_cache.stride(0), vch = v_cache.stride(1);
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t slot = slots[t];
      for (int64_t h = 0; h < kv_heads; ++h) {
        std::memcpy(kc + slot * ks + h * kch, k + h * kh + t * kt, dim * sizeof(T));
        std::memcpy(vc + slot * vs + h * vch, v + h * vh + t * vt, dim * sizeof(T));
      }
    }
  });
}

template <typename T>
void run(at::Tensor& out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
         const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& read_index,
         const at::Tensor& write_index, const std::vector<Request>& requests, int64_t window, double scale) {
  Views<T> w{};
  w.query = query.const_data_ptr<T>();
  w.q_head = query.stride(1);
  w.q_token = query.stride(2);
  w.key = key.const_data_ptr<T>();
  w.value = value.const_data_ptr<T>();
  w.k_head = key.stride(1);
  w.k_token = key.stride(2);
  w.v_head = value.stride(1);
  w.v_token = value.stride(2);
  w.k_cache = k_cache.const_data_ptr<T>();
  w.v_cache = v_cache.const_data_ptr<T>();
  w.kc_slot = k_cache.stride(0);
  w.kc_head = k_cache.stride(1);
  w.vc_slot = v_cache.stride(0);
  w.vc_head = v_cache.stride(1);
  w.read_index = read_index.numel() ? read_index.const_data_ptr<int64_t>() : nullptr;
  w.out = out.mutable_data_ptr<T>();
  w.o_token = out.stride(0);
  w.o_head = out.stride(1);
  w.heads = query.size(1);
  w.kv_heads = key.size(1);
  w.group = w.heads / w.kv_heads;
  w.dim = query.size(3);
  w.window = window;
  w.scale = static_cast<float>(scale);

  // Work items: a few tokens of one request, every head; the longest first, handed out one at a time so that the
  // threads finish together. Which thread computes a row, and beside which others, changes none of its bits.
  std::vector<Item> items;
  for (int64_t n = 0; n < static_cast<int64_t>(requests.size()); ++n) {
    const Request& r = requests[n];
    const int64_t cached = r.k_length - r.q_length;
    for (int64_t begin = 0; begin < r.q_length; begin += TILE_TOKENS) {
      const int64_t end = std::min(r.q_length, begin + TILE_TOKENS);
      const int64_t span = cached + end - (window > 0 ? std::max<int64_t>(0, cached + begin - window + 1) : 0);
      items.push_back({n, begin, end, span * (end - begin)});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t count = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), count);
  auto work = [&](auto attend) {
    at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
      for (int64_t worker = begin; worker < end; ++worker) {
        for (int64_t i = next.fetch_add(1); i < count; i = next.fetch_add(1)) {
          attend(w, requests[items[i].request], items[i]);
        }
      }
    });
  };
  // the head dimensions of the models cbgen knows, in whole vectors of this machine's width W
  constexpr int64_t W = Vec::size();
  switch (w.dim) {
    case 16: work(attend_item<T, 16 / W>); break;
    case 32: work(attend_item<T, 32 / W>); break;
    case 64: work(attend_item<T, 64 / W>); break;
    case 80: work(attend_item<T, 80 / W>); break;
    case 96: work(attend_item<T, 96 / W>); break;
    case 128: work(attend_item<T, 128 / W>); break;
    case 256: work(attend_item<T, 256 / W>); break;
    default: TORCH_CHECK(false, "paged_attention: head dimension ", w.dim, " is not supported");
  }
  if (write_index.numel()) write_new<T>(key, value, k_cache, v_cache, write_index);
}

void paged_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                     at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& read_index,
                     const at::Tensor& write_index, const at::Tensor& requests, int64_t window, double scale) {
  TORCH_CHECK(query.dim() == 4 && query.size(0) == 1, "query: [1, heads, tokens, dim]");
  TORCH_CHECK(key.dim() == 4 && value.dim() == 4 && key.sizes() == value.sizes(), "key, value: [1, kv_heads, tokens, dim]");
  TORCH_CHECK(query.size(1) % key.size(1) == 0, "heads must be a multiple of kv_heads");
  TORCH_CHECK(query.size(3) == key.size(3) && key.size(2) == query.size(2), "query and key disagree");
  TORCH_CHECK(out.dim() == 3 && out.size(0) == query.size(2) && out.size(1) == query.size(1) &&
                  out.size(2) == query.size(3) && out.stride(2) == 1,
              "out: [tokens, heads, dim], dim contiguous");
  TORCH_CHECK(query.stride(3) == 1 && key.stride(3) == 1 && value.stride(3) == 1, "the head dimension must be contiguous");
  TORCH_CHECK(k_cache.dim() == 3 && v_cache.dim() == 3 && k_cache.size(1) == key.size(1) &&
                  k_cache.size(2) == key.size(3) && k_cache.stride(2) == 1 && v_cache.size(1) == k_cache.size(1) &&
                  v_cache.size(2) == k_cache.size(2) && v_cache.stride(2) == 1,
              "k_cache, v_cache: [slots, kv_heads, dim], dim contiguous");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(key.scalar_type() == dtype && value.scalar_type() == dtype && out.scalar_type() == dtype &&
                  k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "query, key, value, caches and out must share one dtype");
  TORCH_CHECK(read_index.scalar_type() == at::kLong && write_index.scalar_type() == at::kLong &&
                  requests.scalar_type() == at::kLong && read_index.is_contiguous() && write_index.is_contiguous(),
              "indices: contiguous int64");
  TORCH_CHECK(write_index.numel() == 0 || write_index.numel() == key.size(2), "write_index: one slot per token");
  TORCH_CHECK(requests.dim() == 2 && requests.size(1) == 5, "requests: [n, 5]");
  const auto table = requests.contiguous();
  const int64_t* rows = table.const_data_ptr<int64_t>();
  // the value view of a layer may hold a page fewer than its key view (transformers' layout): slots of both
  const int64_t tokens = query.size(2), slots = std::min(k_cache.size(0), v_cache.size(0));
  const int64_t cached_keys = read_index.numel();
  std::vector<Request> list;
  for (int64_t n = 0; n < requests.size(0); ++n) {
    Request r{rows[5 * n], rows[5 * n + 1], rows[5 * n + 2], rows[5 * n + 3], rows[5 * n + 4]};
    TORCH_CHECK(r.q_length > 0 && r.q_start >= 0 && r.q_start + r.q_length <= tokens, "request ", n, ": query rows");
    TORCH_CHECK(r.k_length >= r.q_length && r.first_position >= 0, "request ", n, ": key count");
    TORCH_CHECK(r.k_length == r.q_length || (r.k_start >= 0 && r.k_start + r.k_length - r.q_length <= cached_keys),
                "request ", n, ": read_index too short");
    list.push_back(r);
  }
  // Slots read must lie in the cache: checked once here, not per key in the loop
  const int64_t* read = read_index.numel() ? read_index.const_data_ptr<int64_t>() : nullptr;
  for (const Request& r : list) {
    for (int64_t i = 0; i < r.k_length - r.q_length; ++i) {
      const int64_t slot = read[r.k_start + i];
      TORCH_CHECK(slot >= 0 && slot < slots, "read_index: slot ", slot, " outside the cache");
    }
  }
  if (write_index.numel()) {
    const int64_t* write = write_index.const_data_ptr<int64_t>();
    for (int64_t t = 0; t < write_index.numel(); ++t) {
      TORCH_CHECK(write[t] >= 0 && write[t] < slots, "write_index: slot ", write[t], " outside the cache");
    }
  }
  if (dtype == at::kFloat) {
    run<float>(out, query, key, value, k_cache, v_cache, read_index, write_index, list, window, scale);
  } else if (dtype == at::kBFloat16) {
    run<at::BFloat16>(out, query, key, value, k_cache, v_cache, read_index, write_index, list, window, scale);
  } else if (dtype == at::kHalf) {
    run<at::Half>(out, query, key, value, k_cache, v_cache, read_index, write_index, list, window, scale);
  } else {
    TORCH_CHECK(false, "paged_attention: float32, bfloat16 or float16 only");
  }
}

}  // namespace

TORCH_LIBRARY(cbgen_kernels, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key, Tensor value, Tensor(b!) k_cache, Tensor(c!) v_cache, "
      "Tensor read_index, Tensor write_index, Tensor requests, int window, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(cbgen_kernels, CPU, m) { m.impl("paged_attention", &paged_attention); }

}  // namespace cbgen_kernels
