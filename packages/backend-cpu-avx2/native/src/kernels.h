// Kernel tables: one per instruction set (portable scalar, AVX2+FMA+F16C), chosen at run time.
//
// A weight row of K elements is dotted with an activation row converted to the format llama.cpp
// uses for that weight type (see XFormat), so quantized results match llama.cpp's.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.h"

namespace pi {

/// Activation formats for dot products.
enum XFormat : int {
  XF_F32 = 0,   // F32 weights
  XF_F16 = 1,   // F16 weights: x rounded to F16 (held as F32 values, so a dot converts only the weights)
  XF_BF16 = 2,  // BF16 weights: x rounded to BF16 (held as F32 values)
  XF_Q8_0 = 3,  // Q4_0, Q5_0, Q8_0 weights
  XF_Q8_1 = 4,  // Q4_1, Q5_1 weights
  XF_Q8_K = 5,  // Q4_K, Q5_K, Q6_K weights
  XF_COUNT = 6,
};

static inline int x_format(int wdt) {
  switch (wdt) {
    case DT_F16: return XF_F16;
    case DT_BF16: return XF_BF16;
    case DT_Q4_0:
    case DT_Q5_0:
    case DT_Q8_0: return XF_Q8_0;
    case DT_Q4_1:
    case DT_Q5_1: return XF_Q8_1;
    case DT_Q4_K:
    case DT_Q5_K:
    case DT_Q6_K: return XF_Q8_K;
    default: return XF_F32;
  }
}

/// Elements per block of an activation format.
static inline int x_block(int fmt) { return fmt == XF_Q8_K ? QK_K : (fmt >= XF_Q8_0 ? QK : 1); }

/// Bytes of an activation row of k elements in format `fmt` (k a multiple of x_block(fmt)).
static inline size_t x_row_bytes(int fmt, int64_t k) {
  switch (fmt) {
    case XF_Q8_0:
    case XF_Q8_1: return static_cast<size_t>(k / QK) * sizeof(XBlockQ8);
    case XF_Q8_K: return static_cast<size_t>(k / QK_K) * sizeof(BlockQ8_K);
    default: return static_cast<size_t>(k) * 4;
  }
}

/// Dot product of one weight row (k elements, weight dtype) with one converted activation row.
using DotFn = float (*)(int64_t k, const void* w, const void* x);
/// nr weight rows × nc activation rows (nr, nc ≤ 2; with nc = 1, nr ≤ KernelTable::tile_rows; with nr = 1, nc ≤ 4): out[r·nc + c] = dot(k, w[r], x[c]),
/// each output computed with exactly the operations of DotFn (so results do not depend on the tiling).
using DotTileFn = void (*)(int64_t k, int nr, int nc, const uint8_t* const* w, const uint8_t* const* x, float* out);
/// Dequantizes k elements (a whole number of blocks) to F32.
using DequantFn = void (*)(const void* w, float* y, int64_t k);
/// y[0..k) += a · dequant(w[0..k)).
using AxpyFn = void (*)(int64_t k, float a, const void* w, float* y);
/// y[0..k) += Σ_r a[r] · dequant(w[r][0..k)) for nr ≤ 4 rows, y loaded and stored once; each
/// element sees the same operations in the same order as nr successive AxpyFn calls.
using AxpyRowsFn = void (*)(int64_t k, int nr, const float* a, const uint8_t* const* w, float* y);
/// ng consecutive groups of 8 repacked rows (BlockQ4_0x8 for Q4_0, BlockQ4_Kx8 for Q4_K, see common.h; a
/// group is packed_group_bytes(dtype, k) bytes) × nc activation rows (the dtype's XFormat):
/// out[8·(g·nc + c) + r] = row r of group g · column c, each output bit-identical to dot[dtype] on the
/// unpacked row. Fastest at ng = 4, nc = 1 (matrix × vector: four concurrent streams) and ng = 1, nc = 4
/// (a batch).
using PackedTileFn = void (*)(int64_t k, int ng, int nc, const uint8_t* groups, const uint8_t* const* x, float* out);
/// axpy_sparse with a batch (see ops.cpp `axpy_batch`): y[0..64) = Σ_j s_j · v_j over the n entries in
/// order, as acc = fma(s_j, v_j, acc) per element from acc = +0, then stored — the per-element operations
/// of n successive AxpyFn calls on a zeroed y. Entry j is the slice `slices + idx[j]·stride` (bytes) with
/// the coefficient a[j]; the slice kind (index of KernelTable::axpy_gather) says what a slice holds:
/// - SK_I8 (Q4_0/Q8_0 rows): two F32 block scales d0, d1, then 64 int8 (q − 8 for Q4_0, q for Q8_0);
///   s = a·d0 for elements 0..31 and a·d1 for 32..63 (the rounding of axpy_q4_0/axpy_q8_0's a·d);
/// - SK_F16: 64 F16 values, s = a; SK_F32: 64 F32 values (a dequantized row part), s = a.
using AxpyGatherFn = void (*)(int64_t n, const int32_t* idx, const float* a, const uint8_t* slices, int64_t stride,
                              float* y);
enum SliceKind { SK_I8 = 0, SK_F16 = 1, SK_F32 = 2, SK_COUNT = 3 };

/// Converts k F32 activations to an activation format.
using ConvertFn = void (*)(const float* x, void* dst, int64_t k);

constexpr int DT_TABLE = 32;

struct KernelTable {
  const char* name;
  DotFn dot[DT_TABLE];          // indexed by weight dtype code
  DotTileFn dot_tile[DT_TABLE]; // indexed by weight dtype code
  /// Rows of the fastest dot_tile against one activation row (the most it takes with nc = 1): 4, or 8 where the
  /// table has an 8-row kernel (AVX2 Q4_0: dot_rows8_q4_0). The sparse decode ops take active rows in groups of it.
  int tile_rows[DT_TABLE];
  /// llama.cpp's prompt-processing GEMM arithmetic (llamafile's tinyBLAS on AVX2, used by ggml for a
  /// matrix product of ≥ 2 columns when k % 8 == 0 and the row count % 4 == 0): per output one 8-lane
  /// FMA accumulator over k in steps of 8 (Q8_0: block by block, scale · the block's 8 int32 lane sums),
  /// then one horizontal sum. F32/F16/BF16/Q8_0 weights only (null elsewhere); k must be a multiple of 8.
  /// Same signature as dot_tile, any nr × nc (fastest at 4 × gemm_cols); each output's
  /// value does not depend on the tile shape.
  DotTileFn gemm_tile[DT_TABLE];
  /// gemm_tile for F32/F16/BF16 weights with the activations interleaved by column pairs: x[p] is the
  /// start of columns 2p and 2p + 1 (of this call's nc) as 16-float steps, x[p][16·j .. 16·j + 8) =
  /// column 2p's elements [8·j, 8·j + 8) and x[p][16·j + 8 .. 16·j + 16) = column 2p + 1's (an odd nc's last
  /// pair may hold anything in its second half). nr ≤ 4, nc ≤ 12, k % 8 == 0. Every output equals
  /// gemm_tile's bit for bit (the same 8-lane chains; only the activation loads differ). Null where absent
  /// (only the AVX-512 table has it: one 512-bit load per pair instead of two loads and an insert).
  DotTileFn gemm_tile_pairs[DT_TABLE];
  /// dot_tile of 8 rows (tile_rows = 8) × one activation row that also fetches the next 8 rows of a sparse op
  /// (`next`, any addresses, repeats allowed; null: none) into cache at the rate it reads its own. Results
  /// equal dot_tile's. Null where absent (the ops then prefetch the next rows' heads themselves).
  void (*dot_rows8_next[DT_TABLE])(int64_t k, const uint8_t* const* w, const uint8_t* x, float* out, const uint8_t* const* next);
  /// axpy_rows of 4 rows that also fetches the next 4 rows (`next`, as dot_rows8_next). Null where absent.
  void (*axpy_rows_next[DT_TABLE])(int64_t k, const float* a, const uint8_t* const* w, float* y, const uint8_t* const* next);
  /// True where gemm_tile gives every output the value dot gives (the AVX2 tables' Q8_0: both are llama.cpp's
  /// AVX2 Q8_0 arithmetic), so that ops may pick either for speed (mul_mat_sparse's busy rows in a batch).
  bool gemm_is_dot[DT_TABLE];
  /// Columns of the gemm_tile register tile that runs fastest (4 rows × gemm_cols columns per call, at most
  /// 12): 3 on AVX2 (16 registers), 12 with AVX-512 (F32/F16/BF16 on 512-bit registers; Q8_0 splits it
  /// into two 4 × 6 tiles); results do not depend on it.
  int gemm_cols = 3;
  /// Repacked layouts (null where the table or the dtype has none): Q4_0 and Q4_K. Every dot of those types
  /// (packed or not, any tile) has one arithmetic per output. Q4_0: acc = fma(float(Σ(q − 8)·x over the
  /// block, in int32), d_w·d_x, acc) block after block from 0 — the arithmetic of llama.cpp's repacked Q4_0
  /// (q4_0_8x8) kernels. Q4_K: per super-block the exact integers Σ_j sc_j·Σ q·x and Σ_j m_j·Σ x (sub-blocks
  /// j of 32), then s = s + d_x·(d·float(Σ sc·q·x) − dmin·float(Σ m·x)) without fusing, from s = 0.
  PackedTileFn packed_tile[DT_TABLE];
  DequantFn dequant[DT_TABLE];  // indexed by weight dtype code
  AxpyFn axpy[DT_TABLE];        // indexed by weight dtype code
  AxpyRowsFn axpy_rows[DT_TABLE];
  /// Indexed by SliceKind; null in the portable table (ops then take the row-by-row axpy path).
  AxpyGatherFn axpy_gather[SK_COUNT];
  /// Q4_0/Q8_0 (null elsewhere): the SK_I8 slice (72 bytes, see AxpyGatherFn) of the two blocks at w.
  void (*slice_i8[DT_TABLE])(const uint8_t* w, uint8_t* slice);
  ConvertFn convert[XF_COUNT];  // indexed by XFormat
  ConvertFn store_f16;          // F32 → F16 storage (round to nearest even)
  ConvertFn store_bf16;         // F32 → BF16 storage (round to nearest even)
  float (*dot_f32)(int64_t n, const float* a, const float* b);
  void (*axpy_f32)(int64_t n, float a, const float* x, float* y);
  /// One query row of causal attention over n cached rows, in the arithmetic of llama.cpp's CPU flash
  /// attention (ggml-cpu ops.cpp `flash_attn_ext`, AVX2 build), so that models whose activations are
  /// quantized (Q8_0/Q4_0 weights) round exactly as llama.cpp does. Index [KI][VI]: 0 = F32 rows,
  /// 1 = F16 rows. Keys/values are rows `kstride`/`vstride` bytes apart; q holds hd F32 values (with
  /// F16 keys: values already rounded to F16). Per key j: s = scale · dot(k_j, q) (ggml_vec_dot_f16 /
  /// _f32 order: 4 × 8-lane FMA accumulators over 32-element steps, tree-reduced, the tail added in
  /// double for F16); online softmax (M running max, S = S·ms + vs, expf); V accumulated in an F16
  /// (VI = 1, rounded to nearest even after every step, like VKQ16) or F32 accumulator; out = acc / S.
  /// `acc` is scratch of hd floats (F32 V) or hd uint16 (F16 V).
  void (*attn_row[2][2])(int64_t hd, const float* q, const uint8_t* k, size_t kstride, const uint8_t* v, size_t vstride,
                         int64_t n, float scale, float* out, void* acc);
  /// attn_row for nr ≤ kAttnTileRows (attn_ggml.h) query rows over the same K/V rows, row r over keys
  /// [0, n[r]), the keys in blocks taken by every row in turn (K/V reused from cache): each row's result is
  /// bit-identical to attn_row's. `acc`: nr · hd floats of scratch.
  void (*attn_rows[2][2])(int64_t hd, int nr, const float* const* q, const uint8_t* k, size_t kstride,
                          const uint8_t* v, size_t vstride, const int64_t* n, float scale, float* const* out, void* acc);
  /// Up to kFaTileQ (attn_tiled.h) query rows of one head over the same K/V rows, row r over keys
  /// [first[r], n[r]) (first null: from 0), in llama.cpp's tiled flash-attention arithmetic (F32 scores and accumulators, keys in tiles
  /// of 64; see attn_tiled.h), for batches of ≥ 64 rows. Index: 0 = F32 K and V, 1 = F16 K and V; q[r] holds
  /// hd F32 values (not rounded to F16); hd a multiple of 8; `scratch`: attn_tile_floats(hd) floats.
  void (*attn_tile[2])(int64_t hd, int nr, const float* const* q, const uint8_t* k, size_t kstride, const uint8_t* v,
                       size_t vstride, const int64_t* first, const int64_t* n, float scale, float* const* out,
                       float* scratch);
  /// Σ of n floats (memory bandwidth probe); accumulation order is the kernel's own.
  double (*sum_f32)(const float* x, int64_t n);
};

/// The portable table (always available).
const KernelTable& kernels_scalar();
/// The AVX2+FMA+F16C table; only call it after checking the CPU supports those.
const KernelTable& kernels_avx2();
/// The same table with its byte dot products in AVX512-VNNI (256-bit vpdpbusd): bit-identical results;
/// only call it after checking the CPU also has avx512vnni and avx512vl. Absent when the build lacks it
/// (PI_HAVE_VNNI_KERNELS undefined).
const KernelTable& kernels_avx2_vnni();

struct CpuFeatures {
  bool avx2 = false;
  bool fma = false;
  bool f16c = false;
  bool avx512f = false;
  bool avx512vnni = false;  ///< with avx512f, avx512vl and avx512bw (the VNNI table is compiled for all four)
};

CpuFeatures cpu_features();

/// Picks a table: AVX2 when the CPU has AVX2, FMA and F16C and `force_scalar` is false, its VNNI build
/// when the CPU also has AVX512-VNNI and AVX512VL (and POWERINFER_CPU_NO_VNNI is unset).
/// `reason` receives e.g. "avx2+fma+f16c+avx512vnni", "avx2+fma+f16c" or "scalar (CPU lacks AVX2)".
const KernelTable& select_kernels(bool force_scalar, const char** reason);

}  // namespace pi
