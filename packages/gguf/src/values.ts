/**
 * GGUF metadata value types (GGUF spec, ggml docs/gguf.md: `enum gguf_metadata_value_type`).
 */

/** GGUF metadata value type ids. */
export enum GgufValueType {
  UINT8 = 0,
  INT8 = 1,
  UINT16 = 2,
  INT16 = 3,
  UINT32 = 4,
  INT32 = 5,
  FLOAT32 = 6,
  BOOL = 7,
  STRING = 8,
  ARRAY = 9,
  UINT64 = 10,
  INT64 = 11,
  FLOAT64 = 12,
}

/**
 * A decoded metadata value.
 * - u8/i8/u16/i16/u32/i32/f32/f64 → `number`; u64/i64 → `bigint`; bool → `boolean`; string → `string`
 * - numeric arrays → the matching typed array (`Uint8Array` … `Float64Array`, `BigUint64Array`, `BigInt64Array`)
 * - bool arrays → `boolean[]`; string arrays → `string[]`; arrays of arrays → `GgufValue[]`
 */
export type GgufValue =
  | number
  | bigint
  | boolean
  | string
  | Uint8Array
  | Int8Array
  | Uint16Array
  | Int16Array
  | Uint32Array
  | Int32Array
  | Float32Array
  | Float64Array
  | BigUint64Array
  | BigInt64Array
  | boolean[]
  | string[]
  | GgufValue[];

/**
 * The stored type of a metadata value, enough to write it back byte-identically.
 * For arrays, `itemType` is the element type; for an array of arrays, `items[i]` describes the i-th
 * inner array (inner arrays may differ in element type).
 */
export type GgufValueTypeInfo =
  | { type: Exclude<GgufValueType, GgufValueType.ARRAY> }
  | { type: GgufValueType.ARRAY; itemType: GgufValueType; items?: GgufValueTypeInfo[] };

/** Bytes of one scalar of a fixed-size value type (0 for STRING / ARRAY). */
export function valueTypeSize(t: GgufValueType): number {
  switch (t) {
    case GgufValueType.UINT8:
    case GgufValueType.INT8:
    case GgufValueType.BOOL:
      return 1;
    case GgufValueType.UINT16:
    case GgufValueType.INT16:
      return 2;
    case GgufValueType.UINT32:
    case GgufValueType.INT32:
    case GgufValueType.FLOAT32:
      return 4;
    case GgufValueType.UINT64:
    case GgufValueType.INT64:
    case GgufValueType.FLOAT64:
      return 8;
    default:
      return 0;
  }
}

/** True if `t` is a defined GGUF metadata value type id. */
export function isValueType(t: number): t is GgufValueType {
  return Number.isInteger(t) && t >= 0 && t <= 12;
}

/** Lower-case spec name of a value type (`uint32`, `string`, …). */
export function valueTypeName(t: GgufValueType | number): string {
  return isValueType(t) ? GgufValueType[t].toLowerCase() : `type#${t}`;
}

/** Shorthand constructors for {@link GgufValueTypeInfo}. */
export const GgufTypes = {
  u8: { type: GgufValueType.UINT8 },
  i8: { type: GgufValueType.INT8 },
  u16: { type: GgufValueType.UINT16 },
  i16: { type: GgufValueType.INT16 },
  u32: { type: GgufValueType.UINT32 },
  i32: { type: GgufValueType.INT32 },
  f32: { type: GgufValueType.FLOAT32 },
  bool: { type: GgufValueType.BOOL },
  string: { type: GgufValueType.STRING },
  u64: { type: GgufValueType.UINT64 },
  i64: { type: GgufValueType.INT64 },
  f64: { type: GgufValueType.FLOAT64 },
  /** An array of scalars of one type. */
  array(itemType: Exclude<GgufValueType, GgufValueType.ARRAY>): GgufValueTypeInfo {
    return { type: GgufValueType.ARRAY, itemType };
  },
} as const satisfies Record<string, GgufValueTypeInfo | ((t: never) => GgufValueTypeInfo)>;
