// Attention over a paged KV cache for CPU pods, reading the cache in place through the block tables.
//
// One call per layer computes every new token of a step (decodes and prompt chunks alike). The work is
// cut into items of (sequence, key/value head, block of up to QUERY_BLOCK queries); an item's rows are
// its queries times the query heads that share the key/value head, and each key and value it reads is
// used by all of them. For every row:
//   scores  s_j = scale * q . k_j over the keys the row may see (causal, its window), capped by softcap;
//   softmax p_j = exp(s_j - max) / sum;   output = sum_j p_j v_j.
// Each of these sums has an order that depends on the row alone: a dot product over the head dimension
// in W interleaved partial sums (W the vector width this CPU's build uses) added in a fixed tree; the
// softmax sum in W partial sums by key, from the row's first key, then the same tree; the output key by
// key in ascending order (scores are computed W keys at a time and values a tile of keys at a time, each
// row's partial sums in registers, but every sum is the one just described). The compiler is told not to
// reassociate or contract (kernels/native_build.py), so a row's bits do not depend on which other rows,
// sequences or threads share the call: the same query gives the same bits as a decode, as one token of a
// prompt chunk of any length, and beside any batch. Items are independent and taken by the threads in any order.
//
// An FP8 cache (e4m3 bytes, --kv-cache-dtype fp8) holds each layer's keys divided by its k_scale and values by
// its v_scale; a row is read as the exact float of each byte (a 256-entry table) times the scale, one
// rounding per element, and then summed as any other row.
#include "simd.h"

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <system_error>
#include <thread>
#include <vector>

namespace {

using namespace native;

constexpr int QUERY_BLOCK = 16;

enum CacheType { F32 = 0, BF16 = 1, F16 = 2, E4M3 = 3 };

inline float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  if (exponent == 0x1f) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    float value = float(mantissa) * 5.9604644775390625e-8f;
    return sign ? -value : value;
  }
  return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

// float8_e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN. Every
// value is exact in float.
float e4m3_to_float(uint8_t byte) {
  const int exponent = (byte >> 3) & 0xf, mantissa = byte & 0x7;
  float value = exponent == 0xf && mantissa == 0x7 ? NAN
                : exponent == 0 ? std::ldexp(float(mantissa), -9)  // subnormal: mantissa * 2^-6 / 8
                                : std::ldexp(float(8 + mantissa), exponent - 10);  // (1 + mantissa / 8) * 2^(e - 7)
  return byte & 0x80 ? -value : value;
}

const std::array<float, 256>& e4m3_table() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int b = 0; b < 256; ++b) t[b] = e4m3_to_float(uint8_t(b));
    return t;
  }();
  return table;
}

// W bytes of e4m3 as floats: their table entries, gathered W at a time where the CPU can.
inline vec e4m3_load(const uint8_t* bytes, const float* table) {
#if defined(__AVX512F__)
  return _mm512_i32gather_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes))), table,
                             4);
#elif defined(__AVX2__) && defined(__FMA__)
  return _mm256_i32gather_ps(table, _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes))),
                             4);
#else
  vec r;
  for (int i = 0; i < W; ++i) r.x[i] = table[bytes[i]];
  return r;
#endif
}

inline int element_bytes(int type) { return type == F32 ? 4 : type == E4M3 ? 1 : 2; }

// One cache row (a key or value of one head) as float32: where it lies (float32), else converted into `out`
// (an e4m3 row's values times `scale`, the layer's scale of that cache).
inline const float* load_row(const void* cache, int type, int64_t offset, int head_dim, float scale, float* out) {
  if (type == F32) return static_cast<const float*>(cache) + offset;
  if (type == E4M3) {
    const uint8_t* row = static_cast<const uint8_t*>(cache) + offset;
    const float* table = e4m3_table().data();
    const vec times = vset(scale);
    for (int d = 0; d < head_dim; d += W) vstore(out + d, vmul(e4m3_load(row + d, table), times));
    return out;
  }
  const uint16_t* row = static_cast<const uint16_t*>(cache) + offset;
  if (type == BF16) {
    for (int d = 0; d < head_dim; ++d) out[d] = bits_to_float(uint32_t(row[d]) << 16);
  } else {
    for (int d = 0; d < head_dim; ++d) out[d] = half_to_float(row[d]);
  }
  return out;
}

// A cache row asked for ahead of its use: the rows of a sequence's keys lie a head apart within a block and
// anywhere between blocks, which a hardware prefetcher does not follow.
inline void prefetch_row(const void* cache, int type, int64_t offset, int head_dim) {
  const char* row = static_cast<const char*>(cache) + offset * element_bytes(type);
  for (int byte = 0; byte < head_dim * element_bytes(type); byte += 64) _mm_prefetch(row + byte, _MM_HINT_T0);
}

// The rows of n consecutive keys of one cache (offsets[k] the k-th's) as float32 in rows[k], converted into
// out[k * head_dim ...] where they are not float32; the rows of the `ahead` keys after them asked for.
inline void load_tile(const void* cache, int type, float scale, const int64_t* offsets, int n, int ahead,
                      int head_dim, const float** rows, float* out) {
  for (int k = n; k < n + ahead; ++k) prefetch_row(cache, type, offsets[k], head_dim);
  for (int k = 0; k < n; ++k)
    rows[k] = load_row(cache, type, offsets[k], head_dim, scale, out + size_t(k) * head_dim);
}

inline float dot(const float* a, const float* b, int n) {  // n a multiple of W
  vec acc = vzero();
  for (int d = 0; d < n; d += W) acc = vfma(vload(a + d), vload(b + d), acc);
  return hsum(acc);
}

// exp(x) for x <= 0 (a score less its row's maximum), W at a time: Cody-Waite reduction to r in
// [-ln2/2, ln2/2] and a degree-6 polynomial (relative error about 2e-7).
inline vec vexp(vec x) {
  x = vmax(x, vset(-87.0f));
  vec n = vfloor(vfma(x, vset(1.44269504088896341f), vset(0.5f)));
  vec r = vfma(n, vset(-0.693359375f), x);
  r = vfma(n, vset(2.12194440e-4f), r);
  vec p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  p = vadd(vfma(vmul(p, r), r, r), vset(1.0f));
  return vmul(p, vpow2(n));
}

// softcap * tanh(s / softcap), tanh(y) = sign(y) (1 - e) / (1 + e) with e = exp(-2|y|).
inline float soft_cap(float s, float cap) {
  float y = s / cap, lanes[W];
  vstore(lanes, vexp(vset(-2.0f * std::fabs(y))));
  float t = (1.0f - lanes[0]) / (1.0f + lanes[0]);
  return cap * (y < 0 ? -t : t);
}

struct Problem {
  const float* q;  // [tokens, heads, head_dim]
  const void* k_cache;  // [slots, kv_heads, head_dim]
  const void* v_cache;
  int cache_type, heads, kv_heads, head_dim;
  const int32_t* query_start;  // [seqs + 1]
  const int32_t* context;  // [seqs]: context length after the step (its new tokens last)
  const int32_t* block_tables;  // [seqs, max_blocks]
  int max_blocks, block_size, window;
  float scale, softcap;
  float* out;  // [tokens, heads, head_dim]
  float k_scale, v_scale;  // an e4m3 cache's dequantization scales (1 for the others)
};

struct Item {
  int seq, kv_head, first_query, queries;
};

struct Scratch {
  std::vector<float> scores, acc, key, value, inverse;
  std::vector<int64_t> q_row;  // each row's [token, head] index
  std::vector<int64_t> offsets;  // each key's row in the cache, from the block's first key
  std::vector<int> from, to;  // each row's first and last key
};

// Keys whose values a row adds from registers before its sums go back to memory.
constexpr int VALUE_TILE = 32;

// a[0 .. C*W) += weights[k] * values[k][d .. d + C*W) for k = 0 .. count - 1 in ascending order.
template <int C>
inline void add_values(float* a, const float* const* values, int d, const float* weights, int count) {
  vec sum[C];
  for (int c = 0; c < C; ++c) sum[c] = vload(a + c * W);
  for (int k = 0; k < count; ++k) {
    const vec weight = vset(weights[k]);
    const float* value = values[k] + d;
    for (int c = 0; c < C; ++c) sum[c] = vfma(weight, vload(value + c * W), sum[c]);
  }
  for (int c = 0; c < C; ++c) vstore(a + c * W, sum[c]);
}

void run_item(const Problem& p, const Item& item, Scratch& scratch) {
  const int per_kv = p.heads / p.kv_heads, dim = p.head_dim;
  const int rows = item.queries * per_kv;
  const int new_tokens = p.query_start[item.seq + 1] - p.query_start[item.seq];
  const int first_pos = p.context[item.seq] - new_tokens + item.first_query;  // position of the first query
  const int32_t* table = p.block_tables + int64_t(item.seq) * p.max_blocks;
  scratch.q_row.resize(rows);
  scratch.from.resize(rows);
  scratch.to.resize(rows);
  scratch.inverse.resize(rows);
  for (int row = 0; row < rows; ++row) {  // row = query * per_kv + its head's place in the group
    int query = row / per_kv, pos = first_pos + query;
    scratch.q_row[row] = int64_t(p.query_start[item.seq] + item.first_query + query) * p.heads +
                         item.kv_head * per_kv + row % per_kv;
    scratch.from[row] = p.window > 0 ? std::max(0, pos - p.window + 1) : 0;
    scratch.to[row] = pos;
  }
  // keys [lo, hi] the block reads: the first query's first visible key to the last query's own position;
  // a row's scores are stored from its own first key on, padded to whole vectors
  const int lo = scratch.from[0], hi = scratch.to[rows - 1];
  // (one vector more than the keys: rows a power of two of bytes apart would share a few sets of the
  // cache, and a block's 48 rows evict each other on every key)
  const int stride = (hi - lo + 1 + W - 1) / W * W + W;
  scratch.scores.resize(size_t(rows) * stride);
  scratch.acc.assign(size_t(rows) * dim, 0.0f);
  float* scores = scratch.scores.data();
  float* acc = scratch.acc.data();
  const int* from = scratch.from.data();
  const int* to = scratch.to.data();
  scratch.offsets.resize(hi - lo + 1);
  for (int j = lo, block = lo / p.block_size, within = lo % p.block_size; j <= hi; ++j) {
    int64_t slot = int64_t(table[block]) * p.block_size + within;
    scratch.offsets[j - lo] = (slot * p.kv_heads + item.kv_head) * dim;
    if (++within == p.block_size) within = 0, ++block;
  }
  const int64_t* offsets = scratch.offsets.data();  // offsets[j - lo] for key j
  // scores, each row over the keys it sees: keys W at a time, a row's W dot products summed together
  // (hsum_lanes: each the same bits as alone, so a key's score does not depend on its group)
  scratch.key.resize(size_t(W) * dim);
  float* converted = scratch.key.data();
  for (int g = lo; g <= hi; g += W) {
    const int n = std::min(W, hi - g + 1);
    const float* keys[W];
    load_tile(p.k_cache, p.cache_type, p.k_scale, offsets + (g - lo), n, std::min(W, hi - g + 1 - n), dim, keys,
              converted);
    for (int row = 0; row < rows; ++row) {
      if (to[row] < g || from[row] > g + n - 1) continue;
      const float* q = p.q + scratch.q_row[row] * dim;
      float s[W];
      if (n == W) {
        vec dots[W];
        for (int k = 0; k < W; ++k) dots[k] = vzero();
        for (int d = 0; d < dim; d += W) {
          const vec qd = vload(q + d);
          for (int k = 0; k < W; ++k) dots[k] = vfma(qd, vload(keys[k] + d), dots[k]);
        }
        hsum_lanes(dots, s);
      } else {
        for (int k = 0; k < n; ++k) s[k] = dot(q, keys[k], dim);
      }
      float* row_scores = scores + size_t(row) * stride;  // [j - from[row]] for key j
      for (int k = std::max(0, from[row] - g); k < n && g + k <= to[row]; ++k) {
        const float score = s[k] * p.scale;
        row_scores[g + k - from[row]] = p.softcap > 0 ? soft_cap(score, p.softcap) : score;
      }
    }
  }
  // softmax numerators in place, and each row's sum: W keys at a time from the row's first key, the
  // last vector's keys past the row's last masked to zero
  for (int row = 0; row < rows; ++row) {
    float* s = scores + size_t(row) * stride;
    const int count = to[row] - from[row] + 1, whole = (count + W - 1) / W * W;
    for (int j = count; j < whole; ++j) s[j] = -INFINITY;
    vec most = vload(s);
    for (int j = W; j < whole; j += W) most = vmax(most, vload(s + j));
    const vec shift = vset(-hmax(most));
    for (int j = 0; j < whole; j += W) vstore(s + j, vexp(vadd(vload(s + j), shift)));
    for (int j = count; j < whole; ++j) s[j] = 0.0f;  // past the row's last key: exactly nothing
    vec sum = vzero();
    for (int j = 0; j < whole; j += W) sum = vadd(sum, vload(s + j));
    scratch.inverse[row] = 1.0f / hsum(sum);
  }
  // the values, key by key in ascending order: VALUE_TILE keys at a time, each row's sums for a few
  // vectors of the head dimension held in registers over the tile
  scratch.value.resize(size_t(VALUE_TILE) * dim);
  for (int t = lo; t <= hi; t += VALUE_TILE) {
    const int n = std::min(VALUE_TILE, hi - t + 1);
    const float* values[VALUE_TILE];
    load_tile(p.v_cache, p.cache_type, p.v_scale, offsets + (t - lo), n, std::min(VALUE_TILE, hi - t + 1 - n), dim,
              values, scratch.value.data());
    for (int row = 0; row < rows; ++row) {
      const int first = std::max(t, from[row]), last = std::min(t + n - 1, to[row]);
      if (first > last) continue;
      const float* weights = scores + size_t(row) * stride + (first - from[row]);
      const float* const* from_first = values + (first - t);
      float* a = acc + size_t(row) * dim;
      const int count = last - first + 1;
      int d = 0;
      for (; d + 8 * W <= dim; d += 8 * W) add_values<8>(a + d, from_first, d, weights, count);
      for (; d + 4 * W <= dim; d += 4 * W) add_values<4>(a + d, from_first, d, weights, count);
      for (; d < dim; d += W) add_values<1>(a + d, from_first, d, weights, count);
    }
  }
  for (int row = 0; row < rows; ++row) {
    float* o = p.out + scratch.q_row[row] * dim;
    const float* a = acc + size_t(row) * dim;
    vec inverse = vset(scratch.inverse[row]);
    for (int d = 0; d < dim; d += W) vstore(o + d, vmul(vload(a + d), inverse));
  }
}

}  // namespace

extern "C" {

// The vector width of this build: head_dim must be a multiple of it.
int paged_attention_width() { return W; }

// Returns 0, or 1 where the shapes are not supported (the caller keeps its own path): head_dim a
// multiple of the vector width, heads a multiple of kv_heads, a known cache type; 2 where a sequence has
// more new tokens than context (nothing is computed). k_scale and v_scale
// multiply an e4m3 cache's keys and values (the others' are read as they are).
int paged_attention(const float* q, int heads, int head_dim, const void* k_cache, const void* v_cache,
                    int cache_type, int kv_heads, const int32_t* query_start, const int32_t* context,
                    int seqs, const int32_t* block_tables, int max_blocks, int block_size, int window,
                    float scale, float softcap, float* out, int threads, float k_scale, float v_scale) {
  if (head_dim % W != 0 || kv_heads <= 0 || heads % kv_heads != 0 || cache_type < F32 || cache_type > E4M3)
    return 1;
  Problem p{q, k_cache, v_cache, cache_type, heads, kv_heads, head_dim, query_start, context, block_tables,
            max_blocks, block_size, window, scale, softcap, out, k_scale, v_scale};
  std::vector<Item> items;
  for (int b = 0; b < seqs; ++b) {
    int new_tokens = query_start[b + 1] - query_start[b];
    if (context[b] <= 0 || new_tokens <= 0) continue;
    if (context[b] < new_tokens) return 2;
    for (int h = 0; h < kv_heads; ++h)
      for (int first = 0; first < new_tokens; first += QUERY_BLOCK)
        items.push_back({b, h, first, std::min(QUERY_BLOCK, new_tokens - first)});
  }
  // the items over the most keys first, so that a prompt's last blocks do not finish alone
  auto keys = [&](const Item& item) {
    return context[item.seq] - (query_start[item.seq + 1] - query_start[item.seq]) + item.first_query;
  };
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return keys(a) > keys(b); });
  std::atomic<size_t> next{0};
  auto work = [&] {
    // Subnormal products (a weight near exp(-87) times a small value) flushed to zero, and subnormal inputs
    // read as zero: the same on every thread and in every call, and without the CPU's slow path for them.
    const unsigned int mxcsr = _mm_getcsr();
    _mm_setcsr(mxcsr | 0x8040);  // FTZ and DAZ
    Scratch scratch;
    for (size_t i = next++; i < items.size(); i = next++) run_item(p, items[i], scratch);
    _mm_setcsr(mxcsr);
  };
  int helpers = std::max(0, std::min<int>(threads, int(items.size())) - 1);
  std::vector<std::thread> pool;
  pool.reserve(helpers);
  try {
    for (int t = 0; t < helpers; ++t) pool.emplace_back(work);
  } catch (const std::system_error&) {  // no thread to be had: the threads started, and this one, do it all
  }
  work();
  for (auto& t : pool) t.join();
  return 0;
}

}  // extern "C"
