// Shared definitions of the CPU backend: dtype codes (ggml numbering), block layouts, scalar
// F16/BF16 conversions. Everything here is `static inline` or a type: this header is included by
// translation units compiled with different instruction-set flags (scalar and AVX2), and a non-static
// inline function could be emitted with AVX2 instructions and then picked by the linker for the
// scalar path (an illegal instruction on an old CPU).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#include "powerinfer/wire.h"

namespace pi {

/// Dtype codes (ggml numbering), block layouts, names and row sizes: the wire header's, shared by every
/// native backend. Q8_1 and Q8_K are internal activation formats here, never tensor dtypes.
using namespace ::powerinfer::wire;

constexpr int QK = 32;    // block size of the legacy quants
constexpr int QK_K = 256; // super-block size of the K-quants

struct BlockQ4_0 {
  uint16_t d;
  uint8_t qs[QK / 2];
};
struct BlockQ4_1 {
  uint16_t d;
  uint16_t m;
  uint8_t qs[QK / 2];
};
struct BlockQ5_0 {
  uint16_t d;
  uint8_t qh[4];
  uint8_t qs[QK / 2];
};
struct BlockQ5_1 {
  uint16_t d;
  uint16_t m;
  uint8_t qh[4];
  uint8_t qs[QK / 2];
};
struct BlockQ8_0 {
  uint16_t d;
  int8_t qs[QK];
};
/// Activation block for Q4_1/Q5_1 dot products: s = d · Σ qs.
struct BlockQ8_1 {
  uint16_t d;
  uint16_t s;
  int8_t qs[QK];
};
struct BlockQ4_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qs[QK_K / 2];
};
struct BlockQ5_K {
  uint16_t d;
  uint16_t dmin;
  uint8_t scales[12];
  uint8_t qh[QK_K / 8];
  uint8_t qs[QK_K / 2];
};
struct BlockQ6_K {
  uint8_t ql[QK_K / 2];
  uint8_t qh[QK_K / 4];
  int8_t scales[QK_K / 16];
  uint16_t d;
};
/// Internal activation block for the legacy quants (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 weights): llama.cpp's
/// Q8_0/Q8_1 values with the scale pre-converted to F32. d is the F16-rounded scale (as stored by
/// llama.cpp). Q8_0 rounding (XF_Q8_0): `sum` = Σqs, the block's integer sum (Q4_0 dots subtract 8·sum);
/// Q8_1 rounding (XF_Q8_1): `s` = the F16-rounded d·Σqs.
struct XBlockQ8 {
  float d;
  union {
    float s;
    int32_t sum;
  };
  int8_t qs[QK];
};

/// Q4_0 repacked for matrix × vector (the CPU backend's own layout, made at first use; see
/// TensorStore::packed): 8 consecutive rows' blocks i side by side. d[r] = row r's scale;
/// qs[32·c + 4·r + b] = row r's qs[4·c + b] (c = 0..3, b = 0..3), so one 32-byte load holds, for 8
/// rows, the same 4 nibble bytes (elements 4c..4c+3 in the low nibbles, 16+4c..16+4c+3 in the high).
/// A row group of a tensor is its nb = k/32 blocks in order: 144·nb bytes.
struct BlockQ4_0x8 {
  uint16_t d[8];
  uint8_t qs[8 * QK / 2];
};

/// Q4_K repacked for the dense matrix product (the CPU backend's own layout, made at first use; see
/// TensorStore::packed): super-block i of 8 consecutive rows side by side, scales decoded. d[r], dmin[r] =
/// row r's super-block scales (F16); sc[8·j + r], mn[8·j + r] = row r's 6-bit scale and min of sub-block j
/// (k4_scale_min); qs[256·p + 32·c + 4·r + b] = row r's qs[32·p + 4·c + b] (pair p = 0..3 of sub-blocks
/// 2p (low nibbles) and 2p + 1 (high nibbles), 4-byte chunk c = 0..7, b = 0..3), so one 32-byte load holds,
/// for 8 rows, elements 64p + 4c..+3 (low nibbles) and 64p + 32 + 4c..+3 (high). A row group of a tensor is
/// its k/256 blocks in order: 1184 bytes per block (2.8 % more than the 8 rows' 1152).
struct BlockQ4_Kx8 {
  uint16_t d[8];
  uint16_t dmin[8];
  uint8_t sc[64];
  uint8_t mn[64];
  uint8_t qs[8 * QK_K / 2];
};

/// Activation block for K-quant dot products: d is F32, bsums are sums of 16 consecutive qs.
struct BlockQ8_K {
  float d;
  int8_t qs[QK_K];
  int16_t bsums[QK_K / 16];
};

static_assert(sizeof(BlockQ4_0) == 18, "q4_0 layout");
static_assert(sizeof(BlockQ4_0x8) == 144, "q4_0x8 layout");
static_assert(sizeof(BlockQ4_Kx8) == 1184, "q4_Kx8 layout");
static_assert(sizeof(BlockQ4_1) == 20, "q4_1 layout");
static_assert(sizeof(BlockQ5_0) == 22, "q5_0 layout");
static_assert(sizeof(BlockQ5_1) == 24, "q5_1 layout");
static_assert(sizeof(BlockQ8_0) == 34, "q8_0 layout");
static_assert(sizeof(BlockQ8_1) == 36, "q8_1 layout");
static_assert(sizeof(BlockQ4_K) == 144, "q4_K layout");
static_assert(sizeof(BlockQ5_K) == 176, "q5_K layout");
static_assert(sizeof(BlockQ6_K) == 210, "q6_K layout");
static_assert(sizeof(BlockQ8_K) == 292, "q8_K layout");
static_assert(sizeof(XBlockQ8) == 40, "activation block layout");

static inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
static inline float bits_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

/// IEEE half → float, exact (subnormals, inf and NaN included).
static inline float f16_to_f32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t em = h & 0x7fffu;
  if (em >= 0x7c00u) return bits_f32(sign | 0x7f800000u | ((em & 0x3ffu) << 13));
  if (em >= 0x0400u) return bits_f32(sign | ((em << 13) + 0x38000000u));
  const float v = static_cast<float>(em) * (1.0f / 16777216.0f);  // subnormal: em · 2^-24
  return bits_f32(sign | f32_bits(v));
}

/// float → IEEE half, round to nearest even (what F16C's vcvtps2ph with imm 0 does).
static inline uint16_t f32_to_f16(float f) {
  uint32_t x = f32_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // ≥ 65520 rounds to inf
  if (ax < 0x38800000u) {
    // Below the smallest normal half: let the FPU round |f| + 0.5 at a 2^-24 ulp.
    const float v = bits_f32(ax) + 0.5f;
    return static_cast<uint16_t>(sign | (f32_bits(v) - 0x3f000000u));
  }
  const uint32_t odd = (ax >> 13) & 1u;
  ax += 0xc8000fffu + odd;  // rebias exponent by −112 and round to nearest even
  return static_cast<uint16_t>(sign | (ax >> 13));
}

static inline float bf16_to_f32(uint16_t b) { return bits_f32(static_cast<uint32_t>(b) << 16); }

/// float → bfloat16, round to nearest even; NaN stays a (quiet) NaN.
static inline uint16_t f32_to_bf16(float f) {
  const uint32_t u = f32_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}

static inline uint16_t load_u16(const void* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

/// 6-bit scale and min of sub-block j (0..7) of a Q4_K/Q5_K super-block.
static inline void k4_scale_min(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = static_cast<uint8_t>((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
    *m = static_cast<uint8_t>((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
  }
}

/// Bytes of one group of 8 rows of k elements in the repacked layout of `dtype` (BlockQ4_0x8 for Q4_0,
/// BlockQ4_Kx8 for Q4_K); 0 when the dtype has none or k is not a whole number of blocks.
static inline size_t packed_group_bytes(int dtype, int64_t k) {
  if (dtype == DT_Q4_0 && k > 0 && k % QK == 0) return static_cast<size_t>(k / QK) * sizeof(BlockQ4_0x8);
  if (dtype == DT_Q4_K && k > 0 && k % QK_K == 0) return static_cast<size_t>(k / QK_K) * sizeof(BlockQ4_Kx8);
  return 0;
}

}  // namespace pi
