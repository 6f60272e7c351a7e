// Portable kernels (no instruction-set assumptions beyond baseline x86-64 / any C++17 target).
// They define the reference semantics of every block format; the AVX2 kernels must agree with them
// up to float summation order.
#include <cmath>

#include "attn_ggml.h"
#include "attn_tiled.h"
#include "kernels.h"

namespace pi {
namespace {

// ---- dequantization -------------------------------------------------------------------------

void dequant_f32(const void* w, float* y, int64_t k) { std::memcpy(y, w, static_cast<size_t>(k) * 4); }

void dequant_f16(const void* w, float* y, int64_t k) {
  const uint16_t* h = static_cast<const uint16_t*>(w);
  for (int64_t i = 0; i < k; i++) y[i] = f16_to_f32(h[i]);
}

void dequant_bf16(const void* w, float* y, int64_t k) {
  const uint16_t* h = static_cast<const uint16_t*>(w);
  for (int64_t i = 0; i < k; i++) y[i] = bf16_to_f32(h[i]);
}

void dequant_q4_0(const void* w, float* y, int64_t k) {
  const BlockQ4_0* b = static_cast<const BlockQ4_0*>(w);
  for (int64_t i = 0; i < k / QK; i++, y += QK) {
    const float d = f16_to_f32(b[i].d);
    for (int j = 0; j < QK / 2; j++) {
      y[j] = static_cast<float>((b[i].qs[j] & 0xF) - 8) * d;
      y[j + QK / 2] = static_cast<float>((b[i].qs[j] >> 4) - 8) * d;
    }
  }
}

void dequant_q4_1(const void* w, float* y, int64_t k) {
  const BlockQ4_1* b = static_cast<const BlockQ4_1*>(w);
  for (int64_t i = 0; i < k / QK; i++, y += QK) {
    const float d = f16_to_f32(b[i].d);
    const float m = f16_to_f32(b[i].m);
    for (int j = 0; j < QK / 2; j++) {
      y[j] = static_cast<float>(b[i].qs[j] & 0xF) * d + m;
      y[j + QK / 2] = static_cast<float>(b[i].qs[j] >> 4) * d + m;
    }
  }
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

void dequant_q5_0(const void* w, float* y, int64_t k) {
  const BlockQ5_0* b = static_cast<const BlockQ5_0*>(w);
  for (int64_t i = 0; i < k / QK; i++, y += QK) {
    const float d = f16_to_f32(b[i].d);
    const uint32_t qh = load_u32(b[i].qh);
    for (int j = 0; j < QK / 2; j++) {
      const int lo = static_cast<int>((b[i].qs[j] & 0xF) | (((qh >> j) & 1u) << 4)) - 16;
      const int hi = static_cast<int>((b[i].qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - 16;
      y[j] = static_cast<float>(lo) * d;
      y[j + QK / 2] = static_cast<float>(hi) * d;
    }
  }
}

void dequant_q5_1(const void* w, float* y, int64_t k) {
  const BlockQ5_1* b = static_cast<const BlockQ5_1*>(w);
  for (int64_t i = 0; i < k / QK; i++, y += QK) {
    const float d = f16_to_f32(b[i].d);
    const float m = f16_to_f32(b[i].m);
    const uint32_t qh = load_u32(b[i].qh);
    for (int j = 0; j < QK / 2; j++) {
      const uint32_t lo = (b[i].qs[j] & 0xFu) | (((qh >> j) & 1u) << 4);
      const uint32_t hi = (b[i].qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4);
      y[j] = static_cast<float>(lo) * d + m;
      y[j + QK / 2] = static_cast<float>(hi) * d + m;
    }
  }
}

void dequant_q8_0(const void* w, float* y, int64_t k) {
  const BlockQ8_0* b = static_cast<const BlockQ8_0*>(w);
  for (int64_t i = 0; i < k / QK; i++, y += QK) {
    const float d = f16_to_f32(b[i].d);
    for (int j = 0; j < QK; j++) y[j] = static_cast<float>(b[i].qs[j]) * d;
  }
}

void dequant_q4_K(const void* w, float* y, int64_t k) {
  const BlockQ4_K* b = static_cast<const BlockQ4_K*>(w);
  for (int64_t i = 0; i < k / QK_K; i++) {
    const float d = f16_to_f32(b[i].d);
    const float dmin = f16_to_f32(b[i].dmin);
    const uint8_t* q = b[i].qs;
    for (int j = 0; j < 4; j++, q += 32) {
      uint8_t sc, m;
      k4_scale_min(2 * j, b[i].scales, &sc, &m);
      const float d1 = d * sc, m1 = dmin * m;
      k4_scale_min(2 * j + 1, b[i].scales, &sc, &m);
      const float d2 = d * sc, m2 = dmin * m;
      for (int l = 0; l < 32; l++) *y++ = d1 * static_cast<float>(q[l] & 0xF) - m1;
      for (int l = 0; l < 32; l++) *y++ = d2 * static_cast<float>(q[l] >> 4) - m2;
    }
  }
}

void dequant_q5_K(const void* w, float* y, int64_t k) {
  const BlockQ5_K* b = static_cast<const BlockQ5_K*>(w);
  for (int64_t i = 0; i < k / QK_K; i++) {
    const float d = f16_to_f32(b[i].d);
    const float dmin = f16_to_f32(b[i].dmin);
    const uint8_t* q = b[i].qs;
    const uint8_t* qh = b[i].qh;
    for (int j = 0; j < 4; j++, q += 32) {
      uint8_t sc, m;
      k4_scale_min(2 * j, b[i].scales, &sc, &m);
      const float d1 = d * sc, m1 = dmin * m;
      k4_scale_min(2 * j + 1, b[i].scales, &sc, &m);
      const float d2 = d * sc, m2 = dmin * m;
      const uint8_t u1 = static_cast<uint8_t>(1u << (2 * j)), u2 = static_cast<uint8_t>(2u << (2 * j));
      for (int l = 0; l < 32; l++) *y++ = d1 * static_cast<float>((q[l] & 0xF) + ((qh[l] & u1) ? 16 : 0)) - m1;
      for (int l = 0; l < 32; l++) *y++ = d2 * static_cast<float>((q[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
    }
  }
}

/// The 6-bit value (0..63) of element e (0..255) of a Q6_K block.
inline int q6_value(const BlockQ6_K& b, int e) {
  const int h = e / 128, r = e % 128, quarter = r / 32, l = r % 32;
  const uint8_t lb = b.ql[64 * h + l + 32 * (quarter & 1)];
  const int low = quarter < 2 ? (lb & 0xF) : (lb >> 4);
  const int high = (b.qh[32 * h + l] >> (2 * quarter)) & 3;
  return low | (high << 4);
}

void dequant_q6_K(const void* w, float* y, int64_t k) {
  const BlockQ6_K* b = static_cast<const BlockQ6_K*>(w);
  for (int64_t i = 0; i < k / QK_K; i++) {
    const float d = f16_to_f32(b[i].d);
    for (int e = 0; e < QK_K; e++) {
      *y++ = d * static_cast<float>(b[i].scales[e / 16]) * static_cast<float>(q6_value(b[i], e) - 32);
    }
  }
}

// ---- activation conversion ------------------------------------------------------------------

void convert_f32(const float* x, void* dst, int64_t k) { std::memcpy(dst, x, static_cast<size_t>(k) * 4); }

void store_f16(const float* x, void* dst, int64_t k) {
  uint16_t* h = static_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < k; i++) h[i] = f32_to_f16(x[i]);
}

void store_bf16(const float* x, void* dst, int64_t k) {
  uint16_t* h = static_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < k; i++) h[i] = f32_to_bf16(x[i]);
}

void convert_f16(const float* x, void* dst, int64_t k) {
  float* y = static_cast<float*>(dst);
  for (int64_t i = 0; i < k; i++) y[i] = f16_to_f32(f32_to_f16(x[i]));
}

void convert_bf16(const float* x, void* dst, int64_t k) {
  float* y = static_cast<float*>(dst);
  for (int64_t i = 0; i < k; i++) y[i] = bf16_to_f32(f32_to_bf16(x[i]));
}

// Q8_0/Q8_1: d = amax/127, q = round-to-nearest-even(x · 127/amax) (as llama.cpp's x86 path).
/// Q8_0 (q1 = false) or Q8_1 (q1 = true) rounding into XBlockQ8 blocks.
template <bool Q1>
void convert_q8(const float* x, void* dst, int64_t k) {
  XBlockQ8* b = static_cast<XBlockQ8*>(dst);
  for (int64_t i = 0; i < k / QK; i++, x += QK) {
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) amax = std::fmax(amax, std::fabs(x[j]));
    const float d = amax / 127.0f;
    const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
    int sum = 0;
    for (int j = 0; j < QK; j++) {
      b[i].qs[j] = static_cast<int8_t>(std::nearbyint(x[j] * id));
      sum += b[i].qs[j];
    }
    b[i].d = f16_to_f32(f32_to_f16(d));
    if (Q1) {
      b[i].s = f16_to_f32(f32_to_f16(d * static_cast<float>(sum)));
    } else {
      b[i].sum = sum;
    }
  }
}

// Q8_K: the element of largest magnitude maps to −127 (iscale = −127/max), d = 1/iscale (F32).
void convert_q8_K(const float* x, void* dst, int64_t k) {
  BlockQ8_K* b = static_cast<BlockQ8_K*>(dst);
  for (int64_t i = 0; i < k / QK_K; i++, x += QK_K) {
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < QK_K; j++) {
      const float a = std::fabs(x[j]);
      if (a > amax) {
        amax = a;
        max = x[j];
      }
    }
    if (amax == 0.0f) {
      std::memset(&b[i], 0, sizeof(BlockQ8_K));
      continue;
    }
    const float iscale = -127.0f / max;
    for (int j = 0; j < QK_K; j++) {
      const int v = static_cast<int>(std::nearbyint(iscale * x[j]));
      b[i].qs[j] = static_cast<int8_t>(v > 127 ? 127 : v);
    }
    for (int g = 0; g < QK_K / 16; g++) {
      int s = 0;
      for (int j = 0; j < 16; j++) s += b[i].qs[16 * g + j];
      b[i].bsums[g] = static_cast<int16_t>(s);
    }
    b[i].d = 1.0f / iscale;
  }
}

// ---- dot products ---------------------------------------------------------------------------

float dot_f32v(int64_t n, const float* a, const float* b) {
  float s = 0.0f;
  for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
  return s;
}

float dot_f32(int64_t k, const void* w, const void* x) {
  return dot_f32v(k, static_cast<const float*>(w), static_cast<const float*>(x));
}

float dot_f16(int64_t k, const void* w, const void* x) {
  const uint16_t* a = static_cast<const uint16_t*>(w);
  const float* b = static_cast<const float*>(x);
  float s = 0.0f;
  for (int64_t i = 0; i < k; i++) s += f16_to_f32(a[i]) * b[i];
  return s;
}

float dot_bf16(int64_t k, const void* w, const void* x) {
  const uint16_t* a = static_cast<const uint16_t*>(w);
  const float* b = static_cast<const float*>(x);
  float s = 0.0f;
  for (int64_t i = 0; i < k; i++) s += bf16_to_f32(a[i]) * b[i];
  return s;
}

// Q4_0 arithmetic (KernelTable::packed_tile): the block's exact integer Σ(q − 8)·x, then one fused
// multiply-add per block, so this equals the AVX2 kernels bit for bit.
float dot_q4_0(int64_t k, const void* w, const void* x) {
  const BlockQ4_0* a = static_cast<const BlockQ4_0*>(w);
  const XBlockQ8* b = static_cast<const XBlockQ8*>(x);
  float s = 0.0f;
  for (int64_t i = 0; i < k / QK; i++) {
    int sumi = 0;
    for (int j = 0; j < QK / 2; j++) {
      sumi += ((a[i].qs[j] & 0xF) - 8) * b[i].qs[j] + ((a[i].qs[j] >> 4) - 8) * b[i].qs[j + QK / 2];
    }
    s = std::fma(static_cast<float>(sumi), f16_to_f32(a[i].d) * b[i].d, s);
  }
  return s;
}

void q4_0x8_tile(int64_t k, int ng, int nc, const uint8_t* groups, const uint8_t* const* x, float* out) {
  for (int g = 0; g < ng; g++) {
    const BlockQ4_0x8* a = reinterpret_cast<const BlockQ4_0x8*>(groups) + g * (k / QK);
    for (int c = 0; c < nc; c++) {
    const XBlockQ8* b = reinterpret_cast<const XBlockQ8*>(x[c]);
    for (int r = 0; r < 8; r++) {
      float s = 0.0f;
      for (int64_t i = 0; i < k / QK; i++) {
        int sumi = 0;
        for (int ch = 0; ch < 4; ch++) {
          for (int j = 0; j < 4; j++) {
            const uint8_t q = a[i].qs[32 * ch + 4 * r + j];
            sumi += ((q & 0xF) - 8) * b[i].qs[4 * ch + j] + ((q >> 4) - 8) * b[i].qs[16 + 4 * ch + j];
          }
        }
        s = std::fma(static_cast<float>(sumi), f16_to_f32(a[i].d[r]) * b[i].d, s);
      }
      out[8 * (g * nc + c) + r] = s;
    }
    }
  }
}

float dot_q4_1(int64_t k, const void* w, const void* x) {
  const BlockQ4_1* a = static_cast<const BlockQ4_1*>(w);
  const XBlockQ8* b = static_cast<const XBlockQ8*>(x);
  float s = 0.0f;
  for (int64_t i = 0; i < k / QK; i++) {
    int sumi = 0;
    for (int j = 0; j < QK / 2; j++) {
      sumi += (a[i].qs[j] & 0xF) * b[i].qs[j] + (a[i].qs[j] >> 4) * b[i].qs[j + QK / 2];
    }
    s += static_cast<float>(sumi) * (f16_to_f32(a[i].d) * b[i].d) +
         f16_to_f32(a[i].m) * b[i].s;
  }
  return s;
}

float dot_q5_0(int64_t k, const void* w, const void* x) {
  const BlockQ5_0* a = static_cast<const BlockQ5_0*>(w);
  const XBlockQ8* b = static_cast<const XBlockQ8*>(x);
  float s = 0.0f;
  for (int64_t i = 0; i < k / QK; i++) {
    const uint32_t qh = load_u32(a[i].qh);
    int sumi = 0;
    for (int j = 0; j < QK / 2; j++) {
      const int lo = static_cast<int>((a[i].qs[j] & 0xF) | (((qh >> j) & 1u) << 4)) - 16;
      const int hi = static_cast<int>((a[i].qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4)) - 16;
      sumi += lo * b[i].qs[j] + hi * b[i].qs[j + QK / 2];
    }
    s += static_cast<float>(sumi) * (f16_to_f32(a[i].d) * b[i].d);
  }
  return s;
}

float dot_q5_1(int64_t k, const void* w, const void* x) {
  const BlockQ5_1* a = static_cast<const BlockQ5_1*>(w);
  const XBlockQ8* b = static_cast<const XBlockQ8*>(x);
  float s = 0.0f;
  for (int64_t i = 0; i < k / QK; i++) {
    const uint32_t qh = load_u32(a[i].qh);
    int sumi = 0;
    for (int j = 0; j < QK / 2; j++) {
      const int lo = static_cast<int>((a[i].qs[j] & 0xF) | (((qh >> j) & 1u) << 4));
      const int hi = static_cast<int>((a[i].qs[j] >> 4) | (((qh >> (j + 16)) & 1u) << 4));
      sumi += lo * b[i].qs[j] + hi * b[i].qs[j + QK / 2];
    }
    s += static_cast<float>(sumi) * (f16_to_f32(a[i].d) * b[i].d) +
         f16_to_f32(a[i].m) * b[i].s;
  }
  return s;
}

float dot_q8_0(int64_t k, const void* w, const void* x) {
  const BlockQ8_0* a = static_cast<const BlockQ8_0*>(w);
  const XBlockQ8* b = static_cast<const XBlockQ8*>(x);
  float s = 0.0f;
  for (int64_t i = 0; i < k / QK; i++) {
    int sumi = 0;
    for (int j = 0; j < QK; j++) sumi += a[i].qs[j] * b[i].qs[j];
    s += static_cast<float>(sumi) * (f16_to_f32(a[i].d) * b[i].d);
  }
  return s;
}

// K-quants: Σ_sub d·sc·Σ(q·y) − dmin·m·Σy, with integer inner sums (exact) and Σy from bsums.
float dot_q4_K(int64_t k, const void* w, const void* x) {
  const BlockQ4_K* a = static_cast<const BlockQ4_K*>(w);
  const BlockQ8_K* b = static_cast<const BlockQ8_K*>(x);
  float s = 0.0f;
  for (int64_t i = 0; i < k / QK_K; i++) {
    int sumi = 0, summ = 0;
    const uint8_t* q = a[i].qs;
    const int8_t* y = b[i].qs;
    for (int j = 0; j < 4; j++, q += 32, y += 64) {
      uint8_t sc1, m1, sc2, m2;
      k4_scale_min(2 * j, a[i].scales, &sc1, &m1);
      k4_scale_min(2 * j + 1, a[i].scales, &sc2, &m2);
      int s1 = 0, s2 = 0;
      for (int l = 0; l < 32; l++) {
        s1 += (q[l] & 0xF) * y[l];
        s2 += (q[l] >> 4) * y[l + 32];
      }
      sumi += sc1 * s1 + sc2 * s2;
      summ += m1 * (b[i].bsums[4 * j] + b[i].bsums[4 * j + 1]) + m2 * (b[i].bsums[4 * j + 2] + b[i].bsums[4 * j + 3]);
    }
    s += b[i].d * (f16_to_f32(a[i].d) * static_cast<float>(sumi) - f16_to_f32(a[i].dmin) * static_cast<float>(summ));
  }
  return s;
}

/// Repacked Q4_K (BlockQ4_Kx8): each row's value in dot_q4_K's arithmetic.
void q4_Kx8_tile(int64_t k, int ng, int nc, const uint8_t* groups, const uint8_t* const* x, float* out) {
  for (int g = 0; g < ng; g++) {
    const BlockQ4_Kx8* a = reinterpret_cast<const BlockQ4_Kx8*>(groups) + g * (k / QK_K);
    for (int c = 0; c < nc; c++) {
      const BlockQ8_K* b = reinterpret_cast<const BlockQ8_K*>(x[c]);
      for (int r = 0; r < 8; r++) {
        float s = 0.0f;
        for (int64_t i = 0; i < k / QK_K; i++) {
          int sumi = 0, summ = 0;
          for (int p = 0; p < 4; p++) {
            int s1 = 0, s2 = 0;
            for (int ch = 0; ch < 8; ch++) {
              for (int e = 0; e < 4; e++) {
                const uint8_t q = a[i].qs[256 * p + 32 * ch + 4 * r + e];
                s1 += (q & 0xF) * b[i].qs[64 * p + 4 * ch + e];
                s2 += (q >> 4) * b[i].qs[64 * p + 32 + 4 * ch + e];
              }
            }
            sumi += a[i].sc[8 * (2 * p) + r] * s1 + a[i].sc[8 * (2 * p + 1) + r] * s2;
            summ += a[i].mn[8 * (2 * p) + r] * (b[i].bsums[4 * p] + b[i].bsums[4 * p + 1]) +
                    a[i].mn[8 * (2 * p + 1) + r] * (b[i].bsums[4 * p + 2] + b[i].bsums[4 * p + 3]);
          }
          s += b[i].d * (f16_to_f32(a[i].d[r]) * static_cast<float>(sumi) - f16_to_f32(a[i].dmin[r]) * static_cast<float>(summ));
        }
        out[8 * (g * nc + c) + r] = s;
      }
    }
  }
}

float dot_q5_K(int64_t k, const void* w, const void* x) {
  const BlockQ5_K* a = static_cast<const BlockQ5_K*>(w);
  const BlockQ8_K* b = static_cast<const BlockQ8_K*>(x);
  float s = 0.0f;
  for (int64_t i = 0; i < k / QK_K; i++) {
    int sumi = 0, summ = 0;
    const uint8_t* q = a[i].qs;
    const uint8_t* qh = a[i].qh;
    const int8_t* y = b[i].qs;
    for (int j = 0; j < 4; j++, q += 32, y += 64) {
      uint8_t sc1, m1, sc2, m2;
      k4_scale_min(2 * j, a[i].scales, &sc1, &m1);
      k4_scale_min(2 * j + 1, a[i].scales, &sc2, &m2);
      int s1 = 0, s2 = 0;
      for (int l = 0; l < 32; l++) {
        s1 += ((q[l] & 0xF) | (((qh[l] >> (2 * j)) & 1) << 4)) * y[l];
        s2 += ((q[l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4)) * y[l + 32];
      }
      sumi += sc1 * s1 + sc2 * s2;
      summ += m1 * (b[i].bsums[4 * j] + b[i].bsums[4 * j + 1]) + m2 * (b[i].bsums[4 * j + 2] + b[i].bsums[4 * j + 3]);
    }
    s += b[i].d * (f16_to_f32(a[i].d) * static_cast<float>(sumi) - f16_to_f32(a[i].dmin) * static_cast<float>(summ));
  }
  return s;
}

float dot_q6_K(int64_t k, const void* w, const void* x) {
  const BlockQ6_K* a = static_cast<const BlockQ6_K*>(w);
  const BlockQ8_K* b = static_cast<const BlockQ8_K*>(x);
  float s = 0.0f;
  for (int64_t i = 0; i < k / QK_K; i++) {
    int sumi = 0;
    for (int g = 0; g < QK_K / 16; g++) {
      int sg = 0;
      for (int l = 0; l < 16; l++) sg += (q6_value(a[i], 16 * g + l) - 32) * b[i].qs[16 * g + l];
      sumi += a[i].scales[g] * sg;
    }
    s += b[i].d * f16_to_f32(a[i].d) * static_cast<float>(sumi);
  }
  return s;
}

// ---- axpy -----------------------------------------------------------------------------------

void axpy_f32v(int64_t n, float a, const float* x, float* y) {
  for (int64_t i = 0; i < n; i++) y[i] += a * x[i];
}

void axpy_f32(int64_t k, float a, const void* w, float* y) { axpy_f32v(k, a, static_cast<const float*>(w), y); }

void axpy_f16(int64_t k, float a, const void* w, float* y) {
  const uint16_t* h = static_cast<const uint16_t*>(w);
  for (int64_t i = 0; i < k; i++) y[i] += a * f16_to_f32(h[i]);
}

void axpy_bf16(int64_t k, float a, const void* w, float* y) {
  const uint16_t* h = static_cast<const uint16_t*>(w);
  for (int64_t i = 0; i < k; i++) y[i] += a * bf16_to_f32(h[i]);
}

/// Quantized rows: dequantize one block at a time into a stack buffer, then accumulate.
template <int DT, int BLOCK, int BYTES>
void axpy_blocks(int64_t k, float a, const void* w, float* y) {
  float tmp[BLOCK];
  const uint8_t* p = static_cast<const uint8_t*>(w);
  for (int64_t i = 0; i < k / BLOCK; i++, p += BYTES, y += BLOCK) {
    kernels_scalar().dequant[DT](p, tmp, BLOCK);
    for (int j = 0; j < BLOCK; j++) y[j] += a * tmp[j];
  }
}

template <int DT>
void dot_tile(int64_t k, int nr, int nc, const uint8_t* const* w, const uint8_t* const* x, float* out) {
  for (int r = 0; r < nr; r++) {
    for (int c = 0; c < nc; c++) out[r * nc + c] = kernels_scalar().dot[DT](k, w[r], x[c]);
  }
}

/// llama.cpp's prompt GEMM arithmetic (see KernelTable::gemm_tile) lane by lane: 8 lanes, one fused
/// multiply-add per lane and step of 8, then the AVX2 table's horizontal sum ((l0+l4) + (l2+l6)) +
/// ((l1+l5) + (l3+l7)), so this table rounds as the AVX2 one.
template <int DT>
float gemm_dot(int64_t k, const uint8_t* w, const float* x) {
  float lane[8] = {};
  for (int64_t i = 0; i + 8 <= k; i += 8) {
    for (int l = 0; l < 8; l++) {
      const int64_t j = i + l;
      float wv;
      if (DT == DT_F32) {
        wv = reinterpret_cast<const float*>(w)[j];
      } else if (DT == DT_F16) {
        wv = f16_to_f32(reinterpret_cast<const uint16_t*>(w)[j]);
      } else {
        wv = bf16_to_f32(reinterpret_cast<const uint16_t*>(w)[j]);
      }
      lane[l] = std::fma(wv, x[j], lane[l]);
    }
  }
  const float h0 = lane[0] + lane[4], h1 = lane[1] + lane[5], h2 = lane[2] + lane[6], h3 = lane[3] + lane[7];
  return (h0 + h2) + (h1 + h3);
}

/// Q8_0 in the AVX2 table's tinyBLAS_Q0 arithmetic lane by lane: lane l of a block holds the exact sum
/// of its bytes 4l..4l+3 products (maddubs + madd), lane = fma(d_w · d_x, float(sum), lane) block by
/// block, then the same horizontal sum.
float gemm_dot_q8_0(int64_t k, const uint8_t* w, const uint8_t* x) {
  const BlockQ8_0* a = reinterpret_cast<const BlockQ8_0*>(w);
  const XBlockQ8* b = reinterpret_cast<const XBlockQ8*>(x);
  float lane[8] = {};
  for (int64_t i = 0; i < k / QK; i++) {
    const float d = f16_to_f32(a[i].d) * b[i].d;
    for (int l = 0; l < 8; l++) {
      int sumi = 0;
      for (int j = 4 * l; j < 4 * l + 4; j++) sumi += a[i].qs[j] * b[i].qs[j];
      lane[l] = std::fma(d, static_cast<float>(sumi), lane[l]);
    }
  }
  const float h0 = lane[0] + lane[4], h1 = lane[1] + lane[5], h2 = lane[2] + lane[6], h3 = lane[3] + lane[7];
  return (h0 + h2) + (h1 + h3);
}

template <int DT>
void gemm_tile(int64_t k, int nr, int nc, const uint8_t* const* w, const uint8_t* const* x, float* out) {
  for (int r = 0; r < nr; r++) {
    for (int c = 0; c < nc; c++) {
      if constexpr (DT == DT_Q8_0) {
        out[r * nc + c] = gemm_dot_q8_0(k, w[r], x[c]);
      } else {
        out[r * nc + c] = gemm_dot<DT>(k, w[r], reinterpret_cast<const float*>(x[c]));
      }
    }
  }
}

/// ggml's vector primitives in scalar form, lane by lane in the AVX2 build's order (8 lanes, 4
/// accumulators over 32-element steps, ggml's tree reduction), so this table rounds as the AVX2 one.
struct GgmlScalar {
  template <int KI>
  static float dot(int64_t n, const uint8_t* k, const float* q) {
    const int64_t np = n & ~int64_t{31};
    float acc[4][8] = {};
    for (int64_t i = 0; i < np; i += 32) {
      for (int j = 0; j < 4; j++) {
        for (int l = 0; l < 8; l++) {
          const int64_t e = i + j * 8 + l;
          const float kv = KI ? f16_to_f32(load_u16(k + e * 2)) : reinterpret_cast<const float*>(k)[e];
          acc[j][l] = std::fma(kv, q[e], acc[j][l]);
        }
      }
    }
    float r[8];
    for (int l = 0; l < 8; l++) r[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    float h[4];
    for (int l = 0; l < 4; l++) h[l] = r[l] + r[l + 4];
    const float red = (h[0] + h[1]) + (h[2] + h[3]);
    if (KI) {
      double sum = red;
      for (int64_t i = np; i < n; i++) sum += static_cast<double>(f16_to_f32(load_u16(k + i * 2)) * q[i]);
      return static_cast<float>(sum);
    }
    float sum = red;
    const float* kf = reinterpret_cast<const float*>(k);
    for (int64_t i = np; i < n; i++) sum = kGgmlContract ? std::fma(kf[i], q[i], sum) : sum + kf[i] * q[i];
    return sum;
  }
  static void scale_f32(int64_t n, float* y, float a) {
    for (int64_t i = 0; i < n; i++) y[i] *= a;
  }
  static void scale_f16(int64_t n, uint16_t* y, float a) {
    for (int64_t i = 0; i < n; i++) y[i] = f32_to_f16(f16_to_f32(y[i]) * a);
  }
  static void mad_f32(int64_t n, float* y, const float* x, float a) {
    const int64_t np = n & ~int64_t{31};
    for (int64_t i = 0; i < np; i++) y[i] = std::fma(x[i], a, y[i]);
    for (int64_t i = np; i < n; i++) y[i] = kGgmlContract ? std::fma(x[i], a, y[i]) : y[i] + x[i] * a;
  }
  static void mad_f16(int64_t n, uint16_t* y, const uint16_t* x, float a) {
    const int64_t np = n & ~int64_t{31};
    for (int64_t i = 0; i < np; i++) y[i] = f32_to_f16(std::fma(f16_to_f32(x[i]), a, f16_to_f32(y[i])));
    for (int64_t i = np; i < n; i++) {
      const float xv = f16_to_f32(x[i]), yv = f16_to_f32(y[i]);
      y[i] = f32_to_f16(kGgmlContract ? std::fma(xv, a, yv) : yv + xv * a);
    }
  }
};

/// attn_tiled.h's primitives in scalar form: each GEMM output one FMA chain in k order (as simd-gemm.h's
/// lanes), the softmax's 8-element blocks reduced in the AVX2 build's order (hi + lo halves, then pairs).
struct TiledScalar {
  static void gemm(float* C, int64_t ldc, const float* A, int64_t lda, const float* B, int64_t ldb, int64_t M, int64_t K,
                   int64_t N) {
    for (int64_t i = 0; i < M; i++) {
      for (int64_t j = 0; j < N; j++) {
        float acc = C[i * ldc + j];
        for (int64_t kk = 0; kk < K; kk++) acc = std::fma(B[kk * ldb + j], A[i * lda + kk], acc);
        C[i * ldc + j] = acc;
      }
    }
  }
  template <int KV>
  static void pack(int64_t hd, const uint8_t* k, size_t kstride, const uint8_t* v, size_t vstride, int64_t kv, float* Kt,
                   int64_t ldkt, float* V32) {
    for (int64_t j = 0; j < kv; j++) {
      const uint8_t* kr = k + static_cast<size_t>(j) * kstride;
      const uint8_t* vr = v + static_cast<size_t>(j) * vstride;
      for (int64_t d = 0; d < hd; d++) {
        Kt[d * ldkt + j] = KV ? f16_to_f32(load_u16(kr + 2 * d)) : reinterpret_cast<const float*>(kr)[d];
        V32[j * hd + d] = KV ? f16_to_f32(load_u16(vr + 2 * d)) : reinterpret_cast<const float*>(vr)[d];
      }
    }
  }
  static float scale_max(int64_t n, float* y, int64_t from, int64_t to, float scale) {
    float mx = -INFINITY;
    for (int64_t j = 0; j < n; j++) {
      y[j] = j >= from && j < to ? y[j] * scale : -INFINITY;
      mx = std::fmax(mx, y[j]);
    }
    return mx;
  }
  static double soft_max(int64_t n, float* y, float max) {
    double sum = 0.0;
    for (int64_t i = 0; i < n; i += 8) {
      float v[8];
      for (int l = 0; l < 8; l++) y[i + l] = v[l] = expf_ggml_avx2(y[i + l] - max);
      const float h0 = v[4] + v[0], h1 = v[5] + v[1], h2 = v[6] + v[2], h3 = v[7] + v[3];
      sum += static_cast<double>((h0 + h2) + (h1 + h3));
    }
    return sum;
  }
};

template <int DT>
void axpy_rows(int64_t k, int nr, const float* a, const uint8_t* const* w, float* y) {
  for (int r = 0; r < nr; r++) kernels_scalar().axpy[DT](k, a[r], w[r], y);
}

double sum_f32(const float* x, int64_t n) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int j = 0; j < 8; j++) s[j] += x[i + j];
  }
  double t = 0;
  for (int j = 0; j < 8; j++) t += s[j];
  for (; i < n; i++) t += x[i];
  return t;
}

KernelTable make_table() {
  KernelTable t{};
  t.name = "scalar";
  for (int& r : t.tile_rows) r = 4;
  t.dot[DT_F32] = dot_f32;
  t.dot[DT_F16] = dot_f16;
  t.dot[DT_BF16] = dot_bf16;
  t.dot[DT_Q4_0] = dot_q4_0;
  t.packed_tile[DT_Q4_0] = q4_0x8_tile;
  t.packed_tile[DT_Q4_K] = q4_Kx8_tile;
  t.dot[DT_Q4_1] = dot_q4_1;
  t.dot[DT_Q5_0] = dot_q5_0;
  t.dot[DT_Q5_1] = dot_q5_1;
  t.dot[DT_Q8_0] = dot_q8_0;
  t.dot[DT_Q4_K] = dot_q4_K;
  t.dot[DT_Q5_K] = dot_q5_K;
  t.dot[DT_Q6_K] = dot_q6_K;
  t.dot_tile[DT_F32] = dot_tile<DT_F32>;
  t.dot_tile[DT_F16] = dot_tile<DT_F16>;
  t.dot_tile[DT_BF16] = dot_tile<DT_BF16>;
  t.gemm_tile[DT_F32] = gemm_tile<DT_F32>;
  t.gemm_tile[DT_F16] = gemm_tile<DT_F16>;
  t.gemm_tile[DT_BF16] = gemm_tile<DT_BF16>;
  t.gemm_tile[DT_Q8_0] = gemm_tile<DT_Q8_0>;
  t.dot_tile[DT_Q4_0] = dot_tile<DT_Q4_0>;
  t.dot_tile[DT_Q4_1] = dot_tile<DT_Q4_1>;
  t.dot_tile[DT_Q5_0] = dot_tile<DT_Q5_0>;
  t.dot_tile[DT_Q5_1] = dot_tile<DT_Q5_1>;
  t.dot_tile[DT_Q8_0] = dot_tile<DT_Q8_0>;
  t.dot_tile[DT_Q4_K] = dot_tile<DT_Q4_K>;
  t.dot_tile[DT_Q5_K] = dot_tile<DT_Q5_K>;
  t.dot_tile[DT_Q6_K] = dot_tile<DT_Q6_K>;
  t.dequant[DT_F32] = dequant_f32;
  t.dequant[DT_F16] = dequant_f16;
  t.dequant[DT_BF16] = dequant_bf16;
  t.dequant[DT_Q4_0] = dequant_q4_0;
  t.dequant[DT_Q4_1] = dequant_q4_1;
  t.dequant[DT_Q5_0] = dequant_q5_0;
  t.dequant[DT_Q5_1] = dequant_q5_1;
  t.dequant[DT_Q8_0] = dequant_q8_0;
  t.dequant[DT_Q4_K] = dequant_q4_K;
  t.dequant[DT_Q5_K] = dequant_q5_K;
  t.dequant[DT_Q6_K] = dequant_q6_K;
  t.axpy[DT_F32] = axpy_f32;
  t.axpy[DT_F16] = axpy_f16;
  t.axpy[DT_BF16] = axpy_bf16;
  t.axpy[DT_Q4_0] = axpy_blocks<DT_Q4_0, QK, 18>;
  t.axpy[DT_Q4_1] = axpy_blocks<DT_Q4_1, QK, 20>;
  t.axpy[DT_Q5_0] = axpy_blocks<DT_Q5_0, QK, 22>;
  t.axpy[DT_Q5_1] = axpy_blocks<DT_Q5_1, QK, 24>;
  t.axpy[DT_Q8_0] = axpy_blocks<DT_Q8_0, QK, 34>;
  t.axpy[DT_Q4_K] = axpy_blocks<DT_Q4_K, QK_K, 144>;
  t.axpy[DT_Q5_K] = axpy_blocks<DT_Q5_K, QK_K, 176>;
  t.axpy[DT_Q6_K] = axpy_blocks<DT_Q6_K, QK_K, 210>;
  t.axpy_rows[DT_F32] = axpy_rows<DT_F32>;
  t.axpy_rows[DT_F16] = axpy_rows<DT_F16>;
  t.axpy_rows[DT_BF16] = axpy_rows<DT_BF16>;
  t.axpy_rows[DT_Q4_0] = axpy_rows<DT_Q4_0>;
  t.axpy_rows[DT_Q4_1] = axpy_rows<DT_Q4_1>;
  t.axpy_rows[DT_Q5_0] = axpy_rows<DT_Q5_0>;
  t.axpy_rows[DT_Q5_1] = axpy_rows<DT_Q5_1>;
  t.axpy_rows[DT_Q8_0] = axpy_rows<DT_Q8_0>;
  t.axpy_rows[DT_Q4_K] = axpy_rows<DT_Q4_K>;
  t.axpy_rows[DT_Q5_K] = axpy_rows<DT_Q5_K>;
  t.axpy_rows[DT_Q6_K] = axpy_rows<DT_Q6_K>;
  t.convert[XF_F32] = convert_f32;
  t.convert[XF_F16] = convert_f16;
  t.convert[XF_BF16] = convert_bf16;
  t.store_f16 = store_f16;
  t.store_bf16 = store_bf16;
  t.convert[XF_Q8_0] = convert_q8<false>;
  t.convert[XF_Q8_1] = convert_q8<true>;
  t.convert[XF_Q8_K] = convert_q8_K;
  t.dot_f32 = dot_f32v;
  t.axpy_f32 = axpy_f32v;
  t.attn_row[0][0] = attn_row_ggml<GgmlScalar, 0, 0>;
  t.attn_row[0][1] = attn_row_ggml<GgmlScalar, 0, 1>;
  t.attn_row[1][0] = attn_row_ggml<GgmlScalar, 1, 0>;
  t.attn_row[1][1] = attn_row_ggml<GgmlScalar, 1, 1>;
  t.attn_rows[0][0] = attn_rows_ggml<GgmlScalar, 0, 0>;
  t.attn_rows[0][1] = attn_rows_ggml<GgmlScalar, 0, 1>;
  t.attn_rows[1][0] = attn_rows_ggml<GgmlScalar, 1, 0>;
  t.attn_rows[1][1] = attn_rows_ggml<GgmlScalar, 1, 1>;
  t.attn_tile[0] = attn_tile_ggml<TiledScalar, 0>;
  t.attn_tile[1] = attn_tile_ggml<TiledScalar, 1>;
  t.sum_f32 = sum_f32;
  return t;
}

}  // namespace

const KernelTable& kernels_scalar() {
  static const KernelTable table = make_table();
  return table;
}

}  // namespace pi
