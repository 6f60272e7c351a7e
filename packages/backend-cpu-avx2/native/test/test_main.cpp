// Kernel-level unit tests of the CPU backend (no Node): run by ctest, built with
// -fsanitize=address,undefined when POWERINFER_SANITIZE=ON (scripts/test-native.mjs).
//
// Covers: F16/BF16 conversions, every weight dtype's dequantize / dot / axpy on the scalar and AVX2
// tables against a double-precision reference, the activation conversions, the thread pool, the
// tensor store (mmap bounds, budget), and the graph executor (ops, determinism, malformed and fuzzed
// graphs must throw BackendErr, never touch memory out of bounds).
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common.h"
#include "executor.h"
#include "kernels.h"
#include "ops.h"
#include "attn_tiled.h"
#include "tensor_store.h"
#include "thread_pool.h"

using namespace pi;

namespace {

int g_failures = 0;
int g_checks = 0;

#define CHECK(cond, ...)                                 \
  do {                                                   \
    g_checks++;                                          \
    if (!(cond)) {                                       \
      g_failures++;                                      \
      std::fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
      std::fprintf(stderr, __VA_ARGS__);                 \
      std::fprintf(stderr, "\n");                        \
    }                                                    \
  } while (0)

std::mt19937 rng(12345);

float uni(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); }
int irand(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); }

const int kWeightTypes[] = {DT_F32, DT_F16, DT_BF16, DT_Q8_0, DT_Q4_0, DT_Q4_1, DT_Q5_0, DT_Q5_1, DT_Q4_K, DT_Q5_K, DT_Q6_K};

void put_half(uint8_t* p, float v) {
  const uint16_t h = f32_to_f16(v);
  std::memcpy(p, &h, 2);
}

/// Random valid bytes of k elements of dtype dt (|w| of order 1).
std::vector<uint8_t> random_row(int dt, int64_t k) {
  std::vector<uint8_t> b(row_bytes(dt, k));
  for (auto& v : b) v = static_cast<uint8_t>(irand(0, 255));
  const Layout l = dtype_layout(dt);
  const int64_t nb = k / l.block;
  for (int64_t i = 0; i < nb; i++) {
    uint8_t* o = b.data() + i * l.bytes;
    switch (dt) {
      case DT_F32:
        for (int j = 0; j < 1; j++) {
          const float f = uni(-1, 1);
          std::memcpy(o, &f, 4);
        }
        break;
      case DT_F16: put_half(o, uni(-1, 1)); break;
      case DT_BF16: {
        const uint16_t h = f32_to_bf16(uni(-1, 1));
        std::memcpy(o, &h, 2);
        break;
      }
      case DT_Q8_0:
        put_half(o, uni(0.004f, 0.012f));
        for (int j = 0; j < 32; j++) o[2 + j] = static_cast<uint8_t>(irand(-127, 127));
        break;
      case DT_Q4_0: put_half(o, uni(-0.15f, 0.15f)); break;
      case DT_Q5_0: put_half(o, uni(-0.07f, 0.07f)); break;
      case DT_Q4_1:
      case DT_Q5_1:
        put_half(o, uni(0.03f, 0.1f));
        put_half(o + 2, uni(-1.2f, 0.2f));
        break;
      case DT_Q4_K:
      case DT_Q5_K:
        put_half(o, uni(0.0004f, 0.002f));
        put_half(o + 2, uni(0.001f, 0.02f));
        break;
      case DT_Q6_K: put_half(o + 208, uni(-0.0005f, 0.0005f)); break;
      default: break;
    }
  }
  return b;
}

/// Dequantized activation (for the reference): the values a kernel multiplies with, plus for
/// Q8_1 the correction s − d·Σq per block (the kernels use the stored s).
std::vector<double> act_values(int fmt, const std::vector<uint8_t>& xc, int64_t k, std::vector<double>* corr) {
  std::vector<double> v(static_cast<size_t>(k));
  switch (fmt) {
    case XF_F32:
    case XF_F16:
    case XF_BF16:
      for (int64_t i = 0; i < k; i++) {
        float f;
        std::memcpy(&f, xc.data() + 4 * i, 4);
        v[i] = f;
        if (fmt == XF_F16) CHECK(f16_to_f32(f32_to_f16(f)) == f, "XF_F16 values are F16-representable");
        if (fmt == XF_BF16) CHECK(bf16_to_f32(f32_to_bf16(f)) == f, "XF_BF16 values are BF16-representable");
      }
      break;
    case XF_Q8_0:
    case XF_Q8_1: {
      const XBlockQ8* b = reinterpret_cast<const XBlockQ8*>(xc.data());
      for (int64_t i = 0; i < k; i++) v[i] = b[i / 32].qs[i % 32] * static_cast<double>(b[i / 32].d);
      corr->assign(static_cast<size_t>(k / 32), 0.0);
      for (int64_t j = 0; j < k / 32; j++) {
        CHECK(f16_to_f32(f32_to_f16(b[j].d)) == b[j].d, "activation scale is F16-representable");
        double s = 0;
        for (int i = 0; i < 32; i++) s += b[j].qs[i];
        if (fmt == XF_Q8_1) {
          (*corr)[j] = b[j].s - s * b[j].d;
          CHECK(f16_to_f32(f32_to_f16(b[j].s)) == b[j].s, "Q8_1 sum is F16-representable");
        } else {
          CHECK(b[j].sum == static_cast<int32_t>(s), "Q8_0 block sum is the integer sum of its bytes");
        }
      }
      break;
    }
    case XF_Q8_K: {
      const BlockQ8_K* b = reinterpret_cast<const BlockQ8_K*>(xc.data());
      for (int64_t i = 0; i < k; i++) v[i] = b[i / 256].qs[i % 256] * static_cast<double>(b[i / 256].d);
      for (int64_t j = 0; j < k / 256; j++) {
        for (int g = 0; g < 16; g++) {
          int s = 0;
          for (int i = 0; i < 16; i++) s += b[j].qs[16 * g + i];
          CHECK(s == b[j].bsums[g], "q8_K bsums");
        }
      }
      break;
    }
    default: break;
  }
  return v;
}

double block_offset(int dt, const uint8_t* row, int64_t j) {
  if (dt != DT_Q4_1 && dt != DT_Q5_1) return 0.0;
  return f16_to_f32(load_u16(row + j * dtype_layout(dt).bytes + 2));
}

void test_conversions() {
  // every half: exact decode, re-encode round-trips (NaN stays NaN)
  for (uint32_t h = 0; h < 65536; h++) {
    const float f = f16_to_f32(static_cast<uint16_t>(h));
    const uint16_t back = f32_to_f16(f);
    if (std::isnan(f)) {
      CHECK((back & 0x7c00) == 0x7c00 && (back & 0x3ff) != 0, "nan %04x", h);
    } else {
      CHECK(back == h, "half round trip %04x -> %g -> %04x", h, static_cast<double>(f), back);
    }
  }
  // rounding: ties to even at a few hand-picked points
  CHECK(f32_to_f16(1.0f + 1.0f / 2048) == 0x3c00, "tie to even (down)");
  CHECK(f32_to_f16(1.0f + 3.0f / 2048) == 0x3c02, "tie to even (up)");
  CHECK(f32_to_f16(65519.0f) == 0x7bff, "65519 -> 65504");
  CHECK(f32_to_f16(65520.0f) == 0x7c00, "65520 -> inf");
  CHECK(f32_to_f16(5.9604645e-8f) == 0x0001, "smallest subnormal");
  CHECK(f32_to_bf16(1.00390625f) == 0x3f80, "bf16 tie to even");
  CHECK(bf16_to_f32(f32_to_bf16(-2.5f)) == -2.5f, "bf16 exact");
  // the AVX2 conversions agree bit for bit with the scalar ones
  const CpuFeatures f = cpu_features();
  if (f.avx2 && f.fma && f.f16c) {
    const KernelTable& s = kernels_scalar();
    const KernelTable& a = kernels_avx2();
    for (int fmt = 0; fmt < XF_COUNT; fmt++) {
      const int64_t k = 512;
      std::vector<float> x(k);
      for (auto& v : x) v = uni(-3, 3) * (irand(0, 9) == 0 ? 1e-6f : 1.0f);
      x[5] = 0;
      std::vector<uint8_t> xs(x_row_bytes(fmt, k)), xa(x_row_bytes(fmt, k));
      s.convert[fmt](x.data(), xs.data(), k);
      a.convert[fmt](x.data(), xa.data(), k);
      CHECK(xs == xa, "convert fmt %d scalar != avx2", fmt);
    }
  }
}

void test_dtype_kernels(const KernelTable& kt) {
  for (int dt : kWeightTypes) {
    const int block = dtype_layout(dt).block;
    const int64_t k = block == 1 ? 173 : (block == 32 ? 32 * 7 : 256 * 3);
    const std::vector<uint8_t> w = random_row(dt, k);
    std::vector<float> wd(k);
    kt.dequant[dt](w.data(), wd.data(), k);
    std::vector<float> wref(k);
    kernels_scalar().dequant[dt](w.data(), wref.data(), k);
    CHECK(wd == wref, "%s %s dequant differs from scalar", kt.name, dtype_name(dt));
    std::vector<float> x(k);
    for (auto& v : x) v = uni(-2, 2);
    const int fmt = x_format(dt);
    std::vector<uint8_t> xc(x_row_bytes(fmt, k));
    kt.convert[fmt](x.data(), xc.data(), k);
    std::vector<double> corr;
    const std::vector<double> xv = act_values(fmt, xc, k, &corr);
    double ref = 0, scale = 0;
    for (int64_t i = 0; i < k; i++) {
      ref += static_cast<double>(wd[i]) * xv[i];
      scale += (std::fabs(wd[i]) + 2 * std::fabs(block_offset(dt, w.data(), i / 32))) * std::fabs(xv[i]);
    }
    for (size_t j = 0; j < corr.size(); j++) ref += block_offset(dt, w.data(), static_cast<int64_t>(j)) * corr[j];
    const float got = kt.dot[dt](k, w.data(), xc.data());
    CHECK(std::fabs(got - ref) <= 4 * (std::sqrt(static_cast<double>(k)) + 8) * 0x1p-24 * scale + 1e-30,
          "%s %s dot %g vs %g", kt.name, dtype_name(dt), static_cast<double>(got), ref);
    // dot_tile (2 rows × 2 columns and the partial shapes) equals dot, bit for bit
    {
      const std::vector<uint8_t> w2 = random_row(dt, k);
      std::vector<float> x2f(k);
      for (auto& v : x2f) v = uni(-2, 2);
      std::vector<uint8_t> x2(x_row_bytes(fmt, k));
      kt.convert[fmt](x2f.data(), x2.data(), k);
      const uint8_t* ws[2] = {w.data(), w2.data()};
      const uint8_t* xs[2] = {xc.data(), x2.data()};
      for (int nr = 1; nr <= 2; nr++) {
        for (int nc = 1; nc <= 2; nc++) {
          float out[4];
          kt.dot_tile[dt](k, nr, nc, ws, xs, out);
          for (int r = 0; r < nr; r++) {
            for (int c = 0; c < nc; c++) {
              CHECK(out[r * nc + c] == kt.dot[dt](k, ws[r], xs[c]), "%s %s dot_tile %dx%d", kt.name, dtype_name(dt), nr, nc);
            }
          }
        }
      }
      // matrix × vector tiles: 3 and 4 rows against one activation row
      const std::vector<uint8_t> w3 = random_row(dt, k), w4 = random_row(dt, k);
      const uint8_t* w4s[4] = {w.data(), w2.data(), w3.data(), w4.data()};
      for (int nr = 3; nr <= 4; nr++) {
        float out[4];
        kt.dot_tile[dt](k, nr, 1, w4s, xs, out);
        for (int r = 0; r < nr; r++) {
          CHECK(out[r] == kt.dot[dt](k, w4s[r], xs[0]), "%s %s dot_tile %dx1 row %d", kt.name, dtype_name(dt), nr, r);
        }
      }
      // one row against 3 and 4 activation rows (a sparse row in a batch)
      std::vector<std::vector<uint8_t>> x4;
      for (int c = 0; c < 4; c++) {
        std::vector<float> xf(k);
        for (auto& v : xf) v = uni(-2, 2);
        x4.emplace_back(x_row_bytes(fmt, k));
        kt.convert[fmt](xf.data(), x4.back().data(), k);
      }
      const uint8_t* x4s[4] = {x4[0].data(), x4[1].data(), x4[2].data(), x4[3].data()};
      for (int nc = 3; nc <= 4; nc++) {
        float out[4];
        kt.dot_tile[dt](k, 1, nc, w4s + 1, x4s, out);
        for (int c = 0; c < nc; c++) {
          CHECK(out[c] == kt.dot[dt](k, w4s[1], x4s[c]), "%s %s dot_tile 1x%d column %d", kt.name, dtype_name(dt), nc, c);
        }
      }
    }
    // axpy_rows over up to 4 rows equals successive axpy calls, bit for bit
    for (int nr = 1; nr <= 4; nr++) {
      std::vector<std::vector<uint8_t>> rows;
      std::vector<const uint8_t*> ptrs;
      std::vector<float> as;
      for (int r = 0; r < nr; r++) rows.push_back(random_row(dt, k));
      for (int r = 0; r < nr; r++) {
        ptrs.push_back(rows[static_cast<size_t>(r)].data());
        as.push_back(uni(-2, 2));
      }
      std::vector<float> y1(k), y2(k);
      for (int64_t i = 0; i < k; i++) y1[i] = y2[i] = uni(-1, 1);
      for (int r = 0; r < nr; r++) kt.axpy[dt](k, as[static_cast<size_t>(r)], ptrs[static_cast<size_t>(r)], y1.data());
      kt.axpy_rows[dt](k, nr, as.data(), ptrs.data(), y2.data());
      CHECK(y1 == y2, "%s %s axpy_rows(%d) differs from axpy", kt.name, dtype_name(dt), nr);
    }
    // the forms that also fetch the next rows of a sparse op give the same values: dot_rows8_next equals
    // dot per row, axpy_rows_next successive axpy calls, bit for bit, with next rows and without
    if (kt.dot_rows8_next[dt] || kt.axpy_rows_next[dt]) {
      std::vector<std::vector<uint8_t>> rows;
      for (int r = 0; r < 16; r++) rows.push_back(random_row(dt, k));
      const uint8_t* w8[8];
      const uint8_t* n8[8];
      for (int r = 0; r < 8; r++) {
        w8[r] = rows[static_cast<size_t>(r)].data();
        n8[r] = rows[static_cast<size_t>(8 + r % 3)].data();  // repeats allowed
      }
      if (kt.dot_rows8_next[dt]) {
        CHECK(kt.tile_rows[dt] == 8, "%s %s dot_rows8_next without 8-row tiles", kt.name, dtype_name(dt));
        for (int with = 0; with < 2; with++) {
          float out[8];
          kt.dot_rows8_next[dt](k, w8, xc.data(), out, with ? n8 : nullptr);
          for (int r = 0; r < 8; r++) {
            CHECK(out[r] == kt.dot[dt](k, w8[r], xc.data()), "%s %s dot_rows8_next row %d (next %d)", kt.name, dtype_name(dt), r, with);
          }
        }
      }
      if (kt.axpy_rows_next[dt]) {
        const float as[4] = {uni(-2, 2), uni(-2, 2), 0.0f, uni(-2, 2)};
        for (int with = 0; with < 2; with++) {
          std::vector<float> y1(k), y2(k);
          for (int64_t i = 0; i < k; i++) y1[i] = y2[i] = uni(-1, 1);
          for (int r = 0; r < 4; r++) kt.axpy[dt](k, as[r], w8[r], y1.data());
          kt.axpy_rows_next[dt](k, as, w8, y2.data(), with ? n8 : nullptr);
          CHECK(y1 == y2, "%s %s axpy_rows_next differs from axpy (next %d)", kt.name, dtype_name(dt), with);
        }
      }
    }
    // axpy_gather over slices of 5 rows of 256 (the slice layouts of ops.cpp axpy_batch; the entries in a
    // scrambled order, one row twice) equals successive axpy calls on a zeroed y, bit for bit
    {
      const int sk = (dt == DT_Q4_0 || dt == DT_Q8_0) ? SK_I8 : dt == DT_F16 ? SK_F16 : SK_F32;
      if (kt.axpy_gather[sk] && (sk != SK_I8 || kt.slice_i8[dt])) {
        const int64_t kk = 256, width = block > 64 ? block : 64;
        const int64_t stride = sk == SK_I8 ? 72 : sk == SK_F16 ? 128 : 4 * width;
        const int64_t esz = sk == SK_I8 ? 1 : sk == SK_F16 ? 2 : 4;
        std::vector<std::vector<uint8_t>> rows;
        for (int r = 0; r < 5; r++) rows.push_back(random_row(dt, kk));
        const int32_t idx[6] = {3, 0, 4, 1, 3, 2};
        const float as[6] = {uni(-2, 2), uni(-2, 2), 0.0f, uni(-2, 2), uni(-2, 2), -1.5f};
        std::vector<float> y1(kk, 0.0f), y2(kk, -7.0f);
        for (int j = 0; j < 6; j++) kt.axpy[dt](kk, as[j], rows[static_cast<size_t>(idx[j])].data(), y1.data());
        std::vector<uint8_t> slices(static_cast<size_t>(5 * stride));
        for (int64_t ec = 0; ec < kk; ec += width) {
          for (int r = 0; r < 5; r++) {
            const uint8_t* w = rows[static_cast<size_t>(r)].data() + row_bytes(dt, ec);
            uint8_t* sl = slices.data() + r * stride;
            if (sk == SK_I8) {
              kt.slice_i8[dt](w, sl);
            } else if (sk == SK_F16 || dt == DT_F32) {
              std::memcpy(sl, w, static_cast<size_t>(stride));
            } else {
              kt.dequant[dt](w, reinterpret_cast<float*>(sl), width);
            }
          }
          for (int64_t sub = 0; sub < width; sub += 64) {
            kt.axpy_gather[sk](6, idx, as, slices.data() + sub * esz, stride, y2.data() + ec + sub);
          }
        }
        CHECK(y1 == y2, "%s %s axpy_gather differs from axpy", kt.name, dtype_name(dt));
        kt.axpy_gather[sk](0, idx, as, slices.data(), stride, y2.data());
        CHECK(std::all_of(y2.begin(), y2.begin() + 64, [](float v) { return v == 0.0f && !std::signbit(v); }),
              "%s %s axpy_gather of no entries stores +0", kt.name, dtype_name(dt));
      }
    }
    // axpy: y += a·w
    std::vector<float> y(k), y0(k);
    for (int64_t i = 0; i < k; i++) y[i] = y0[i] = uni(-1, 1);
    const float a = uni(-2, 2);
    kt.axpy[dt](k, a, w.data(), y.data());
    for (int64_t i = 0; i < k; i++) {
      const double e = y0[i] + static_cast<double>(a) * wd[i];
      CHECK(std::fabs(y[i] - e) <= 4e-7 * (std::fabs(y0[i]) + std::fabs(a * wd[i]) + 2 * std::fabs(a * block_offset(dt, w.data(), i / 32))) + 1e-30,
            "%s %s axpy[%ld] %g vs %g", kt.name, dtype_name(dt), static_cast<long>(i), static_cast<double>(y[i]), e);
    }
    // axpy_sparse dequantizes a row once for a batch's columns (ops.cpp axpy_dequantizes): for every dtype
    // but F32, Q4_0 and Q8_0, dequant then axpy_f32 equals the row's axpy bit for bit
    if (dt != DT_F32 && dt != DT_Q4_0 && dt != DT_Q8_0) {
      std::vector<float> y2(y0);
      std::vector<float> tmp(k);
      std::copy(y0.begin(), y0.end(), y.begin());
      kt.axpy[dt](k, a, w.data(), y.data());
      kt.dequant[dt](w.data(), tmp.data(), k);
      kt.axpy_f32(k, a, tmp.data(), y2.data());
      CHECK(y == y2, "%s %s dequant + axpy_f32 differs from axpy", kt.name, dtype_name(dt));
    }
  }
}

/// gemm_tile (llama.cpp's prompt GEMM arithmetic): every shape up to 9 rows × 25 columns (the 4 × 3,
/// 4 × 6 and 4 × 12 register tiles, their edges — odd column counts included — and shapes cut into several
/// tiles) gives, bit for bit, the 1 × 1 tile's value and the scalar mirror's, for F32/F16/BF16/Q8_0 weights
/// (Q8_0 bytes include −128).
void test_gemm_tiles() {
  constexpr int NCOL = 25;
  const CpuFeatures f = cpu_features();
  const KernelTable& s = kernels_scalar();
  const bool avx = f.avx2 && f.fma && f.f16c;
  const KernelTable& a = avx ? kernels_avx2() : s;
  std::vector<const KernelTable*> tabs{&a, &s};  // the VNNI build tiles 4 × 6 (Q8_0) and 4 × 12 (floats)
#if defined(PI_HAVE_VNNI_KERNELS)
  if (avx && f.avx512vnni) tabs.push_back(&kernels_avx2_vnni());
#endif
  for (int dt : {DT_F32, DT_F16, DT_BF16, DT_Q8_0}) {
    CHECK(s.gemm_tile[dt] != nullptr && a.gemm_tile[dt] != nullptr, "%s gemm_tile missing", dtype_name(dt));
    if (!s.gemm_tile[dt] || !a.gemm_tile[dt]) continue;
    const std::vector<int64_t> ks = dt == DT_Q8_0 ? std::vector<int64_t>{32, 160, 4096} : std::vector<int64_t>{8, 40, 264, 4096};
    for (int64_t k : ks) {
      const int fmt = x_format(dt);
      std::vector<std::vector<uint8_t>> wr, xr;
      for (int r = 0; r < 9; r++) {
        wr.push_back(random_row(dt, k));
        if (dt == DT_Q8_0 && r % 3 == 0) {
          for (int64_t i = 0; i < k / QK; i++) wr.back()[static_cast<size_t>(i * 34 + 2 + (r + i) % 32)] = 0x80;
        }
      }
      for (int c = 0; c < NCOL; c++) {
        std::vector<float> xf(k);
        for (auto& v : xf) v = uni(-2, 2) * (irand(0, 7) == 0 ? 100.0f : 1.0f);
        xr.emplace_back(x_row_bytes(fmt, k));
        a.convert[fmt](xf.data(), xr.back().data(), k);
      }
      const uint8_t* w[9];
      const uint8_t* x[NCOL];
      for (int r = 0; r < 9; r++) w[r] = wr[static_cast<size_t>(r)].data();
      for (int c = 0; c < NCOL; c++) x[c] = xr[static_cast<size_t>(c)].data();
      float one[9][NCOL], ref[9][NCOL];
      for (int r = 0; r < 9; r++) {
        for (int c = 0; c < NCOL; c++) {
          a.gemm_tile[dt](k, 1, 1, w + r, x + c, &one[r][c]);
          s.gemm_tile[dt](k, 1, 1, w + r, x + c, &ref[r][c]);
          CHECK(std::memcmp(&one[r][c], &ref[r][c], 4) == 0, "%s gemm_tile k=%ld (%d,%d): %s %.9g vs scalar %.9g",
                dtype_name(dt), static_cast<long>(k), r, c, a.name, static_cast<double>(one[r][c]), static_cast<double>(ref[r][c]));
        }
      }
      // where a table says its gemm_tile is its dot (gemm_is_dot), every output agrees bit for bit
      for (const KernelTable* kt : tabs) {
        if (!kt->gemm_is_dot[dt]) continue;
        int bad = 0;
        for (int r = 0; r < 9; r++) {
          for (int c = 0; c < NCOL; c++) {
            const float d = kt->dot[dt](k, w[r], x[c]);
            bad += std::memcmp(&d, &ref[r][c], 4) != 0;
          }
        }
        CHECK(bad == 0, "%s %s gemm_is_dot k=%ld: %d outputs of dot differ from gemm_tile", kt->name, dtype_name(dt),
              static_cast<long>(k), bad);
      }
      for (int nr = 1; nr <= 9; nr++) {
        for (int nc = 1; nc <= NCOL; nc++) {
          for (int r0 : {0, 9 - nr}) {
            float out[9 * NCOL];
            for (const KernelTable* kt : tabs) {
              kt->gemm_tile[dt](k, nr, nc, w + r0, x + NCOL - nc, out);
              int bad = 0;
              for (int r = 0; r < nr; r++) {
                for (int c = 0; c < nc; c++) bad += std::memcmp(&out[r * nc + c], &ref[r0 + r][NCOL - nc + c], 4) != 0;
              }
              CHECK(bad == 0, "%s %s gemm_tile k=%ld %dx%d: %d outputs differ from the 1x1 tile", kt->name, dtype_name(dt),
                    static_cast<long>(k), nr, nc, bad);
            }
          }
        }
      }
      // gemm_tile_pairs (the activations interleaved by column pairs; an odd count's last pair holds its
      // column twice, as the driver packs it): every shape up to 4 × 12 equals the 1 × 1 tile bit for bit
      for (const KernelTable* kt : tabs) {
        if (dt == DT_Q8_0 || !kt->gemm_tile_pairs[dt]) continue;
        for (int nc = 1; nc <= 12; nc++) {
          const int c0 = NCOL - nc;
          std::vector<std::vector<float>> pr;
          for (int p = 0; p < (nc + 1) / 2; p++) {
            pr.emplace_back(static_cast<size_t>(2 * k));
            for (int h = 0; h < 2; h++) {
              const int c = 2 * p + h < nc ? 2 * p + h : nc - 1;
              const float* xf = reinterpret_cast<const float*>(x[c0 + c]);
              for (int64_t i = 0; i < k; i += 8) std::memcpy(&pr.back()[static_cast<size_t>(2 * i + 8 * h)], xf + i, 32);
            }
          }
          const uint8_t* xp[6];
          for (int p = 0; p < (nc + 1) / 2; p++) xp[p] = reinterpret_cast<const uint8_t*>(pr[static_cast<size_t>(p)].data());
          for (int nr = 1; nr <= 4; nr++) {
            float out[4 * 12];
            kt->gemm_tile_pairs[dt](k, nr, nc, w + 9 - nr, xp, out);
            int bad = 0;
            for (int r = 0; r < nr; r++) {
              for (int c = 0; c < nc; c++) bad += std::memcmp(&out[r * nc + c], &ref[9 - nr + r][c0 + c], 4) != 0;
            }
            CHECK(bad == 0, "%s %s gemm_tile_pairs k=%ld %dx%d: %d outputs differ from the 1x1 tile", kt->name,
                  dtype_name(dt), static_cast<long>(k), nr, nc, bad);
          }
        }
      }
    }
  }
}

/// Repacked layouts (Q4_0: BlockQ4_0x8, Q4_K: BlockQ4_Kx8). Every table's dot equals the scalar mirror
/// bit for bit (Q4_0: llama.cpp's repacked q4_0_8x8 arithmetic; Q4_K: exact integer super-block sums, one
/// unfused float step per super-block); its tiles (1–4 rows × 1–4 columns) equal the dot; and the repacked
/// layout (TensorStore::packed, 8 rows × 1–6 columns, 1–4 groups) gives every row the unpacked value,
/// including nibbles 0 and 15 (with the largest 6-bit scales and mins) against activations of ±127 and −128.
void test_repack() {
  const CpuFeatures f = cpu_features();
  const KernelTable& s = kernels_scalar();
  const bool avx = f.avx2 && f.fma && f.f16c;
  std::vector<const KernelTable*> tables{&s};
  if (avx) tables.push_back(&kernels_avx2());
#if defined(PI_HAVE_VNNI_KERNELS)
  if (avx && f.avx512vnni) tables.push_back(&kernels_avx2_vnni());
#endif
  for (int dt : {DT_Q4_0, DT_Q4_K}) {
    const bool kq = dt == DT_Q4_K;
    const int fmt = x_format(dt);
    const char* name = dtype_name(dt);
    const int bsz = kq ? 144 : 18, qoff = kq ? 16 : 2, qlen = kq ? 128 : 16;
    const std::vector<int64_t> ks = kq ? std::vector<int64_t>{256, 768, 4096, 11008} : std::vector<int64_t>{32, 96, 4096, 11008};
    for (int64_t k : ks) {
      const int64_t rows = 32, nblk = k / (kq ? QK_K : QK);
      TensorStore store(SIZE_MAX);
      const int64_t ne[4] = {k, rows, 1, 1};
      TensorPtr t = store.create(dt, ne);
      const size_t rb = row_bytes(dt, k);
      for (int64_t r = 0; r < rows; r++) {
        std::vector<uint8_t> w = random_row(dt, k);
        for (int64_t i = 0; i < nblk && (r == 3 || r == 4); i++) {
          std::memset(w.data() + i * bsz + qoff, r == 3 ? 0x00 : 0xFF, static_cast<size_t>(qlen));
          if (kq && r == 4) std::memset(w.data() + i * bsz + 4, 0xFF, 12);  // every scale and min 63
        }
        std::memcpy(t->data + r * rb, w.data(), rb);
      }
      std::vector<std::vector<uint8_t>> xs;
      for (int c = 0; c < 6; c++) {
        std::vector<float> xf(k);
        for (int64_t i = 0; i < k; i++) {
          xf[i] = c == 5 ? (kq ? -3.0f : (i % 2 ? -1.0f : 1.0f) * 3) : uni(-2, 2) * (irand(0, 7) == 0 ? 100.0f : 1.0f);
        }
        xs.emplace_back(x_row_bytes(fmt, k));
        s.convert[fmt](xf.data(), xs.back().data(), k);
      }
      const uint8_t* x[6];
      for (int c = 0; c < 6; c++) x[c] = xs[static_cast<size_t>(c)].data();
      const uint8_t* packed = store.packed(t);
      const size_t gbytes = packed_group_bytes(dt, k);
      CHECK(packed != nullptr && t->packed_bytes == gbytes * static_cast<size_t>(rows / 8) &&
                store.allocated() == t->bytes + t->packed_bytes,
            "%s k=%ld: packed copy made and counted", name, static_cast<long>(k));
      if (!packed) continue;
      for (int64_t r = 0; r < rows; r++) {
        for (int c = 0; c < 6; c++) {
          const float ref = s.dot[dt](k, t->data + r * rb, x[c]);
          for (const KernelTable* kt : tables) {
            const float got = kt->dot[dt](k, t->data + r * rb, x[c]);
            CHECK(std::memcmp(&got, &ref, 4) == 0, "%s %s dot k=%ld row %ld col %d: %.9g vs scalar %.9g", kt->name, name,
                  static_cast<long>(k), static_cast<long>(r), c, static_cast<double>(got), static_cast<double>(ref));
          }
        }
      }
      for (const KernelTable* kt : tables) {
        CHECK(kt->packed_tile[dt] != nullptr, "%s: packed_tile[%s]", kt->name, name);
        if (!kt->packed_tile[dt]) continue;
        for (int ng : {1, 2, 3, 4}) {
          for (int nc = 1; nc <= 6; nc++) {
            for (int64_t g0 = 0; g0 + ng <= rows / 8; g0++) {
              float out[192];
              kt->packed_tile[dt](k, ng, nc, packed + g0 * gbytes, x + 6 - nc, out);
              int bad = 0;
              for (int g = 0; g < ng; g++) {
                for (int c = 0; c < nc; c++) {
                  for (int r = 0; r < 8; r++) {
                    const float ref = s.dot[dt](k, t->data + ((g0 + g) * 8 + r) * rb, x[6 - nc + c]);
                    bad += std::memcmp(&out[8 * (g * nc + c) + r], &ref, 4) != 0;
                  }
                }
              }
              CHECK(bad == 0, "%s %s packed_tile k=%ld ng=%d nc=%d group %ld: %d of %d outputs differ from the unpacked dot",
                    kt->name, name, static_cast<long>(k), ng, nc, static_cast<long>(g0), bad, 8 * ng * nc);
            }
          }
        }
        // up to tile_rows scattered rows against one column (Q4_0: the 8-row transposing kernel)
        const uint8_t* w[8];
        for (int nr = 1; nr <= 8; nr++) {
          for (int nc = 1; nc <= 4; nc++) {
            if (nr > 4 && (nc > 1 || nr > kt->tile_rows[dt])) continue;
            for (int r = 0; r < nr; r++) w[r] = t->data + ((2 + 5 * r) % rows) * rb;
            float out[16];
            kt->dot_tile[dt](k, nr, nc, w, x + 2, out);
            int bad = 0;
            for (int r = 0; r < nr; r++) {
              for (int c = 0; c < nc; c++) {
                const float ref = s.dot[dt](k, w[r], x[2 + c]);
                bad += std::memcmp(&out[r * nc + c], &ref, 4) != 0;
              }
            }
            CHECK(bad == 0, "%s %s dot_tile k=%ld %dx%d: %d outputs differ", kt->name, name, static_cast<long>(k), nr, nc, bad);
          }
        }
      }
      // a write drops the copy (and its bytes); an odd row count or a budget without room gives none
      store.drop_packed(*t);
      CHECK(t->packed == nullptr && t->packed_bytes == 0 && store.allocated() == t->bytes, "%s: drop_packed frees the copy", name);
      const int64_t ne7[4] = {k, 7, 1, 1};
      CHECK(store.packed(store.create(dt, ne7)) == nullptr, "%s 7 rows: not packed", name);
      TensorStore tight(t->bytes + 64);
      TensorPtr t2 = tight.create(dt, ne);
      CHECK(tight.packed(t2) == nullptr && t2->pack_refused && tight.allocated() == t2->bytes,
            "%s: no budget for the copy: refused, nothing counted", name);
    }
  }
  // dtypes without a repacked layout are left alone
  TensorStore store(SIZE_MAX);
  const int64_t ne[4] = {256, 8, 1, 1};
  CHECK(store.packed(store.create(DT_Q8_0, ne)) == nullptr, "Q8_0: no repacked layout");
  CHECK(kernels_scalar().packed_tile[DT_Q8_0] == nullptr, "Q8_0: no packed tile");
}

/// The VNNI build of the AVX2 table gives every dot, tile, GEMM tile and repacked tile the AVX2 table's
/// value bit for bit (integer sums are the same; float operations are the same), for every weight dtype.
void test_vnni_equals_avx2() {
#if defined(PI_HAVE_VNNI_KERNELS)
  const CpuFeatures f = cpu_features();
  if (!(f.avx2 && f.fma && f.f16c && f.avx512vnni)) {
    std::printf("vnni: skipped (CPU lacks AVX512-VNNI/VL)\n");
    return;
  }
  const KernelTable& a = kernels_avx2();
  const KernelTable& v = kernels_avx2_vnni();
  for (int dt : kWeightTypes) {
    const int block = dtype_layout(dt).block;
    for (int64_t k : {block == 1 ? int64_t{264} : int64_t{block * 8}, int64_t{4096}}) {
      const int fmt = x_format(dt);
      std::vector<std::vector<uint8_t>> wr, xr;
      for (int r = 0; r < 4; r++) {
        wr.push_back(random_row(dt, k));
        if (dt == DT_Q8_0 && r == 1) {
          for (int64_t i = 0; i < k / QK; i++) wr.back()[static_cast<size_t>(i * 34 + 2 + i % 32)] = 0x80;
        }
      }
      for (int c = 0; c < 4; c++) {
        std::vector<float> xf(k);
        for (auto& x : xf) x = uni(-2, 2) * (irand(0, 7) == 0 ? 100.0f : 1.0f);
        xr.emplace_back(x_row_bytes(fmt, k));
        a.convert[fmt](xf.data(), xr.back().data(), k);
      }
      const uint8_t* w[4] = {wr[0].data(), wr[1].data(), wr[2].data(), wr[3].data()};
      const uint8_t* x[4] = {xr[0].data(), xr[1].data(), xr[2].data(), xr[3].data()};
      int bad = 0;
      for (int r = 0; r < 4; r++) {
        for (int c = 0; c < 4; c++) {
          const float p = a.dot[dt](k, w[r], x[c]), q = v.dot[dt](k, w[r], x[c]);
          bad += std::memcmp(&p, &q, 4) != 0;
        }
      }
      for (const auto& [nr, nc] : {std::pair<int, int>{4, 1}, {2, 2}, {1, 4}}) {
        float p[16], q[16];
        a.dot_tile[dt](k, nr, nc, w, x, p);
        v.dot_tile[dt](k, nr, nc, w, x, q);
        bad += std::memcmp(p, q, sizeof(float) * static_cast<size_t>(nr * nc)) != 0;
        if (a.gemm_tile[dt] && k % 8 == 0) {
          a.gemm_tile[dt](k, nr, nc, w, x, p);
          v.gemm_tile[dt](k, nr, nc, w, x, q);
          bad += std::memcmp(p, q, sizeof(float) * static_cast<size_t>(nr * nc)) != 0;
        }
      }
      CHECK(bad == 0, "vnni %s k=%ld: %d results differ from the avx2 table", dtype_name(dt), static_cast<long>(k), bad);
    }
  }
  CHECK(std::strcmp(v.name, "avx2+avx512vnni") == 0, "vnni table name %s", v.name);
#endif
}

/// attn_row against a float64 softmax(scale·qᵀk)·V of the same (rounded) q, K, V, every K/V type pair and
/// head sizes below, at and above ggml's 32-element step; with `other` the same row must come out
/// bit-identical (the scalar table emulates the AVX2 lanes).
void test_attention_kernels(const KernelTable& kt, const KernelTable* other) {
  for (int ki = 0; ki < 2; ki++) {
    for (int vi = 0; vi < 2; vi++) {
      for (int64_t hd : {8, 37, 64, 128}) {
        for (int64_t n : {1, 2, 23}) {
          const int64_t stride_el = hd * 3;  // rows of a [3 heads · hd, n] cache
          const size_t kes = ki ? 2 : 4, ves = vi ? 2 : 4;
          std::vector<uint8_t> kc(static_cast<size_t>(n * stride_el) * kes), vc(static_cast<size_t>(n * stride_el) * ves);
          std::vector<double> kd(static_cast<size_t>(n * hd)), vd(static_cast<size_t>(n * hd));
          for (int64_t i = 0; i < n * stride_el; i++) {
            for (int which = 0; which < 2; which++) {
              const bool half = which ? vi : ki;
              uint8_t* dst = (which ? vc.data() : kc.data()) + i * (half ? 2 : 4);
              float f = uni(-1, 1);
              if (half) {
                const uint16_t h = f32_to_f16(f);
                std::memcpy(dst, &h, 2);
                f = f16_to_f32(h);
              } else {
                std::memcpy(dst, &f, 4);
              }
              const int64_t j = i / stride_el, c = i % stride_el - hd;  // head 1
              if (c >= 0 && c < hd) (which ? vd : kd)[static_cast<size_t>(j * hd + c)] = f;
            }
          }
          std::vector<float> q(hd), qc(hd), out(hd), out2(hd), acc(hd);
          for (auto& v : q) v = uni(-2, 2);
          kt.convert[ki ? XF_F16 : XF_F32](q.data(), qc.data(), hd);
          const float scale = 0.3f;
          kt.attn_row[ki][vi](hd, qc.data(), kc.data() + hd * kes, stride_el * kes, vc.data() + hd * ves, stride_el * ves, n,
                              scale, out.data(), acc.data());
          std::vector<double> sc(static_cast<size_t>(n)), ref(static_cast<size_t>(hd), 0.0);
          double mx = -INFINITY, sum = 0;
          for (int64_t j = 0; j < n; j++) {
            double d = 0;
            for (int64_t c = 0; c < hd; c++) d += kd[static_cast<size_t>(j * hd + c)] * qc[static_cast<size_t>(c)];
            sc[static_cast<size_t>(j)] = d * scale;
            mx = std::fmax(mx, d * scale);
          }
          for (int64_t j = 0; j < n; j++) {
            const double e = std::exp(sc[static_cast<size_t>(j)] - mx);
            sum += e;
            for (int64_t c = 0; c < hd; c++) ref[static_cast<size_t>(c)] += e * vd[static_cast<size_t>(j * hd + c)];
          }
          // F16 accumulator: one F16 rounding (2^-11 relative) per key on the running sum, bounded by Σ|v|
          const double eps = vi ? std::ldexp(1.0, -11) * static_cast<double>(n + 1) : 1e-5;
          for (int64_t c = 0; c < hd; c++) {
            double bound = 0;
            for (int64_t j = 0; j < n; j++) bound += std::exp(sc[static_cast<size_t>(j)] - mx) * std::fabs(vd[static_cast<size_t>(j * hd + c)]);
            const double e = ref[static_cast<size_t>(c)] / sum;
            CHECK(std::fabs(out[static_cast<size_t>(c)] - e) <= eps * bound / sum + 1e-6, "%s attn_row[%d][%d] hd %ld n %ld: %g vs %g",
                  kt.name, ki, vi, static_cast<long>(hd), static_cast<long>(n), static_cast<double>(out[static_cast<size_t>(c)]), e);
          }
          if (other) {
            other->attn_row[ki][vi](hd, qc.data(), kc.data() + hd * kes, stride_el * kes, vc.data() + hd * ves, stride_el * ves,
                                    n, scale, out2.data(), acc.data());
            CHECK(std::memcmp(out.data(), out2.data(), out.size() * 4) == 0, "%s vs %s attn_row[%d][%d] hd %ld n %ld not bit-identical",
                  kt.name, other->name, ki, vi, static_cast<long>(hd), static_cast<long>(n));
          }
        }
      }
    }
  }
}

/// attn_tile (llama.cpp's tiled flash-attention arithmetic) against a float64 softmax(scale·qᵀk)·V, F32 and
/// F16 K/V, causal rows after 0, 70 and 130 cached keys (partial and whole key tiles), without and with a
/// 50-key sliding window; each row must also come
/// out bit-identical when computed alone (a row's values do not depend on its tile) and, with `other`, to
/// the other table's.
void test_attention_tile(const KernelTable& kt, const KernelTable* other) {
  for (int kv = 0; kv < 2; kv++) {
    for (int64_t hd : {8, 64, 128}) {
      for (int64_t n_past : {0, 70, 130}) {
        for (int nr : {1, 5, 64}) {
          for (int64_t window : {0, 50}) {
            const int64_t nkeys = n_past + nr;
            const int64_t stride_el = hd * 2;  // rows of a [2 heads · hd, nkeys] cache; head 1 used
            const size_t es = kv ? 2 : 4;
            std::vector<uint8_t> kc(static_cast<size_t>(nkeys * stride_el) * es), vc(kc.size());
            std::vector<double> kd(static_cast<size_t>(nkeys * hd)), vd(kd.size());
            for (int64_t i = 0; i < nkeys * stride_el; i++) {
              for (int which = 0; which < 2; which++) {
                uint8_t* dst = (which ? vc.data() : kc.data()) + i * es;
                float f = uni(-1, 1);
                if (kv) {
                  const uint16_t h = f32_to_f16(f);
                  std::memcpy(dst, &h, 2);
                  f = f16_to_f32(h);
                } else {
                  std::memcpy(dst, &f, 4);
                }
                const int64_t j = i / stride_el, c = i % stride_el - hd;
                if (c >= 0) (which ? vd : kd)[static_cast<size_t>(j * hd + c)] = f;
              }
            }
            std::vector<float> q(static_cast<size_t>(nr * hd)), out(q.size()), out1(q.size()), out2(q.size());
            for (auto& v : q) v = uni(-2, 2);
            std::vector<float> scratch(attn_tile_floats(hd));
            const float* qs[kFaTileQ];
            float* os[kFaTileQ];
            float* os2[kFaTileQ];
            int64_t nk[kFaTileQ], first[kFaTileQ];
            for (int r = 0; r < nr; r++) {
              qs[r] = q.data() + r * hd;
              os[r] = out.data() + r * hd;
              os2[r] = out2.data() + r * hd;
              nk[r] = n_past + r + 1;
              first[r] = window > 0 && nk[r] > window ? nk[r] - window : 0;
            }
            const int64_t* fp = window > 0 ? first : nullptr;
            const float scale = 0.3f;
            const uint8_t* k0 = kc.data() + hd * es;
            const uint8_t* v0 = vc.data() + hd * es;
            kt.attn_tile[kv](hd, nr, qs, k0, stride_el * es, v0, stride_el * es, fp, nk, scale, os, scratch.data());
            for (int r = 0; r < nr; r++) {
              float* o1 = out1.data() + r * hd;
              kt.attn_tile[kv](hd, 1, &qs[r], k0, stride_el * es, v0, stride_el * es, fp ? &first[r] : nullptr, &nk[r], scale, &o1,
                               scratch.data());
              std::vector<double> sc(static_cast<size_t>(nk[r])), ref(static_cast<size_t>(hd), 0.0);
              double mx = -INFINITY, sum = 0;
              const int64_t j_first = first[r];
              for (int64_t j = j_first; j < nk[r]; j++) {
                double d = 0;
                for (int64_t c = 0; c < hd; c++) d += kd[static_cast<size_t>(j * hd + c)] * qs[r][c];
                sc[static_cast<size_t>(j)] = d * scale;
                mx = std::fmax(mx, d * scale);
              }
              for (int64_t j = j_first; j < nk[r]; j++) {
                const double e = std::exp(sc[static_cast<size_t>(j)] - mx);
                sum += e;
                for (int64_t c = 0; c < hd; c++) ref[static_cast<size_t>(c)] += e * vd[static_cast<size_t>(j * hd + c)];
              }
              for (int64_t c = 0; c < hd; c++) {
                const double e = ref[static_cast<size_t>(c)] / sum;
                CHECK(std::fabs(os[r][c] - e) <= 2e-5, "%s attn_tile[%d] hd %ld n_past %ld window %ld row %d: %g vs %g", kt.name, kv,
                      static_cast<long>(hd), static_cast<long>(n_past), static_cast<long>(window), r, static_cast<double>(os[r][c]), e);
              }
            }
            CHECK(std::memcmp(out.data(), out1.data(), out.size() * 4) == 0,
                  "%s attn_tile[%d] hd %ld n_past %ld nr %d: a row alone differs from the same row in a tile", kt.name, kv,
                  static_cast<long>(hd), static_cast<long>(n_past), nr);
            if (other) {
              other->attn_tile[kv](hd, nr, qs, k0, stride_el * es, v0, stride_el * es, fp, nk, scale, os2, scratch.data());
              CHECK(std::memcmp(out.data(), out2.data(), out.size() * 4) == 0,
                    "%s vs %s attn_tile[%d] hd %ld n_past %ld nr %d not bit-identical", kt.name, other->name, kv,
                    static_cast<long>(hd), static_cast<long>(n_past), nr);
            }
          }
        }
      }
    }
  }
}

void test_thread_pool() {
  for (int n : {1, 2, 3, 5}) {
    ThreadPool pool(n);
    struct Ctx {
      ThreadPool* pool;
      std::vector<int64_t> slots;
      int64_t total = 0;
    } c{&pool, std::vector<int64_t>(static_cast<size_t>(n)), 0};
    for (int run = 0; run < 200; run++) {
      pool.run(
          [](void* p, int ith, int nth) {
            Ctx* cx = static_cast<Ctx*>(p);
            for (int phase = 0; phase < 3; phase++) {
              cx->slots[static_cast<size_t>(ith)] = ith + phase;
              cx->pool->barrier();
              if (ith == 0) {
                int64_t s = 0;
                for (int t = 0; t < nth; t++) s += cx->slots[static_cast<size_t>(t)];
                cx->total += s;
              }
              cx->pool->barrier();
            }
          },
          &c);
    }
    const int64_t per = static_cast<int64_t>(n) * (n - 1) / 2;
    CHECK(c.total == 200 * (3 * per + 3 * n), "pool %d total %ld", n, static_cast<long>(c.total));
  }
}

void test_tensor_store() {
  char path[] = "/tmp/pi-native-test-XXXXXX";
  const int fd = mkstemp(path);
  CHECK(fd >= 0, "mkstemp");
  std::vector<uint8_t> bytes(1000);
  for (size_t i = 0; i < bytes.size(); i++) bytes[i] = static_cast<uint8_t>(i);
  CHECK(write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size()), "write");
  close(fd);
  TensorStore st(SIZE_MAX);
  const int64_t ne[4] = {8, 2, 1, 1};
  TensorPtr t = st.map(DT_F32, ne, path, 936, 64);
  CHECK(t->data[0] == static_cast<uint8_t>(936 % 256) && t->mapped, "map data");
  TensorPtr t2 = st.map(DT_F32, ne, path, 0, 64);
  CHECK(t2->mapping == t->mapping, "one mapping per file");
  auto throws = [](const std::function<void()>& f, const char* code) {
    try {
      f();
    } catch (const BackendErr& e) {
      return e.code == code;
    }
    return false;
  };
  CHECK(throws([&] { st.map(DT_F32, ne, path, 940, 64); }, "BAD_TENSOR"), "beyond the end");
  CHECK(throws([&] { st.map(DT_F32, ne, path, 2, 64); }, "BAD_TENSOR"), "misaligned");
  CHECK(throws([&] { st.map(DT_F32, ne, path, 0, 60); }, "BAD_TENSOR"), "wrong length");
  CHECK(throws([&] { st.map(DT_F32, ne, "/nonexistent/file", 0, 64); }, "IO"), "missing file");
  CHECK(throws([&] { st.map(DT_F32, ne, path, UINT64_MAX - 10, 64); }, "BAD_TENSOR"), "offset overflow");
  const int64_t big[4] = {32, 1, 1, 1};
  TensorPtr a = st.create(DT_F32, big);
  CHECK(a && st.allocated() == 128, "allocated %zu", st.allocated());
  TensorStore small(100);
  CHECK(throws([&] { small.create(DT_F32, big); }, "OUT_OF_MEMORY"), "budget");
  const int64_t bad[4] = {33, 1, 1, 1};
  CHECK(throws([&] { small.create(DT_Q4_0, bad); }, "BAD_TENSOR"), "block size");
  unlink(path);

  // huge-page copies of mapped tensors (set_copy_limit): equal bytes, the limit kept, packing hands the
  // copy back to the mapping, freeing updates the count
  {
    char qpath[] = "/tmp/pi-native-test-XXXXXX";
    const int qfd = mkstemp(qpath);
    CHECK(qfd >= 0, "mkstemp");
    const int64_t k = 4096, rows = 1024;  // Q4_0: 2,304 bytes a row, 2.25 MiB in all
    const size_t rb = row_bytes(DT_Q4_0, k), tb = rb * static_cast<size_t>(rows);
    std::vector<uint8_t> q(tb * 3);  // three tensors back to back
    for (size_t r = 0; r < q.size() / rb; r++) {
      std::vector<uint8_t> w = random_row(DT_Q4_0, k);
      std::memcpy(q.data() + r * rb, w.data(), rb);
    }
    CHECK(write(qfd, q.data(), q.size()) == static_cast<ssize_t>(q.size()), "write");
    close(qfd);
    TensorStore cs(SIZE_MAX);
    cs.set_copy_limit(2 * tb);
    const int64_t qn[4] = {k, rows, 1, 1};
    TensorPtr c0 = cs.map(DT_Q4_0, qn, qpath, 0, tb), c1 = cs.map(DT_Q4_0, qn, qpath, tb, tb),
              c2 = cs.map(DT_Q4_0, qn, qpath, 2 * tb, tb);
    CHECK(c0->copied && c1->copied && !c2->copied && cs.copied() == 2 * tb, "copies within the limit: %zu",
          cs.copied());
    CHECK(c0->mapped && reinterpret_cast<uintptr_t>(c0->data) % (size_t{2} << 20) == 0, "copy: read-only, 2 MiB-aligned");
    CHECK(std::memcmp(c0->data, q.data(), tb) == 0 && std::memcmp(c1->data, q.data() + tb, tb) == 0 &&
              std::memcmp(c2->data, q.data() + 2 * tb, tb) == 0,
          "copied bytes equal the file's");
    const uint8_t* pk = cs.packed(c0);
    CHECK(pk && !c0->copied && c0->data == c0->map_data && cs.copied() == tb &&
              std::memcmp(c0->data, q.data(), tb) == 0,
          "packing hands the copy back to the mapping");
    cs.release(c1->id);
    CHECK(cs.copied() == 0, "release: %zu copied", cs.copied());
    const int64_t tiny[4] = {32, 4, 1, 1};
    CHECK(!cs.map(DT_Q4_0, tiny, qpath, 0, row_bytes(DT_Q4_0, 32) * 4)->copied, "under 2 MiB: mapped");

    // deferred copies (set_defer_copies): map() reserves within the limit, copy_pending() makes them;
    // a tensor released or repacked before its copy is skipped and its reservation returned
    TensorStore ds(SIZE_MAX);
    ds.set_copy_limit(3 * tb);
    ds.set_defer_copies(true);
    TensorPtr d0 = ds.map(DT_Q4_0, qn, qpath, 0, tb), d1 = ds.map(DT_Q4_0, qn, qpath, tb, tb),
              d2 = ds.map(DT_Q4_0, qn, qpath, 2 * tb, tb), d3 = ds.map(DT_Q4_0, qn, qpath, 0, tb);
    CHECK(!d0->copied && d0->copy_pending && d2->copy_pending && !d3->copy_pending && ds.copied() == 3 * tb &&
              ds.pending_copy_bytes() == 3 * tb,
          "deferred: reserved within the limit, nothing copied: %zu pending", ds.pending_copy_bytes());
    CHECK(d0->data == d3->data && std::memcmp(d0->data, q.data(), tb) == 0, "deferred: read through the mapping");
    ds.release(d1->id);
    CHECK(ds.copied() == 2 * tb && ds.pending_copy_bytes() == 2 * tb, "deferred release: %zu", ds.copied());
    CHECK(ds.packed(d2) && !d2->copy_pending && ds.copied() == tb, "deferred repack cancels the copy: %zu", ds.copied());
    const size_t made = ds.copy_pending();
    CHECK(made == tb && d0->copied && !d0->copy_pending && !d2->copied && ds.copied() == tb &&
              ds.pending_copy_bytes() == 0,
          "copy_pending made the one left: %zu", made);
    CHECK(d0->data != d0->map_data && reinterpret_cast<uintptr_t>(d0->data) % (size_t{2} << 20) == 0 &&
              std::memcmp(d0->data, q.data(), tb) == 0 && std::memcmp(d2->data, q.data() + 2 * tb, tb) == 0,
          "deferred copy: 2 MiB-aligned, the file's bytes");
    CHECK(ds.copy_pending() == 0, "nothing left to copy");
    ds.release(d0->id);
    CHECK(ds.copied() == 0, "deferred: release of a made copy: %zu", ds.copied());
    unlink(qpath);
  }
}

// ---- graph executor -----------------------------------------------------------------------------

struct GraphBuilder {
  std::vector<int32_t> tensors, nodes;
  std::vector<double> params;
  std::vector<HostBuffer> inputs;
  std::vector<HostOutput> outputs;

  int tensor(int kind, int dtype, std::initializer_list<int> ne, int ref = -1) {
    int32_t w[8] = {kind, dtype, 1, 1, 1, 1, ref, -1};
    int i = 0;
    for (int n : ne) w[2 + i++] = n;
    tensors.insert(tensors.end(), w, w + 8);
    return static_cast<int>(tensors.size() / 8 - 1);
  }
  int input(int dtype, std::initializer_list<int> ne, const void* data, size_t bytes) {
    inputs.push_back({data, bytes});
    return tensor(1, dtype, ne, static_cast<int>(inputs.size() - 1));
  }
  int node(int op, std::initializer_list<int> ne, std::initializer_list<int> src, std::initializer_list<double> p) {
    const int dst = tensor(0, DT_F32, ne);
    node_to(op, dst, src, p);
    return dst;
  }
  void node_to(int op, int dst, std::initializer_list<int> src, std::initializer_list<double> p) {
    int32_t w[10] = {op, dst, -1, -1, -1, -1, -1, static_cast<int32_t>(params.size()), static_cast<int32_t>(p.size()), 0};
    int i = 0;
    for (int s : src) w[2 + i++] = s;
    nodes.insert(nodes.end(), w, w + 10);
    params.insert(params.end(), p.begin(), p.end());
  }
  void output(int t, float* data, size_t bytes) {
    outputs.push_back({data, bytes});
    tensors[static_cast<size_t>(t) * 8 + 7] = static_cast<int32_t>(outputs.size() - 1);
  }
  EncodedGraph view() const {
    EncodedGraph g;
    g.tensors = tensors.data();
    g.tensor_words = tensors.size();
    g.nodes = nodes.data();
    g.node_words = nodes.size();
    g.params = params.data();
    g.n_params = params.size();
    g.inputs = inputs;
    g.outputs = outputs;
    return g;
  }
};

/// Runs the graph; false (with the error printed) when compute throws.
bool computes(Executor& ex, const GraphBuilder& b, std::vector<double>& rows) {
  try {
    ex.compute(b.view(), rows);
    return true;
  } catch (const BackendErr& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return false;
  }
}

/// A graph using most ops: mul_mat, rms_norm, rope, attention over a cpy'd cache, sparse ops.
struct Fixture {
  TensorStore store{SIZE_MAX};
  TensorPtr w, wt, kc, vc;
  std::vector<float> x, logits;
  std::vector<int32_t> pos, rows, ids;
  static constexpr int K = 64, N = 96, T = 3;

  Fixture() {
    const int64_t wne[4] = {K, N, 1, 1};
    w = store.create(DT_Q4_0, wne);
    const std::vector<uint8_t> wb = random_row(DT_Q4_0, int64_t{K} * N);
    std::memcpy(w->data, wb.data(), wb.size());
    wt = store.create(DT_F16, wne);
    const std::vector<uint8_t> tb = random_row(DT_F16, int64_t{K} * N);
    std::memcpy(wt->data, tb.data(), tb.size());
    const int64_t cne[4] = {32, 16, 1, 1};
    kc = store.create(DT_F16, cne);
    vc = store.create(DT_F16, cne);
    x.resize(K * T);
    for (auto& v : x) v = uni(-1, 1);
    logits.resize(N * T);
    for (auto& v : logits) v = uni(-1, 1);
    pos = {5, 6, 7};
    rows = {1, 5, 9, 50, 95, 5};
    ids = {0, 95, 7};
  }

  std::vector<float> y1 = std::vector<float>(N * T), y2 = std::vector<float>(K * T), y3 = std::vector<float>(K * T),
                     y4 = std::vector<float>(K * 3);

  GraphBuilder build() {
    GraphBuilder b;
    const int hw = b.tensor(2, DT_Q4_0, {K, N}, w->id);
    const int ht = b.tensor(2, DT_F16, {K, N}, wt->id);
    const int hk = b.tensor(2, DT_F16, {32, 16}, kc->id);
    const int hv = b.tensor(2, DT_F16, {32, 16}, vc->id);
    const int xi = b.input(DT_F32, {K, T}, x.data(), x.size() * 4);
    const int li = b.input(DT_F32, {N, T}, logits.data(), logits.size() * 4);
    const int pi_ = b.input(DT_I32, {T}, pos.data(), pos.size() * 4);
    const int ri = b.input(DT_I32, {static_cast<int>(rows.size())}, rows.data(), rows.size() * 4);
    const int ii = b.input(DT_I32, {3}, ids.data(), ids.size() * 4);
    const int h = b.node(OP_RMS_NORM, {K, T}, {xi}, {1e-5});
    const int s = b.node(OP_MUL_MAT_SPARSE, {N, T}, {hw, h, li, ri}, {0.0, N});
    const int a = b.node(OP_RELU, {N, T}, {s}, {});
    const int d = b.node(OP_AXPY_SPARSE, {K, T}, {ht, a, li, -1}, {-0.5, N});
    const int q = b.node(OP_ROPE, {K, T}, {h, pi_}, {8, 0, 10000, 1, 16});
    const int kv = b.node(OP_SLICE, {32, T}, {q}, {16, 32});
    b.node_to(OP_CPY, hk, {kv}, {5});
    b.node_to(OP_CPY, hv, {kv}, {5});
    const int att = b.node(OP_ATTENTION, {K, T}, {q, hk, hv}, {5, 2, 0.25, 16, 4});
    const int m = b.node(OP_MUL_MAT, {N, T}, {hw, att}, {});
    const int g = b.node(OP_GET_ROWS, {K, 3}, {hw, ii}, {});
    b.output(m, y1.data(), y1.size() * 4);
    b.output(d, y2.data(), y2.size() * 4);
    b.output(att, y3.data(), y3.size() * 4);
    b.output(g, y4.data(), y4.size() * 4);
    return b;
  }
};

void test_executor() {
  Fixture fx;
  std::vector<std::vector<float>> runs, axpy2;
  // threshold 0: every node on the whole pool; 24000: the small nodes (norm, relu, rope, slice, cpy,
  // get_rows) on thread 0 alone between pooled nodes (mixed segments)
  // delay: the workers join late, after thread 0 ran the first nodes alone (results must not change)
  for (double serial_bytes : {0.0, 24000.0})
  for (int threads : {1, 2, 3})
  for (int delay : {0, 3000}) {
    Executor ex(fx.store, threads, false);
    ex.set_serial_work_bytes(serial_bytes);
    ex.set_test_worker_delay(delay);
    for (int rep = 0; rep < 2; rep++) {
      GraphBuilder b = fx.build();
      std::vector<double> rows;
      const bool ok = computes(ex, b, rows);
      CHECK(ok, "fixture graph computes");
      CHECK(rows.size() == 11, "rows_read per node");
      // rows list {1,5,9,50,95,5}: 5 distinct neurons, gated by logits ≥ 0
      int64_t expect = 0;
      for (int t = 0; t < Fixture::T; t++) {
        for (int i : {1, 5, 9, 50, 95}) expect += fx.logits[static_cast<size_t>(t * Fixture::N + i)] >= 0 ? 1 : 0;
      }
      CHECK(rows[1] == static_cast<double>(expect), "mul_mat_sparse rows_read %g vs %ld", rows[1], static_cast<long>(expect));
      for (float v : fx.y1) CHECK(std::isfinite(v), "finite output");
      std::vector<float> all(fx.y1);
      all.insert(all.end(), fx.y3.begin(), fx.y3.end());
      if (threads == 2 && serial_bytes == 0) all.insert(all.end(), fx.y2.begin(), fx.y2.end());
      runs.push_back(all);
      if (threads == 2 && serial_bytes == 0) axpy2.push_back(fx.y2);
    }
  }
  // mul_mat (fed by rms_norm → rope → attention): identical across thread counts;
  // axpy_sparse identical across runs at 2 threads
  for (size_t r = 1; r < runs.size(); r++) {
    const size_t n = Fixture::N * Fixture::T + Fixture::K * Fixture::T;
    CHECK(std::memcmp(runs[r].data(), runs[0].data(), n * 4) == 0, "run %zu differs", r);
  }
  for (size_t r = 1; r < axpy2.size(); r++) {
    CHECK(axpy2[r] == axpy2[0], "axpy_sparse at 2 threads: run %zu (workers %s) differs", r, r >= 2 ? "late" : "on time");
  }
}

/// Workers that join a graph late (Executor::set_test_worker_delay): thread 0 runs the nodes before the
/// first axpy_sparse alone, and axpy_sparse (whose sum depends on the thread count) waits for them, so a
/// 512-row axpy_sparse at 2 threads gives the bits of a run where thread 0 never runs alone, whether the
/// workers come 3 ms late or on time.
void test_executor_late_workers() {
  constexpr int K = 64, N = 512;
  TensorStore store{SIZE_MAX};
  const int64_t wne[4] = {K, N, 1, 1};
  TensorPtr wt = store.create(DT_F16, wne);
  const std::vector<uint8_t> tb = random_row(DT_F16, int64_t{K} * N);
  std::memcpy(wt->data, tb.data(), tb.size());
  std::vector<float> act(N), logits(N, 1.0f);
  for (auto& v : act) v = uni(-1, 1);
  std::vector<std::vector<float>> outs;
  for (int delay : {-1, 3000, -1, 3000, 0}) {
    Executor ex(store, 2, false);
    ex.set_serial_work_bytes(0);
    ex.set_test_worker_delay(delay);
    std::vector<float> y(K);
    GraphBuilder b;
    const int ht = b.tensor(2, DT_F16, {K, N}, wt->id);
    const int ai = b.input(DT_F32, {N, 1}, act.data(), act.size() * 4);
    const int li = b.input(DT_F32, {N, 1}, logits.data(), logits.size() * 4);
    const int a = b.node(OP_RELU, {N, 1}, {ai}, {});
    const int d = b.node(OP_AXPY_SPARSE, {K, 1}, {ht, a, li, -1}, {-0.5, N});
    b.output(d, y.data(), y.size() * 4);
    std::vector<double> rows;
    const bool ok = computes(ex, b, rows);
    CHECK(ok, "late-worker graph computes");
    outs.push_back(y);
  }
  for (size_t r = 1; r < outs.size(); r++) {
    CHECK(std::memcmp(outs[r].data(), outs[0].data(), K * 4) == 0, "axpy_sparse run %zu (workers %s) differs from the 2-thread run",
          r, r % 2 ? "3 ms late" : "on time");
  }
}

/// Routed experts: top_k → mul_mat_id (each slot equals mul_mat on its expert's slice, bit for bit),
/// mul_mat_id_sparse (equals the dense slot where the gate is > 0, exactly 0 elsewhere, rows counted),
/// axpy_id_sparse and moe_sum; identical for every thread count and serial threshold.
void test_experts() {
  constexpr int K = 64, M = 40, E = 5, U = 2, T = 3;
  TensorStore store{SIZE_MAX};
  const int64_t wne[4] = {K, M, E, 1};
  TensorPtr w = store.create(DT_Q4_0, wne);
  const std::vector<uint8_t> wb = random_row(DT_Q4_0, int64_t{K} * M * E);
  std::memcpy(w->data, wb.data(), wb.size());
  TensorPtr wt = store.create(DT_F16, wne);
  const std::vector<uint8_t> tb = random_row(DT_F16, int64_t{K} * M * E);
  std::memcpy(wt->data, tb.data(), tb.size());
  std::vector<float> x(K * T), router(E * T);
  for (auto& v : x) v = uni(-1, 1);
  for (auto& v : router) v = uni(-2, 2);
  router[E + 3] = router[E + 1];  // a tie in token 1: the lower index ranks first
  std::vector<int32_t> want_ids(U * T);
  for (int t = 0; t < T; t++) {
    std::vector<int> order(E);
    for (int e = 0; e < E; e++) order[static_cast<size_t>(e)] = e;
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return router[static_cast<size_t>(t * E + a)] > router[static_cast<size_t>(t * E + b)]; });
    for (int u = 0; u < U; u++) want_ids[static_cast<size_t>(t * U + u)] = order[static_cast<size_t>(u)];
  }
  // expected dense slots: mul_mat on a copy of the expert's slice
  std::vector<float> want_dense(M * U * T);
  {
    Executor ex(store, 1, false);
    const size_t slice = row_bytes(DT_Q4_0, K) * M;
    for (int p = 0; p < U * T; p++) {
      const int64_t sne[4] = {K, M, 1, 1};
      TensorPtr ws = store.create(DT_Q4_0, sne);
      std::memcpy(ws->data, wb.data() + static_cast<size_t>(want_ids[static_cast<size_t>(p)]) * slice, slice);
      GraphBuilder b;
      const int h = b.tensor(2, DT_Q4_0, {K, M}, ws->id);
      const int xi = b.input(DT_F32, {K, 1}, x.data() + (p / U) * K, K * 4);
      const int y = b.node(OP_MUL_MAT, {M, 1}, {h, xi}, {});
      b.output(y, want_dense.data() + p * M, M * 4);
      std::vector<double> rows;
      ex.compute(b.view(), rows);
      store.release(ws->id);
    }
  }
  int64_t active = 0;
  for (float v : want_dense) active += v > 0 ? 1 : 0;
  std::vector<std::vector<float>> runs;
  // delay: workers late, thread 0 runs the whole graph alone (every node here is thread-count invariant)
  for (double serial_bytes : {0.0, 24000.0})
  for (int threads : {1, 2, 3})
  for (int delay : {0, 3000}) {
    Executor ex(store, threads, false);
    ex.set_serial_work_bytes(serial_bytes);
    ex.set_test_worker_delay(delay);
    std::vector<float> dense(M * U * T), sparse(M * U * T, NAN), down(K * U * T), sum(K * T), ids_out(U * T);
    GraphBuilder b;
    const int hw = b.tensor(2, DT_Q4_0, {K, M, E}, w->id);
    const int ht = b.tensor(2, DT_F16, {K, M, E}, wt->id);
    const int xi = b.input(DT_F32, {K, T}, x.data(), x.size() * 4);
    const int ri = b.input(DT_F32, {E, T}, router.data(), router.size() * 4);
    const int probs = b.node(OP_SOFTMAX, {E, T}, {ri}, {1.0});
    const int ids = b.tensor(0, DT_I32, {U, T});
    b.node_to(OP_TOP_K, ids, {ri}, {U});
    const int g = b.node(OP_MUL_MAT_ID, {M, U, T}, {hw, xi, ids}, {});
    const int sp = b.node(OP_MUL_MAT_ID_SPARSE, {M, U, T}, {hw, xi, ids, g}, {1.401298464324817e-45});
    const int a = b.node(OP_RELU, {M, U, T}, {g}, {});
    const int d = b.node(OP_AXPY_ID_SPARSE, {K, U, T}, {ht, a, ids, g}, {1.401298464324817e-45});
    const int o = b.node(OP_MOE_SUM, {K, T}, {d, probs, ids}, {1, 1});
    // the ids read back through mul_mat_id on experts W_e = [[e]]
    std::vector<float> idw(E);
    for (int e = 0; e < E; e++) idw[static_cast<size_t>(e)] = static_cast<float>(e);
    const int64_t ine[4] = {1, 1, E, 1};
    TensorPtr hid = store.create(DT_F32, ine);
    std::memcpy(hid->data, idw.data(), idw.size() * 4);
    std::vector<float> ones(T, 1.0f);
    const int hi_ = b.tensor(2, DT_F32, {1, 1, E}, hid->id);
    const int oi = b.input(DT_F32, {1, T}, ones.data(), ones.size() * 4);
    const int ir = b.node(OP_MUL_MAT_ID, {1, U, T}, {hi_, oi, ids}, {});
    // the slots laid out by expert (moe_scatter), and a per-expert table gathered by top_k's ids (get_rows)
    std::vector<float> scat(M * E * T), table(M * E), gathered(M * U * T);
    for (size_t i = 0; i < table.size(); i++) table[i] = static_cast<float>(i) * 0.5f - 3.0f;
    const int sc = b.node(OP_MOE_SCATTER, {M * E, T}, {g, ids}, {static_cast<double>(M), static_cast<double>(E), -2.5});
    const int ti = b.input(DT_F32, {M, E}, table.data(), table.size() * 4);
    const int gr = b.node(OP_GET_ROWS, {M, U * T}, {ti, ids}, {});
    b.output(sc, scat.data(), scat.size() * 4);
    b.output(gr, gathered.data(), gathered.size() * 4);
    b.output(g, dense.data(), dense.size() * 4);
    b.output(sp, sparse.data(), sparse.size() * 4);
    b.output(d, down.data(), down.size() * 4);
    b.output(o, sum.data(), sum.size() * 4);
    b.output(ir, ids_out.data(), ids_out.size() * 4);
    std::vector<double> rows;
    const bool ok = computes(ex, b, rows);
    store.release(hid->id);
    CHECK(ok, "expert graph computes");
    if (!ok) continue;
    for (int p = 0; p < U * T; p++) CHECK(ids_out[static_cast<size_t>(p)] == static_cast<float>(want_ids[static_cast<size_t>(p)]), "top_k id %d", p);
    CHECK(std::memcmp(dense.data(), want_dense.data(), dense.size() * 4) == 0, "mul_mat_id slots equal mul_mat on the expert (threads %d)", threads);
    bool sparse_ok = true;
    for (size_t i = 0; i < sparse.size(); i++) sparse_ok &= sparse[i] == (want_dense[i] > 0 ? want_dense[i] : 0.0f);
    CHECK(sparse_ok, "mul_mat_id_sparse = dense where the gate fires, 0 elsewhere (threads %d)", threads);
    CHECK(rows[3] == static_cast<double>(active), "mul_mat_id_sparse rows %g vs %ld", rows[3], static_cast<long>(active));
    CHECK(rows[5] == static_cast<double>(active), "axpy_id_sparse rows %g vs %ld", rows[5], static_cast<long>(active));
    bool scat_ok = true, gather_ok = true;
    for (int t = 0; t < T; t++) {
      for (int e = 0; e < E; e++) {
        int slot = -1;
        for (int u = 0; u < U; u++)
          if (want_ids[static_cast<size_t>(t * U + u)] == e) slot = u;
        for (int i = 0; i < M; i++) {
          const float want = slot < 0 ? -2.5f : want_dense[static_cast<size_t>((t * U + slot) * M + i)];
          scat_ok &= scat[static_cast<size_t>((t * E + e) * M + i)] == want;
        }
      }
      for (int u = 0; u < U; u++)
        for (int i = 0; i < M; i++)
          gather_ok &= gathered[static_cast<size_t>((t * U + u) * M + i)] ==
                       table[static_cast<size_t>(want_ids[static_cast<size_t>(t * U + u)] * M + i)];
    }
    CHECK(scat_ok, "moe_scatter lays the slots out by expert, the fill elsewhere (threads %d)", threads);
    CHECK(gather_ok, "get_rows by top_k ids gathers each slot's expert row (threads %d)", threads);
    std::vector<float> all(dense);
    all.insert(all.end(), sparse.begin(), sparse.end());
    all.insert(all.end(), down.begin(), down.end());
    all.insert(all.end(), sum.begin(), sum.end());
    runs.push_back(all);
  }
  for (size_t r = 1; r < runs.size(); r++) CHECK(runs[r] == runs[0], "expert run %zu differs", r);
}

/// Whether the kernel lets this process set up an io_uring (/proc/sys/kernel/io_uring_disabled 0 or absent).
bool io_uring_allowed() {
  FILE* f = std::fopen("/proc/sys/kernel/io_uring_disabled", "r");
  if (!f) return true;
  int v = -1;
  const bool ok = std::fscanf(f, "%d", &v) == 1;
  std::fclose(f);
  return ok && v == 0;
}

/// Expert stacks served from a file one expert per row (expert cache): mul_mat_id, mul_mat_id_sparse and
/// axpy_id_sparse (its stack transposed on read from llama.cpp's down layout) equal the in-memory stacks' bit
/// for bit, with experts larger than one 1 MiB read (pieces read by several readers), a single LRU slot
/// (a round per expert) and top_k's prefetch; every thread count; `io` the reader (POWERINFER_IO).
void test_expert_cache(const char* io) {
  constexpr int K = 1024, M = 640, E = 4, U = 2, T = 3;  // F16: 1.25 MiB per expert
  setenv("POWERINFER_IO", io, 1);
  TensorStore store{SIZE_MAX};
  const int64_t wne[4] = {K, M, E, 1};
  const std::vector<uint8_t> wb = random_row(DT_F16, int64_t{K} * M * E);  // gate stack [K, M, E]
  const std::vector<uint8_t> db = random_row(DT_F16, int64_t{K} * M * E);  // down as stored: [M, K, E]
  std::vector<uint8_t> dt(db.size());                                       // its neuron-major transpose [K, M, E]
  for (int e = 0; e < E; e++)
    for (int r = 0; r < K; r++)
      for (int c = 0; c < M; c++)
        std::memcpy(&dt[(static_cast<size_t>(e) * M * K + static_cast<size_t>(c) * K + r) * 2],
                    &db[(static_cast<size_t>(e) * K * M + static_cast<size_t>(r) * M + c) * 2], 2);
  char path[] = "/tmp/pi-expert-cache-XXXXXX";
  const int fd = mkstemp(path);
  CHECK(fd >= 0, "temp file");
  if (fd < 0) return;
  std::vector<uint8_t> head(96, 0);
  bool wrote = write(fd, head.data(), head.size()) == 96 &&
               write(fd, wb.data(), wb.size()) == static_cast<ssize_t>(wb.size()) &&
               write(fd, db.data(), db.size()) == static_cast<ssize_t>(db.size());
  close(fd);
  CHECK(wrote, "temp file written");
  TensorPtr wm = store.create(DT_F16, wne);
  std::memcpy(wm->data, wb.data(), wb.size());
  TensorPtr dm = store.create(DT_F16, wne);
  std::memcpy(dm->data, dt.data(), dt.size());
  std::vector<float> x(K * T), router(E * T), a(M * U * T);
  for (auto& v : x) v = uni(-1, 1);
  for (auto& v : router) v = uni(-2, 2);
  for (auto& v : a) v = uni(0, 1);
  for (const int cold : {1, 3}) {
    CacheSpec gs;
    gs.path = path;
    gs.file_offset = 96;
    gs.row_bytes = wb.size() / E;
    gs.row_stride = gs.row_bytes;
    gs.n_rows = E;
    gs.cold_slots = cold;
    gs.expert_rows = true;
    if (cold == 3) gs.hot = {2};
    CacheSpec ds = gs;
    ds.file_offset = 96 + wb.size();
    ds.transpose_rows = K;
    ds.elem_bytes = 2;
    TensorPtr wc, dc;
    try {
      wc = store.map_cached(DT_F16, wne, gs, 7, 0);
      dc = store.map_cached(DT_F16, wne, ds, 7, 0);
    } catch (const BackendErr& e) {
      CHECK(false, "map_cached: %s", e.what());
      continue;
    }
    std::vector<std::vector<float>> runs;
    for (int threads : {1, 2, 3}) {
      Executor ex(store, threads, false);
      ex.set_serial_work_bytes(0);
      std::vector<float> out[2][3];
      for (int v = 0; v < 2; v++) {
        GraphBuilder b;
        const int hw = b.tensor(2, DT_F16, {K, M, E}, v ? wc->id : wm->id);
        const int hd = b.tensor(2, DT_F16, {K, M, E}, v ? dc->id : dm->id);
        const int xi = b.input(DT_F32, {K, T}, x.data(), x.size() * 4);
        const int ri = b.input(DT_F32, {E, T}, router.data(), router.size() * 4);
        const int ai = b.input(DT_F32, {M, U, T}, a.data(), a.size() * 4);
        const int ids = b.tensor(0, DT_I32, {U, T});
        b.node_to(OP_TOP_K, ids, {ri}, {U});
        const int g = b.node(OP_MUL_MAT_ID, {M, U, T}, {hw, xi, ids}, {});
        const int sp = b.node(OP_MUL_MAT_ID_SPARSE, {M, U, T}, {hw, xi, ids, g}, {1.401298464324817e-45});
        const int d = b.node(OP_AXPY_ID_SPARSE, {K, U, T}, {hd, ai, ids, g}, {1.401298464324817e-45});
        out[v][0].resize(M * U * T);
        out[v][1].resize(M * U * T);
        out[v][2].resize(K * U * T);
        b.output(g, out[v][0].data(), out[v][0].size() * 4);
        b.output(sp, out[v][1].data(), out[v][1].size() * 4);
        b.output(d, out[v][2].data(), out[v][2].size() * 4);
        std::vector<double> rows;
        try {
          ex.compute(b.view(), rows);
        } catch (const BackendErr& e) {
          CHECK(false, "expert cache graph (cold %d, threads %d): %s", cold, threads, e.what());
        }
      }
      for (int o = 0; o < 3; o++) {
        CHECK(out[0][o] == out[1][o], "expert cache output %d equals the in-memory stack's (cold %d, threads %d)", o, cold,
              threads);
      }
    }
    CHECK(store.counters().io_errors.load() == 0, "expert cache: no read failed");
    const bool ring = std::strcmp(io, "pread") != 0 && io_uring_allowed();
    CHECK(store.io_depth() == (ring ? kRingDepth : 0), "expert cache: %s reads (depth %d)", io, store.io_depth());
    store.release(wc->id);
    store.release(dc->id);
  }
  store.release(wm->id);
  store.release(dm->id);
  unlink(path);
}

bool throws_bad_graph(Executor& ex, const GraphBuilder& b) {
  std::vector<double> rows;
  try {
    ex.compute(b.view(), rows);
  } catch (const BackendErr& e) {
    return e.code == "BAD_GRAPH";
  }
  return false;
}

void test_bad_graphs() {
  Fixture fx;
  Executor ex(fx.store, 2, false);
  ex.set_serial_work_bytes(0);
  {
    GraphBuilder b = fx.build();
    b.nodes[0] = 42;
    CHECK(throws_bad_graph(ex, b), "unknown op");
  }
  {
    GraphBuilder b = fx.build();
    fx.rows[2] = 96;
    CHECK(throws_bad_graph(ex, b), "rows out of range");
    fx.rows[2] = 9;
  }
  {
    GraphBuilder b = fx.build();
    fx.ids[1] = -1;
    CHECK(throws_bad_graph(ex, b), "negative id");
    fx.ids[1] = 95;
  }
  {
    GraphBuilder b = fx.build();
    b.inputs[0].bytes -= 4;
    CHECK(throws_bad_graph(ex, b), "short input");
  }
  {
    GraphBuilder b = fx.build();
    b.tensors.pop_back();
    CHECK(throws_bad_graph(ex, b), "truncated tensors");
  }
  {
    GraphBuilder b = fx.build();
    b.params[b.nodes[4 * 10 + 7] + 2] = NAN;  // rope freq_base
    CHECK(throws_bad_graph(ex, b), "NaN param");
  }
  {
    GraphBuilder b = fx.build();
    b.params[b.nodes[8 * 10 + 7]] = 14;  // attention n_past + T > cache size
    CHECK(throws_bad_graph(ex, b), "attention past the cache");
  }
  // fuzz: corrupt words of the encoding; every outcome must be success or BackendErr (ASan checks the rest)
  const int32_t specials[] = {-1, 0, 1, 2, 3, 5, 8, 14, 15, 16, 17, 26, 30, 31, 32, 95, 96, 97, 1 << 16, INT32_MAX, INT32_MIN};
  int rejected = 0;
  for (int trial = 0; trial < 3000; trial++) {
    GraphBuilder b = fx.build();
    const int n_mut = irand(1, 3);
    for (int m = 0; m < n_mut; m++) {
      std::vector<int32_t>& arr = irand(0, 1) ? b.tensors : b.nodes;
      const size_t i = static_cast<size_t>(irand(0, static_cast<int>(arr.size()) - 1));
      arr[i] = irand(0, 3) == 0 ? irand(-100, 200) : specials[irand(0, static_cast<int>(sizeof(specials) / 4) - 1)];
    }
    if (irand(0, 9) == 0) b.params[static_cast<size_t>(irand(0, static_cast<int>(b.params.size()) - 1))] = uni(-100, 100);
    std::vector<double> rows;
    try {
      ex.compute(b.view(), rows);
    } catch (const BackendErr& e) {
      // UNSUPPORTED_OP: a corrupted graph that is well formed but asks for what no kernel does (mixed cache dtypes)
      CHECK(e.code == "BAD_GRAPH" || e.code == "BAD_TENSOR" || e.code == "UNSUPPORTED_OP", "fuzz error code %s",
            e.code.c_str());
      rejected++;
    }
  }
  CHECK(rejected > 1000, "fuzz: %d of 3000 corrupted graphs rejected", rejected);
}

}  // namespace

/// The bandwidth probe's sum covers every element once, whatever the length (small integers: exact).
void test_sum_probe(const KernelTable& kt) {
  for (int64_t n : {0, 1, 7, 31, 32, 33, 100, 1000, 4099}) {
    std::vector<float> x(static_cast<size_t>(n));
    double e = 0;
    for (int64_t i = 0; i < n; i++) e += (x[static_cast<size_t>(i)] = static_cast<float>(i % 17));
    CHECK(kt.sum_f32(x.data(), n) == e, "%s sum_f32 n=%ld", kt.name, static_cast<long>(n));
  }
}

// SiLU in llama.cpp's AVX2 arithmetic: its exp approximation stays within 2 ulp of the correctly rounded
// exp over the normal range, saturates as expf does, and the last row mod 8 elements of a row use expf itself.
void test_silu_ggml() {
  int worst = 0;
  for (int i = -87000; i <= 88000; i += 7) {
    const float x = static_cast<float>(i) * 1e-3f;
    const float got = expf_ggml_avx2(x);
    const float want = static_cast<float>(std::exp(static_cast<double>(x)));
    int32_t a, b;
    std::memcpy(&a, &got, 4);
    std::memcpy(&b, &want, 4);
    worst = std::max(worst, std::abs(a - b));
  }
  CHECK(worst <= 2, "expf_ggml_avx2 within 2 ulp of exp on [-87, 88], worst %d ulp", worst);
  CHECK(std::isinf(expf_ggml_avx2(100.0f)) && expf_ggml_avx2(-120.0f) == 0.0f, "exp saturates: inf at 100, 0 at -120");
  const float sub = expf_ggml_avx2(-95.0f);  // |n| > 126: the two-factor scale
  CHECK(std::fabs(sub - std::exp(-95.0f)) <= 1e-44f, "exp(-95) = %g (subnormal range)", static_cast<double>(sub));
  // a row of 12: elements 0–7 through the approximation, 8–11 through expf exactly
  for (int i = 0; i < 12; i++) {
    const float x = -3.0f + 0.37f * static_cast<float>(i);
    const float ref = x / (1.0f + std::exp(-x));
    const float got = silu_ggml(x, i, 12);
    if (i >= 8) CHECK(got == ref, "tail element %d uses expf", i);
    else CHECK(std::fabs(got - ref) <= 4e-7f * std::fabs(ref) + 1e-30f, "block element %d close to expf's", i);
  }
}

int main() {
  const CpuFeatures f = cpu_features();
  const char* reason = "";
  select_kernels(false, &reason);
  std::printf("cpu: avx2=%d fma=%d f16c=%d avx512f=%d avx512vnni=%d -> %s\n", f.avx2, f.fma, f.f16c, f.avx512f, f.avx512vnni,
              reason);
  test_conversions();
  test_silu_ggml();
  test_dtype_kernels(kernels_scalar());
  if (f.avx2 && f.fma && f.f16c) test_dtype_kernels(kernels_avx2());
#if defined(PI_HAVE_VNNI_KERNELS)
  if (f.avx2 && f.fma && f.f16c && f.avx512vnni) test_dtype_kernels(kernels_avx2_vnni());
  if (f.avx2 && f.fma && f.f16c && f.avx512vnni) test_attention_kernels(kernels_avx2_vnni(), &kernels_scalar());
  if (f.avx2 && f.fma && f.f16c && f.avx512vnni) test_attention_tile(kernels_avx2_vnni(), &kernels_scalar());
#endif
  test_gemm_tiles();
  test_repack();
  test_vnni_equals_avx2();
  test_attention_kernels(kernels_scalar(), nullptr);
  if (f.avx2 && f.fma && f.f16c) test_attention_kernels(kernels_avx2(), &kernels_scalar());
  test_attention_tile(kernels_scalar(), nullptr);
  if (f.avx2 && f.fma && f.f16c) test_attention_tile(kernels_avx2(), &kernels_scalar());
  test_sum_probe(kernels_scalar());
  if (f.avx2 && f.fma && f.f16c) test_sum_probe(kernels_avx2());
  test_thread_pool();
  test_tensor_store();
  test_executor();
  test_executor_late_workers();
  test_experts();
  test_expert_cache("io_uring");
  test_expert_cache("pread");
  unsetenv("POWERINFER_IO");
  test_bad_graphs();
  std::printf("%d checks, %d failures\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
