// Multi-adapter LoRA for CPU pods: one call per LoRA layer applies every adapter of a step.
//
// For every row t of a segment (the step's rows of one slot, as kernels/lora_meta.py groups them):
//   shrink  s[c] = sum_k x[t, k] * A[c, k]                  for every column c of the slot's stacked A
//   expand  y[t, lo + o] += sum_{c in slice} s[c] * Bt[c - first, o]   for each slice the slot adapts
// in float32, the delta added to y in float32 and rounded once to y's type (kernels/reference.py).
// Each of these sums has an order fixed by the row alone: a shrink column over k in W interleaved
// partial sums (W the vector width of this CPU's build) added in a fixed tree, then the columns of k past
// the last whole vector one by one; an expand element over c in ascending order, one fused multiply-add
// each. The compiler is told not to reassociate or contract (kernels/native_build.py), so a row's bits do
// not depend on which other rows, adapters or threads share the call, on its place in its segment or on
// the segment's length: batch invariance holds by construction, on any CPU.
//
// A segment's rows go in blocks of ROWS, so that each column of A and each row of B is read once per block
// from cache and used by all of the block's rows; blocks of a segment, and segments, are independent items.
#include "simd.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

using namespace native;

constexpr int ROWS = 4;  // rows a block's inner loops carry at once (register blocking)
constexpr int ITEM_ROWS = 32;  // rows of one item of work for the threads
constexpr int64_t THREADED_MACS = int64_t(1) << 22;  // below this much work a call stays on the caller's thread

enum Type { F32 = 0, BF16 = 1 };

inline float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

// Round to nearest even, as torch converts float32 to bfloat16 (a NaN becomes the quiet NaN 0x7fc0).
inline uint16_t float_to_bf16(float f) {
  if (std::isnan(f)) return 0x7fc0;
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return uint16_t((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

struct Slice {
  int lo, width, first, rank;  // output columns lo:lo+width of y; columns first:first+rank of s
  const float* bt;  // [rank, width] float32: B transposed
};

struct Slot {
  const float* a = nullptr;  // [columns, in] float32: the A of every slice the slot adapts, stacked
  int columns = 0;
  std::vector<Slice> slices;
};

struct Problem {
  const void* x;  // [tokens, in] rows x_stride apart
  int x_type, in;
  int64_t x_stride;
  void* y;  // [tokens, out] rows y_stride apart, updated in place
  int y_type;
  int64_t y_stride;
  const int32_t* tokens;  // the step's rows grouped by slot
};

struct Item {
  const Slot* slot;
  int first, count;  // rows tokens[first : first + count]
};

struct Scratch {
  std::vector<float> x, s, out;
};

// x rows [n, in] of the block as float32: where they lie (float32), else converted into the scratch.
void load_rows(const Problem& p, const int32_t* rows, int n, Scratch& scratch, const float** out) {
  if (p.x_type == F32) {
    for (int i = 0; i < n; ++i) out[i] = static_cast<const float*>(p.x) + rows[i] * p.x_stride;
    return;
  }
  scratch.x.resize(size_t(n) * p.in);
  for (int i = 0; i < n; ++i) {
    const uint16_t* src = static_cast<const uint16_t*>(p.x) + rows[i] * p.x_stride;
    float* dst = scratch.x.data() + size_t(i) * p.in;
    for (int k = 0; k < p.in; ++k) dst[k] = bf16_to_float(src[k]);
    out[i] = dst;
  }
}

// Columns a shrink (of A) or an expand (vectors of y) carries at once beside the block's rows: COLUMNS x ROWS
// accumulators in registers.
#if defined(__AVX512F__)
constexpr int COLUMNS = 4;
#else
constexpr int COLUMNS = 2;
#endif

// s[i * columns + c] for columns c0 : c0 + C of the block's N rows, each column's sum in its fixed order.
template <int N, int C>
void shrink_columns(const float* const* x, const float* a, int in, int c0, int columns, float* s) {
  const int whole = in / W * W;
  vec acc[C][N];
  for (int j = 0; j < C; ++j)
    for (int i = 0; i < N; ++i) acc[j][i] = vzero();
  for (int k = 0; k < whole; k += W) {
    vec xk[N];
    for (int i = 0; i < N; ++i) xk[i] = vload(x[i] + k);
    for (int j = 0; j < C; ++j) {
      vec ak = vload(a + size_t(c0 + j) * in + k);
      for (int i = 0; i < N; ++i) acc[j][i] = vfma(xk[i], ak, acc[j][i]);
    }
  }
  for (int j = 0; j < C; ++j) {
    const float* aj = a + size_t(c0 + j) * in;
    for (int i = 0; i < N; ++i) {
      float sum = hsum(acc[j][i]);
      for (int k = whole; k < in; ++k) sum = std::fma(x[i][k], aj[k], sum);
      s[i * columns + c0 + j] = sum;
    }
  }
}

// s[i * columns + c] for every column of the slot and the block's N rows (N <= ROWS).
template <int N>
void shrink(const float* const* x, const Slot& slot, int in, float* s) {
  int c = 0;
  for (; c + COLUMNS <= slot.columns; c += COLUMNS) shrink_columns<N, COLUMNS>(x, slot.a, in, c, slot.columns, s);
  for (; c < slot.columns; ++c) shrink_columns<N, 1>(x, slot.a, in, c, slot.columns, s);
}

// The block's deltas of one slice for output columns o : o + C * W, [N, width] into out.
template <int N, int C>
void expand_columns(const float* s, int columns, const Slice& sl, int o, float* out) {
  vec acc[C][N];
  for (int j = 0; j < C; ++j)
    for (int i = 0; i < N; ++i) acc[j][i] = vzero();
  for (int c = 0; c < sl.rank; ++c) {
    const float* b = sl.bt + size_t(c) * sl.width + o;
    vec sc[N];
    for (int i = 0; i < N; ++i) sc[i] = vset(s[i * columns + sl.first + c]);
    for (int j = 0; j < C; ++j) {
      vec bj = vload(b + j * W);
      for (int i = 0; i < N; ++i) acc[j][i] = vfma(sc[i], bj, acc[j][i]);
    }
  }
  for (int j = 0; j < C; ++j)
    for (int i = 0; i < N; ++i) vstore(out + size_t(i) * sl.width + o + j * W, acc[j][i]);
}

// The block's deltas of one slice, [N, width] into out: each element over the slice's columns ascending.
template <int N>
void expand(const float* s, int columns, const Slice& sl, float* out) {
  const int whole = sl.width / W * W;
  int o = 0;
  for (; o + COLUMNS * W <= whole; o += COLUMNS * W) expand_columns<N, COLUMNS>(s, columns, sl, o, out);
  for (; o < whole; o += W) expand_columns<N, 1>(s, columns, sl, o, out);
  for (; o < sl.width; ++o)
    for (int i = 0; i < N; ++i) {
      float acc = 0.0f;
      for (int c = 0; c < sl.rank; ++c) acc = std::fma(s[i * columns + sl.first + c], sl.bt[size_t(c) * sl.width + o], acc);
      out[size_t(i) * sl.width + o] = acc;
    }
}

// y[row, lo:lo+width] += delta, rounded once to y's type.
void add_to_y(const Problem& p, int32_t row, const Slice& sl, const float* delta) {
  if (p.y_type == F32) {
    float* y = static_cast<float*>(p.y) + row * p.y_stride + sl.lo;
    const int whole = sl.width / W * W;
    for (int o = 0; o < whole; o += W) vstore(y + o, vadd(vload(y + o), vload(delta + o)));
    for (int o = whole; o < sl.width; ++o) y[o] += delta[o];
    return;
  }
  uint16_t* y = static_cast<uint16_t*>(p.y) + row * p.y_stride + sl.lo;
  for (int o = 0; o < sl.width; ++o) y[o] = float_to_bf16(bf16_to_float(y[o]) + delta[o]);
}

template <int N>
void run_block(const Problem& p, const Slot& slot, const int32_t* rows, Scratch& scratch) {
  const float* x[ROWS];
  load_rows(p, rows, N, scratch, x);
  scratch.s.resize(size_t(N) * slot.columns);
  shrink<N>(x, slot, p.in, scratch.s.data());
  for (const Slice& sl : slot.slices) {
    scratch.out.resize(size_t(N) * sl.width);
    expand<N>(scratch.s.data(), slot.columns, sl, scratch.out.data());
    for (int i = 0; i < N; ++i) add_to_y(p, rows[i], sl, scratch.out.data() + size_t(i) * sl.width);
  }
}

void run_item(const Problem& p, const Item& item, Scratch& scratch) {
  const int32_t* rows = p.tokens + item.first;
  int i = 0;
  for (; i + ROWS <= item.count; i += ROWS) run_block<ROWS>(p, *item.slot, rows + i, scratch);
  switch (item.count - i) {
    case 3: run_block<3>(p, *item.slot, rows + i, scratch); break;
    case 2: run_block<2>(p, *item.slot, rows + i, scratch); break;
    case 1: run_block<1>(p, *item.slot, rows + i, scratch); break;
    default: break;
  }
}

}  // namespace

extern "C" {

// The vector width of this build (what a shrink's partial sums are interleaved by).
int lora_width() { return W; }

// Fields of a slot's entry in the slot table: a, columns, slices, then SLICE_FIELDS per slice.
constexpr int SLOT_FIELDS = 3, SLICE_FIELDS = 5;

// Adds every segment's LoRA delta to y. Segment i (seg_slots[i] >= 0) is rows tokens[seg_starts[i] :
// seg_starts[i + 1]] of slot seg_slots[i]; slot_table [max_loras, SLOT_FIELDS + SLICE_FIELDS * max_slices]
// int64 holds each slot's A pointer (0: the slot adapts nothing here), its columns and slice count, then per
// slice lo, width, first, rank and its B-transposed pointer. Returns 0, or 1 for a type it does not take.
int lora_apply(const void* x, int x_type, int in, int64_t x_stride, void* y, int y_type, int64_t y_stride,
               const int32_t* tokens, const int32_t* seg_slots, const int32_t* seg_starts, int segments,
               const int64_t* slot_table, int max_loras, int max_slices, int threads) {
  if (x_type < F32 || x_type > BF16 || y_type < F32 || y_type > BF16) return 1;
  Problem p{x, x_type, in, x_stride, y, y_type, y_stride, tokens};
  const int fields = SLOT_FIELDS + SLICE_FIELDS * max_slices;
  std::vector<Slot> slots(max_loras);
  std::vector<Item> items;
  int64_t macs = 0;
  for (int i = 0; i < segments; ++i) {
    const int slot_index = seg_slots[i];
    if (slot_index < 0 || slot_index >= max_loras) continue;
    const int64_t* entry = slot_table + int64_t(slot_index) * fields;
    if (entry[0] == 0) continue;
    Slot& slot = slots[slot_index];
    if (slot.a == nullptr) {
      slot.a = reinterpret_cast<const float*>(entry[0]);
      slot.columns = int(entry[1]);
      for (int s = 0; s < int(entry[2]); ++s) {
        const int64_t* f = entry + SLOT_FIELDS + SLICE_FIELDS * s;
        slot.slices.push_back({int(f[0]), int(f[1]), int(f[2]), int(f[3]), reinterpret_cast<const float*>(f[4])});
      }
    }
    int64_t per_row = int64_t(slot.columns) * in;
    for (const Slice& sl : slot.slices) per_row += int64_t(sl.rank) * sl.width;
    for (int first = seg_starts[i]; first < seg_starts[i + 1]; first += ITEM_ROWS) {
      const int count = std::min(ITEM_ROWS, seg_starts[i + 1] - first);
      items.push_back({&slot, first, count});
      macs += per_row * count;
    }
  }
  std::atomic<size_t> next{0};
  auto work = [&] {
    Scratch scratch;
    for (size_t i = next++; i < items.size(); i = next++) run_item(p, items[i], scratch);
  };
  const int helpers = macs < THREADED_MACS ? 0 : std::max(0, std::min<int>(threads, int(items.size())) - 1);
  std::vector<std::thread> pool;
  pool.reserve(helpers);
  for (int t = 0; t < helpers; ++t) pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  return 0;
}

}  // extern "C"
