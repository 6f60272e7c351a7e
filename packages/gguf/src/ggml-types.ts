/**
 * The ggml tensor types: ids, block sizes and bytes per block.
 *
 * Ids follow current ggml (`enum ggml_type` in ggml/include/ggml.h of ggml-org/llama.cpp); ids 4, 5,
 * 31–33 and 36–38 were removed from ggml and are not defined here. PowerInfer (PWRI) files use the
 * numbering of the late-2023 ggml that PowerInfer forked, which agrees for ids 0–15 and has I8, I16,
 * I32 at 16, 17, 18 (see {@link pwriTypeToGgml} / {@link ggmlTypeToPwri}).
 */

import { GgufError } from "./errors.js";

/** ggml tensor type ids (current ggml numbering). */
export enum GGMLType {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 = 9,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,
  IQ2_XXS = 16,
  IQ2_XS = 17,
  IQ3_XXS = 18,
  IQ1_S = 19,
  IQ4_NL = 20,
  IQ3_S = 21,
  IQ2_S = 22,
  IQ4_XS = 23,
  I8 = 24,
  I16 = 25,
  I32 = 26,
  I64 = 27,
  F64 = 28,
  IQ1_M = 29,
  BF16 = 30,
  TQ1_0 = 34,
  TQ2_0 = 35,
  MXFP4 = 39,
  NVFP4 = 40,
  Q1_0 = 41,
}

/** Block geometry of a ggml type: `blockSize` elements are stored in `typeSize` bytes. */
export interface GGMLTypeInfo {
  /** Upper-case name as ggml prints it in tables (`F32`, `Q4_0`, `IQ2_XXS`, …). */
  name: string;
  /** Elements per block (1 for plain types, 32 for Q4_0/Q8_0, 256 for K-quants). */
  blockSize: number;
  /** Bytes per block. */
  typeSize: number;
}

const QK_K = 256;

/**
 * Block size and bytes per block of every ggml type (from the `block_*` structs of ggml-common.h:
 * e.g. Q4_0 = f16 scale + 16 nibble bytes = 18 bytes per 32 elements).
 */
export const GGML_TYPE_INFO: Record<GGMLType, GGMLTypeInfo> = {
  [GGMLType.F32]: { name: "F32", blockSize: 1, typeSize: 4 },
  [GGMLType.F16]: { name: "F16", blockSize: 1, typeSize: 2 },
  [GGMLType.Q4_0]: { name: "Q4_0", blockSize: 32, typeSize: 2 + 16 },
  [GGMLType.Q4_1]: { name: "Q4_1", blockSize: 32, typeSize: 2 + 2 + 16 },
  [GGMLType.Q5_0]: { name: "Q5_0", blockSize: 32, typeSize: 2 + 4 + 16 },
  [GGMLType.Q5_1]: { name: "Q5_1", blockSize: 32, typeSize: 2 + 2 + 4 + 16 },
  [GGMLType.Q8_0]: { name: "Q8_0", blockSize: 32, typeSize: 2 + 32 },
  [GGMLType.Q8_1]: { name: "Q8_1", blockSize: 32, typeSize: 2 + 2 + 32 },
  [GGMLType.Q2_K]: { name: "Q2_K", blockSize: QK_K, typeSize: QK_K / 16 + QK_K / 4 + 2 + 2 },
  [GGMLType.Q3_K]: { name: "Q3_K", blockSize: QK_K, typeSize: QK_K / 8 + QK_K / 4 + 12 + 2 },
  [GGMLType.Q4_K]: { name: "Q4_K", blockSize: QK_K, typeSize: 2 + 2 + 12 + QK_K / 2 },
  [GGMLType.Q5_K]: { name: "Q5_K", blockSize: QK_K, typeSize: 2 + 2 + 12 + QK_K / 8 + QK_K / 2 },
  [GGMLType.Q6_K]: { name: "Q6_K", blockSize: QK_K, typeSize: QK_K / 2 + QK_K / 4 + QK_K / 16 + 2 },
  [GGMLType.Q8_K]: { name: "Q8_K", blockSize: QK_K, typeSize: 4 + QK_K + (QK_K / 16) * 2 },
  [GGMLType.IQ2_XXS]: { name: "IQ2_XXS", blockSize: QK_K, typeSize: 2 + (QK_K / 8) * 2 },
  [GGMLType.IQ2_XS]: { name: "IQ2_XS", blockSize: QK_K, typeSize: 2 + (QK_K / 8) * 2 + QK_K / 32 },
  [GGMLType.IQ3_XXS]: { name: "IQ3_XXS", blockSize: QK_K, typeSize: 2 + (3 * QK_K) / 8 },
  [GGMLType.IQ1_S]: { name: "IQ1_S", blockSize: QK_K, typeSize: 2 + QK_K / 8 + (QK_K / 32) * 2 },
  [GGMLType.IQ4_NL]: { name: "IQ4_NL", blockSize: 32, typeSize: 2 + 16 },
  [GGMLType.IQ3_S]: { name: "IQ3_S", blockSize: QK_K, typeSize: 2 + QK_K / 4 + QK_K / 32 + QK_K / 8 + QK_K / 64 },
  [GGMLType.IQ2_S]: { name: "IQ2_S", blockSize: QK_K, typeSize: 2 + QK_K / 4 + QK_K / 32 + QK_K / 32 },
  [GGMLType.IQ4_XS]: { name: "IQ4_XS", blockSize: QK_K, typeSize: 2 + 2 + QK_K / 64 + QK_K / 2 },
  [GGMLType.I8]: { name: "I8", blockSize: 1, typeSize: 1 },
  [GGMLType.I16]: { name: "I16", blockSize: 1, typeSize: 2 },
  [GGMLType.I32]: { name: "I32", blockSize: 1, typeSize: 4 },
  [GGMLType.I64]: { name: "I64", blockSize: 1, typeSize: 8 },
  [GGMLType.F64]: { name: "F64", blockSize: 1, typeSize: 8 },
  [GGMLType.IQ1_M]: { name: "IQ1_M", blockSize: QK_K, typeSize: QK_K / 8 + QK_K / 16 + QK_K / 32 },
  [GGMLType.BF16]: { name: "BF16", blockSize: 1, typeSize: 2 },
  [GGMLType.TQ1_0]: { name: "TQ1_0", blockSize: QK_K, typeSize: (QK_K - (4 * QK_K) / 64) / 5 + QK_K / 64 + 2 },
  [GGMLType.TQ2_0]: { name: "TQ2_0", blockSize: QK_K, typeSize: QK_K / 4 + 2 },
  [GGMLType.MXFP4]: { name: "MXFP4", blockSize: 32, typeSize: 1 + 16 },
  [GGMLType.NVFP4]: { name: "NVFP4", blockSize: 64, typeSize: 4 + 32 },
  [GGMLType.Q1_0]: { name: "Q1_0", blockSize: 128, typeSize: 2 + 16 },
};

/** True if `id` is a ggml type id defined in current ggml. */
export function isGgmlType(id: number): id is GGMLType {
  return Number.isInteger(id) && Object.hasOwn(GGML_TYPE_INFO, id);
}

/** Name of a ggml type (`"Q4_0"`), or `"type#N"` for an id not in the table. */
export function ggmlTypeName(t: GGMLType | number): string {
  return isGgmlType(t) ? GGML_TYPE_INFO[t].name : `type#${t}`;
}

/** The ggml type with this name (case-insensitive), or undefined. */
export function ggmlTypeFromName(name: string): GGMLType | undefined {
  const upper = name.toUpperCase();
  for (const [id, info] of Object.entries(GGML_TYPE_INFO)) if (info.name === upper) return Number(id) as GGMLType;
  return undefined;
}

/**
 * Bytes taken by a tensor of `type` and `shape` (ggml order, ne0 first).
 * @throws GgufError `UNKNOWN_TYPE` for an unknown type, `BAD_SHAPE` when ne0 is not a multiple of the
 *   type's block size or a dimension is negative / not an integer, `ELEMENT_OVERFLOW` when the size
 *   exceeds 2^53 - 1.
 */
export function tensorByteLength(type: GGMLType, shape: readonly number[]): number {
  if (!isGgmlType(type)) throw new GgufError("UNKNOWN_TYPE", `unknown ggml type id ${type}`);
  const { blockSize, typeSize, name } = GGML_TYPE_INFO[type];
  let n = 1;
  for (const d of shape) {
    if (!Number.isSafeInteger(d) || d < 0) throw new GgufError("BAD_SHAPE", `bad dimension ${d} in shape [${shape}]`);
    n *= d;
    if (!Number.isSafeInteger(n))
      throw new GgufError("ELEMENT_OVERFLOW", `shape [${shape}] has more than 2^53-1 elements`);
  }
  const ne0 = shape.length > 0 ? shape[0] : 1;
  if (ne0 % blockSize !== 0) {
    throw new GgufError(
      "BAD_SHAPE",
      `row length ${ne0} of a ${name} tensor is not a multiple of its block size ${blockSize}`,
    );
  }
  const bytes = (n / blockSize) * typeSize;
  if (!Number.isSafeInteger(bytes)) throw new GgufError("ELEMENT_OVERFLOW", `shape [${shape}] of ${name} is too large`);
  return bytes;
}

/**
 * Map a tensor type id stored in a PowerInfer (PWRI) file to the current ggml numbering.
 * PowerInfer forked the ggml of late 2023: ids 0–15 are unchanged, 16/17/18 were I8/I16/I32, and no
 * higher id existed. Returns undefined for an id PowerInfer's ggml did not define.
 */
export function pwriTypeToGgml(id: number): GGMLType | undefined {
  if (id === 16) return GGMLType.I8;
  if (id === 17) return GGMLType.I16;
  if (id === 18) return GGMLType.I32;
  if (id >= 0 && id <= 15 && isGgmlType(id)) return id;
  return undefined;
}

/**
 * The id PowerInfer's ggml uses for a type, for writing PWRI files; undefined when PowerInfer's ggml
 * has no such type (BF16, IQ*, TQ*, I64, F64, MXFP4, …).
 */
export function ggmlTypeToPwri(type: GGMLType): number | undefined {
  if (type === GGMLType.I8) return 16;
  if (type === GGMLType.I16) return 17;
  if (type === GGMLType.I32) return 18;
  if (type >= 0 && type <= 15 && isGgmlType(type)) return type;
  return undefined;
}
