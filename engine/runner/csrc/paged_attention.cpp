// Attention over the paged KV cache, read in place: no gather of a sequence's blocks into a workspace.
//
// One call attends every sequence of a step that has keys in the cache: decodes (one query row) and
// chunks that continue a prompt (chunked prefill, prefix-cache hits). Query row r of sequence s sits at
// position start_pos[s] + (r - query_start[s]) and sees keys 0 .. that position, read block by block
// through the sequence's block table with an online softmax (running max and sum, as flash attention).
//
// Work is split into items of (sequence, tile of query rows, KV heads): all KV heads while there are
// enough sequences to keep every thread busy (a block's rows are then read front to back, with the next
// block prefetched), one KV head per item otherwise. The `group` query heads that share a KV head are
// attended together, so each key and value row is loaded once per item. Items run longest first on
// torch's intra-op threads, each thread taking the next item when it is done.
//
// Measured with loadtests/bench_attention.py on this project's 2-core VM (2026-11-28), 16 decodes of 272 keys,
// SmolLM2's 9 heads over 3 KV heads of 64, each layer of a 30-layer cache in turn: gather + SDPA 0.43 ms a
// layer, this kernel 0.33 ms in float32; 0.39 against 0.27 ms in bfloat16 (no upcast copy either). Unrolling
// over a compile-time head dimension (64, 128) was worth 1.5x; -ffast-math vectorises exp.
//
// It is built for decodes, where the copy it saves is a large part of the work (one query row per key read).
// A long chunk is better served by gathering its keys once and running SDPA's GEMMs over them: there this
// kernel's dot products ran at 0.50-0.63x SDPA's speed (112 and 512 new tokens in the same benchmark), so
// the runner sends it decodes only. Chunks still work here (the tests check them), which keeps the kernel's
// contract whole.
//
// Keys and values may be float32, bfloat16 or float16; the arithmetic is float32.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// The running max before any key: finite, so that the code holds under -ffast-math (which assumes no
// infinities); exp(kNoMax - score) is 0 for any real score.
constexpr float kNoMax = -1e30f;

struct Shape {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size;
  int64_t q_token_stride, q_head_stride;      // query [tokens, heads, dim], strides in elements
  int64_t kv_block_stride, kv_token_stride;   // keys, values [blocks, block_size, kv_heads, dim]
  int64_t table_stride;
  float scale;
};

struct Item {
  int64_t seq, head_begin, head_end, row0, rows, cost;  // KV heads head_begin .. head_end - 1
};

// D: the head dimension when known at compile time (64, 128), so loops over it unroll; 0 reads s_.head_dim.
template <typename T, int D>
class Tile {
 public:
  Tile(const Shape& shape) : s_(shape) {
    const int64_t block = s_.block_size * s_.head_dim;
    keys_.resize(block);
    values_.resize(block);
  }

  // Attend rows row0 .. row0 + rows - 1 of one sequence for KV heads head_begin .. head_end - 1.
  void run(const float* query, const T* keys, const T* values, const int64_t* table, int64_t first_pos,
           int64_t rows, int64_t row0, int64_t head_begin, int64_t head_end, float* out) {
    const int64_t heads = head_end - head_begin, dim = D ? D : s_.head_dim, bs = s_.block_size;
    const int64_t n = rows * s_.group;  // rows per KV head; row i = r * group + g
    q_.resize(heads * n * dim);
    acc_.assign(heads * n * dim, 0.f);
    max_.assign(heads * n, kNoMax);
    sum_.assign(heads * n, 0.f);
    scores_.resize(n * bs);
    for (int64_t h = 0; h < heads; ++h)  // scaled queries
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < s_.group; ++g) {
          const float* src = query + (row0 + r) * s_.q_token_stride +
                             ((head_begin + h) * s_.group + g) * s_.q_head_stride;
          float* dst = q_.data() + (h * n + r * s_.group + g) * dim;
          for (int64_t d = 0; d < dim; ++d) dst[d] = src[d] * s_.scale;
        }
    const int64_t last_pos = first_pos + rows - 1;
    const int64_t num_blocks = last_pos / bs + 1;
    for (int64_t b = 0; b < num_blocks; ++b) {
      if (b + 1 < num_blocks) prefetch(keys, values, table[b + 1], head_begin, heads);
      const int64_t ntok = std::min(bs, last_pos + 1 - b * bs);
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t offset = table[b] * s_.kv_block_stride + (head_begin + h) * dim;
        load_block(keys + offset, values + offset, ntok);
        scores(h * n, n, ntok);
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t visible = std::min(ntok, first_pos + r + 1 - b * bs);
          if (visible <= 0) continue;  // causal: this row's position is before the whole block
          for (int64_t g = 0; g < s_.group; ++g) accumulate(h * n, r * s_.group + g, visible);
        }
      }
    }
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t g = 0; g < s_.group; ++g) {
          const int64_t i = h * n + r * s_.group + g;
          float* dst = out + ((row0 + r) * s_.num_heads + (head_begin + h) * s_.group + g) * dim;
          const float* a = acc_.data() + i * dim;
          const float inv = 1.f / sum_[i];
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) dst[d] = a[d] * inv;
        }
  }

 private:
  // Ask for the next block's rows of these heads while this block is computed: the rows of one head are
  // strided through the block, which the hardware prefetcher alone follows poorly.
  void prefetch(const T* keys, const T* values, int64_t block, int64_t head_begin, int64_t heads) {
    const int64_t row_bytes = heads * (D ? D : s_.head_dim) * static_cast<int64_t>(sizeof(T));
    for (int64_t t = 0; t < s_.block_size; ++t) {
      const int64_t offset = block * s_.kv_block_stride + t * s_.kv_token_stride + head_begin * s_.head_dim;
      const char* k = reinterpret_cast<const char*>(keys + offset);
      const char* v = reinterpret_cast<const char*>(values + offset);
      for (int64_t byte = 0; byte < row_bytes; byte += 64) {
        __builtin_prefetch(k + byte);
        __builtin_prefetch(v + byte);
      }
    }
  }

  void load_block(const T* k, const T* v, int64_t ntok) {
    const int64_t dim = D ? D : s_.head_dim;
    for (int64_t t = 0; t < ntok; ++t) {
      const T* krow = k + t * s_.kv_token_stride;
      const T* vrow = v + t * s_.kv_token_stride;
      float* kdst = keys_.data() + t * dim;
      float* vdst = values_.data() + t * dim;
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) kdst[d] = to_float(krow[d]);
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) vdst[d] = to_float(vrow[d]);
    }
  }

  // Scores of rows base .. base + n - 1 against the loaded block, into scores_ rows 0 .. n - 1.
  void scores(int64_t base, int64_t n, int64_t ntok) {
    const int64_t dim = D ? D : s_.head_dim, bs = s_.block_size;
    for (int64_t t = 0; t < ntok; ++t) {
      const float* k = keys_.data() + t * dim;
      for (int64_t i = 0; i < n; ++i) {
        const float* q = q_.data() + (base + i) * dim;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < dim; ++d) dot += q[d] * k[d];
        scores_[i * bs + t] = dot;
      }
    }
  }

  // Fold the first `visible` keys of the block into row base + i's running softmax (scores_ row i).
  void accumulate(int64_t base, int64_t row, int64_t visible) {
    const int64_t dim = D ? D : s_.head_dim, i = base + row;
    float* sc = scores_.data() + row * s_.block_size;
    float block_max = sc[0];
    for (int64_t t = 1; t < visible; ++t) block_max = std::max(block_max, sc[t]);
    const float new_max = std::max(max_[i], block_max);
    const float correction = std::exp(max_[i] - new_max);  // 0 on the first block
    float sum = sum_[i] * correction;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < visible; ++t) {
      sc[t] = std::exp(sc[t] - new_max);
      sum += sc[t];
    }
    float* a = acc_.data() + i * dim;
    if constexpr (D > 0) {
      // The row's accumulator in registers for the whole block (64 floats: 4 AVX-512 registers), instead of a
      // load and a store per key: 16 decodes of 272 keys went from 0.365 to 0.329 ms a layer in float32.
      float local[D];
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) local[d] = a[d] * correction;
      for (int64_t t = 0; t < visible; ++t) {
        const float p = sc[t];
        const float* v = values_.data() + t * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) local[d] += p * v[d];
      }
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] = local[d];
    } else {
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) a[d] *= correction;
      for (int64_t t = 0; t < visible; ++t) {
        const float p = sc[t];
        const float* v = values_.data() + t * dim;
#pragma omp simd
        for (int64_t d = 0; d < dim; ++d) a[d] += p * v[d];
      }
    }
    max_[i] = new_max;
    sum_[i] = sum;
  }

  const Shape& s_;
  std::vector<float> keys_, values_, q_, acc_, max_, sum_, scores_;
};

template <typename T, int D>
void attend_d(const Shape& shape, const float* query, const T* keys, const T* values, const int64_t* tables,
            const std::vector<Item>& items, const int64_t* query_start, const int64_t* start_pos, float* out) {
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_items);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    Tile<T, D> tile(shape);
    for (int64_t k = next++; k < num_items; k = next++) {
      const Item& it = items[k];
      const int64_t first_pos = start_pos[it.seq] + (it.row0 - query_start[it.seq]);
      tile.run(query, keys, values, tables + it.seq * shape.table_stride, first_pos, it.rows, it.row0,
               it.head_begin, it.head_end, out);
    }
  });
}

template <typename T>
void attend(const Shape& shape, const float* query, const T* keys, const T* values, const int64_t* tables,
            const std::vector<Item>& items, const int64_t* query_start, const int64_t* start_pos, float* out) {
  if (shape.head_dim == 64) attend_d<T, 64>(shape, query, keys, values, tables, items, query_start, start_pos, out);
  else if (shape.head_dim == 128) attend_d<T, 128>(shape, query, keys, values, tables, items, query_start, start_pos, out);
  else attend_d<T, 0>(shape, query, keys, values, tables, items, query_start, start_pos, out);
}

}  // namespace

// out [tokens, heads, dim] float32, written for the rows of the sequences given; query [tokens, heads, dim]
// float32 (any strides with a unit last stride); kv [2, blocks, block_size, kv_heads, dim], contiguous;
// block_tables [seqs, max_blocks] int64; query_start [seqs + 1] int64; start_pos [seqs] int64.
void paged_attention(torch::Tensor out, torch::Tensor query, torch::Tensor kv, torch::Tensor block_tables,
                     torch::Tensor query_start, torch::Tensor start_pos, double scale, int64_t tile_rows) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == at::kFloat && query.stride(2) == 1,
              "query must be float32 [tokens, heads, dim] with unit last stride");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kFloat && out.sizes() == query.sizes(),
              "out must be contiguous float32 shaped like query");
  TORCH_CHECK(kv.dim() == 5 && kv.size(0) == 2 && kv.is_contiguous() && kv.size(4) == query.size(2),
              "kv must be contiguous [2, blocks, block_size, kv_heads, dim]");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.scalar_type() == at::kLong &&
                  block_tables.stride(1) == 1, "block_tables must be int64 [seqs, max_blocks]");
  const int64_t num_seqs = block_tables.size(0);
  TORCH_CHECK(query_start.is_contiguous() && query_start.scalar_type() == at::kLong &&
                  query_start.numel() == num_seqs + 1, "query_start must be int64 [seqs + 1]");
  TORCH_CHECK(start_pos.is_contiguous() && start_pos.scalar_type() == at::kLong &&
                  start_pos.numel() == num_seqs, "start_pos must be int64 [seqs]");
  TORCH_CHECK(query.size(1) % kv.size(3) == 0, "query heads must be a multiple of KV heads");
  TORCH_CHECK(tile_rows >= 1, "tile_rows must be >= 1");
  for (const torch::Tensor* t : {&out, &query, &kv, &block_tables, &query_start, &start_pos})
    TORCH_CHECK(t->device().is_cpu(), "every tensor must be on the CPU");

  Shape shape{query.size(1), kv.size(3), query.size(1) / kv.size(3), query.size(2), kv.size(2),
              query.stride(0), query.stride(1), kv.stride(1), kv.stride(2), block_tables.stride(0),
              static_cast<float>(scale)};
  const int64_t* qs = query_start.data_ptr<int64_t>();
  const int64_t* sp = start_pos.data_ptr<int64_t>();
  const int64_t max_blocks = block_tables.size(1);
  // Whole sequences (all KV heads: each block is read front to back) while there are enough of them to
  // keep every thread busy; one KV head per item otherwise (a single long decode still uses every thread).
  int64_t num_tiles = 0;
  for (int64_t s = 0; s < num_seqs; ++s) num_tiles += (qs[s + 1] - qs[s] + tile_rows - 1) / tile_rows;
  const int64_t heads_per_item = num_tiles >= 2 * at::get_num_threads() ? shape.num_kv_heads : 1;
  std::vector<Item> items;
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t num_blocks = kv.size(1);
  TORCH_CHECK(num_seqs == 0 || qs[0] >= 0, "query_start out of order or range");
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(qs[s] <= qs[s + 1] && qs[s + 1] <= query.size(0), "query_start out of order or range");
    const int64_t last_pos = sp[s] + qs[s + 1] - qs[s] - 1;
    TORCH_CHECK(sp[s] >= 0 && last_pos / shape.block_size < max_blocks, "block table too short for its keys");
    for (int64_t b = 0; b <= last_pos / shape.block_size; ++b) {  // every block read: inside the cache
      const int64_t block = tables[s * shape.table_stride + b];
      TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " outside the cache's ", num_blocks, " blocks");
    }
    for (int64_t row = qs[s]; row < qs[s + 1]; row += tile_rows) {
      const int64_t rows = std::min(tile_rows, qs[s + 1] - row);
      const int64_t keys = sp[s] + (row - qs[s]) + rows;
      for (int64_t h = 0; h < shape.num_kv_heads; h += heads_per_item)
        items.push_back({s, h, std::min(h + heads_per_item, shape.num_kv_heads), row, rows, rows * keys});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  // No Python object is touched from here on: let the server's event loop run while the step attends.
  pybind11::gil_scoped_release no_gil;
  switch (kv.scalar_type()) {
    case at::kFloat:
      attend(shape, q, kv[0].data_ptr<float>(), kv[1].data_ptr<float>(), tables, items, qs, sp, o);
      break;
    case at::kBFloat16:
      attend(shape, q, kv[0].data_ptr<c10::BFloat16>(), kv[1].data_ptr<c10::BFloat16>(), tables, items, qs, sp, o);
      break;
    case at::kHalf:
      attend(shape, q, kv[0].data_ptr<c10::Half>(), kv[1].data_ptr<c10::Half>(), tables, items, qs, sp, o);
      break;
    default:
      TORCH_CHECK(false, "kv must be float32, bfloat16 or float16");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "attention over the paged KV cache, read in place");
}
