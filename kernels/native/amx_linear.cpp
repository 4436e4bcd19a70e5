// Projections in bfloat16 on CPUs with AMX tiles (Intel Xeon 4th generation and later), for CPU pods:
// out = x · wᵀ with x [rows, in] and w [out, in] in bfloat16, every product summed in float32.
//
// A row's bits depend on that row alone. Each output is accumulated by the tile dot-product instruction
// (TDPBF16PS) over the input in blocks of 32 elements, always from the first block to the last, and the
// instruction computes each element of its output tile from its own row of x and column of w in one fixed
// way, whatever the tile's other rows hold. So a token's projection is the same bits in a decode of one
// row and as any row of a prompt chunk of any length, whichever thread takes its tile; the pod's start-up
// probe checks it on the machine (data_plane/model/row_rule.py). A matmul library switches kernels by the
// number of rows instead (oneDNN: others past 32 rows), which fixed tiles of rows had to work around.
//
// Weights are laid out once (amx_pack) in the instruction's tiles: for each block of 16 outputs and 32
// inputs, 16 rows of 64 bytes, row p holding inputs 2p and 2p + 1 of each of the 16 outputs. The caller
// pads x to a multiple of 32 columns (zeros) and gives it rows up to a multiple of 16 (their contents are
// read, never written out). Each finished tile goes through a small buffer: the bias added in float32,
// rounded to bfloat16 to nearest even (torch's rounding), written into the result [rows, outs] at once,
// so a prompt chunk's float32 products never travel through memory.
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <system_error>
#include <thread>
#include <vector>

namespace {

constexpr int TILE_ROWS = 16;  // rows of x (and of the result) in a tile
constexpr int TILE_OUTS = 16;  // outputs (columns of the result) in a tile
constexpr int TILE_K = 32;  // inputs in a tile: 16 pairs of bfloat16

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)

// The tile registers' shapes (palette 1): every tile 16 rows of 64 bytes. Tiles 0-3 accumulate a 2 x 2
// block of the result, 4-5 hold two blocks of x's rows, 6-7 two blocks of the weights.
struct TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

bool tiles_permitted() {  // Linux hands a process the tiles' register state only when asked
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  static const bool permitted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  return permitted;
}

struct Problem {
  const uint16_t* x;  // [rows rounded up to TILE_ROWS, in]
  const uint16_t* packed;  // amx_pack's tiles of w
  const float* bias;  // [outs], or null
  uint16_t* out;  // [rows, outs] bfloat16
  int rows, in, outs;
};

// The result's block (row block m, output block n), stored from its accumulator tile in `buffer`, into
// p.out: plus the bias, each float32 rounded to bfloat16 to nearest even (a NaN to 0xFFFF), as torch
// rounds; rows and outputs past the result's are left out.
void put(const Problem& p, int m, int n, const float* buffer) {
  const int first_row = m * TILE_ROWS, first_out = n * TILE_OUTS;
  const int rows = std::min(TILE_ROWS, p.rows - first_row), outs = std::min(TILE_OUTS, p.outs - first_out);
  const __mmask16 columns = outs == TILE_OUTS ? __mmask16(0xFFFF) : __mmask16((1u << outs) - 1);
  const __m512 bias = p.bias ? _mm512_maskz_loadu_ps(columns, p.bias + first_out) : _mm512_setzero_ps();
  const __m512i one = _mm512_set1_epi32(1), half = _mm512_set1_epi32(0x7FFF), nan = _mm512_set1_epi32(0xFFFF);
  for (int r = 0; r < rows; ++r) {
    __m512 v = _mm512_load_ps(buffer + r * TILE_OUTS);
    if (p.bias) v = _mm512_add_ps(v, bias);
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, half)), 16);
    rounded = _mm512_mask_mov_epi32(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), nan);
    _mm256_mask_storeu_epi16(p.out + size_t(first_row + r) * p.outs + first_out, columns,
                             _mm512_cvtepi32_epi16(rounded));
  }
}

// The result's columns of output blocks [first, last) for every row, two blocks of rows by two of outputs
// at a time (one where a count is odd).
void run_blocks(const Problem& p, int first, int last) {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64, config.rows[t] = TILE_ROWS;
  _tile_loadconfig(&config);
  alignas(64) float buffer[TILE_ROWS * TILE_OUTS];
  const int k_blocks = p.in / TILE_K, row_blocks = (p.rows + TILE_ROWS - 1) / TILE_ROWS;
  const size_t x_stride = size_t(p.in) * 2;
  auto weights = [&](int block, int k) { return p.packed + (size_t(block) * k_blocks + k) * TILE_K * TILE_OUTS; };
  for (int n = first; n < last; n += 2) {
    const bool two_n = n + 1 < last;
    for (int m = 0; m < row_blocks; m += 2) {
      const bool two_m = m + 1 < row_blocks;
      const uint16_t* x0 = p.x + size_t(m) * TILE_ROWS * p.in;
      const uint16_t* x1 = x0 + size_t(TILE_ROWS) * p.in;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int k = 0; k < k_blocks; ++k) {
        _tile_loadd(4, x0 + k * TILE_K, x_stride);
        _tile_loadd(6, weights(n, k), 64);
        _tile_dpbf16ps(0, 4, 6);
        if (two_n) {
          _tile_loadd(7, weights(n + 1, k), 64);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (two_m) {
          _tile_loadd(5, x1 + k * TILE_K, x_stride);
          _tile_dpbf16ps(2, 5, 6);
          if (two_n) _tile_dpbf16ps(3, 5, 7);
        }
      }
      constexpr int row_bytes = TILE_OUTS * 4;
      _tile_stored(0, buffer, row_bytes);
      put(p, m, n, buffer);
      if (two_n) {
        _tile_stored(1, buffer, row_bytes);
        put(p, m, n + 1, buffer);
      }
      if (two_m) {
        _tile_stored(2, buffer, row_bytes);
        put(p, m + 1, n, buffer);
        if (two_n) {
          _tile_stored(3, buffer, row_bytes);
          put(p, m + 1, n + 1, buffer);
        }
      }
    }
  }
  _tile_release();
}

#endif

}  // namespace

extern "C" {

// 1 where this build has the tile instructions and the process may use them, else 0.
int amx_linear_available() {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  return tiles_permitted() ? 1 : 0;
#else
  return 0;
#endif
}

// w [outs, in] bfloat16 (as uint16) into `packed`, which holds ceil(outs / 16) * 16 * in values: for each
// block of 16 outputs, for each block of 32 inputs, 16 rows of (output, pair) values; outputs past `outs`
// are zeros. `in` must be a multiple of 32.
void amx_pack(const uint16_t* w, int outs, int in, uint16_t* packed) {
  const int blocks = (outs + TILE_OUTS - 1) / TILE_OUTS, k_blocks = in / TILE_K;
  for (int b = 0; b < blocks; ++b)
    for (int k = 0; k < k_blocks; ++k) {
      uint16_t* tile = packed + (size_t(b) * k_blocks + k) * TILE_K * TILE_OUTS;
      for (int pair = 0; pair < TILE_K / 2; ++pair)
        for (int o = 0; o < TILE_OUTS; ++o)
          for (int e = 0; e < 2; ++e) {
            const int row = b * TILE_OUTS + o;
            tile[(pair * TILE_OUTS + o) * 2 + e] = row < outs ? w[size_t(row) * in + k * TILE_K + 2 * pair + e] : 0;
          }
    }
}

// out [rows, outs] bfloat16 = x [rows, in] · the packed weights' transpose (+ bias [outs] float32, or null),
// summed in float32 and rounded once, on up to `threads` threads (each a share of the output blocks). x
// holds rows rounded up to a multiple of 16 (the rows past `rows` are read, their results dropped), `in` a
// multiple of 32. Returns 0, or 1 where the tile instructions are not to be had here (nothing computed).
int amx_linear(const uint16_t* x, int rows, int in, const uint16_t* packed, int outs, const float* bias,
               uint16_t* out, int threads) {
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  if (!tiles_permitted() || in % TILE_K != 0) return 1;
  const Problem p{x, packed, bias, out, rows, in, outs};
  // pairs of output blocks, split evenly
  const int out_blocks = (outs + TILE_OUTS - 1) / TILE_OUTS;
  const int pairs = (out_blocks + 1) / 2, workers = std::max(1, std::min(threads, pairs));
  auto share = [&](int t) { return std::min(out_blocks, 2 * (pairs * t / workers)); };
  std::vector<std::thread> pool;
  pool.reserve(workers - 1);
  int started = 1;
  try {
    for (; started < workers; ++started) pool.emplace_back(run_blocks, std::cref(p), share(started), share(started + 1));
  } catch (const std::system_error&) {  // no thread to be had: this one takes the shares not started
  }
  run_blocks(p, share(0), share(1));
  for (int t = started; t < workers; ++t) run_blocks(p, share(t), share(t + 1));
  for (auto& t : pool) t.join();
  return 0;
#else
  (void)x, (void)rows, (void)in, (void)packed, (void)outs, (void)bias, (void)out, (void)threads;
  return 1;
#endif
}

}  // extern "C"
