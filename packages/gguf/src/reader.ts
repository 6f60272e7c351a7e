/**
 * GGUF / PowerInfer-GGUF reader.
 *
 * Layout (GGUF spec, ggml docs/gguf.md; little-endian throughout):
 * ```
 * magic u32 ("GGUF", or "PWRI" for PowerInfer files) | version u32 (2 or 3)
 * tensor_count u64 | metadata_kv_count u64
 * metadata_kv[]: key string, value_type u32, value
 * tensor_info[]: name string, n_dims u32, ne u64[n_dims], type u32, offset u64 (relative to the data section)
 * padding to general.alignment (default 32), then the data section
 * string = len u64 + UTF-8 bytes; array = item_type u32 + count u64 + items
 * ```
 * Only the header is read (ranged reads of the file); tensor data stays on disk and is described by
 * (fileOffset, byteLength, type, shape) so a native backend can mmap it. {@link readTensorBytes} does a
 * ranged read of one tensor for tools and tests.
 *
 * Strings are decoded as UTF-8 (a leading BOM is kept); invalid UTF-8 becomes U+FFFD, so such a string
 * would not be written back byte-identically (no shared model contains one).
 */

import * as fs from "node:fs";
import { GgufError, type GgufErrorCode } from "./errors.js";
import { GGML_TYPE_INFO, type GGMLType, isGgmlType, pwriTypeToGgml } from "./ggml-types.js";
import { dequantize } from "./quant.js";
import type { GgufShard } from "./split.js";
import { type GgufValue, GgufValueType, type GgufValueTypeInfo, isValueType, valueTypeSize } from "./values.js";

/** Default `general.alignment` (GGUF spec). */
export const GGUF_DEFAULT_ALIGNMENT = 32;
/** ggml's GGML_MAX_DIMS. */
export const GGML_MAX_DIMS = 4;
/** Nesting limit for arrays of arrays (guards the parser's stack on hostile input). */
const MAX_ARRAY_DEPTH = 32;
const HOST_LE = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;

/** One tensor described by the header. All sizes in bytes, all offsets absolute unless stated. */
export interface GgufTensorInfo {
  /** Tensor name, e.g. `blk.0.ffn_up.weight`. */
  name: string;
  /** ggml type in current ggml numbering (PWRI ids 16–18 are mapped to I8/I16/I32). */
  type: GGMLType;
  /** Dimensions in ggml order: ne0 (the contiguous row length) first. */
  shape: number[];
  /** Product of `shape`. */
  nElements: number;
  /** Bytes of tensor data (`nElements / blockSize * typeSize`). */
  byteLength: number;
  /** Offset of the data relative to the data section (a multiple of the alignment). */
  offset: number;
  /** Absolute file offset of the data (`dataOffset + offset`) in the file holding it. */
  fileOffset: number;
  /**
   * File holding the data when it is not `GgufFile.path`: the shard of a split model (set for every
   * tensor of a model opened with `openGgufModel` from a first shard).
   */
  path?: string;
}

/**
 * Whether a tensor may have a zero-sized dimension: only a PowerInfer GPU index's `blk.N.gpu_bucket`
 * (a layer with no GPU neurons); weights may not.
 */
export function zeroSizedAllowed(architecture: unknown, tensorName: string): boolean {
  return architecture === "generic.gpu_index" && tensorName.endsWith(".gpu_bucket");
}

/** A parsed GGUF or PWRI header. */
export interface GgufFile {
  /** Path it was read from (or the name given to {@link parseGgufBuffer}). */
  path: string;
  /** Container magic: plain GGUF or PowerInfer's PWRI. */
  format: "GGUF" | "PWRI";
  /** Container version (2 or 3). */
  version: number;
  /** Data alignment in bytes (`general.alignment`, default 32). */
  alignment: number;
  /** Absolute file offset of the tensor data section. */
  dataOffset: number;
  /** Size of the file (or buffer) in bytes. */
  fileSize: number;
  /** Metadata values in file order. */
  metadata: Map<string, GgufValue>;
  /** Stored type of each metadata value (for exact round-trips). */
  metadataTypes: Map<string, GgufValueTypeInfo>;
  /** Tensors in file order. */
  tensors: GgufTensorInfo[];
  /** Tensors by name. */
  tensorMap: Map<string, GgufTensorInfo>;
  /**
   * The shards, in order, of a split model opened from its first shard with `openGgufModel`
   * (`path` is then the first shard; `fileSize`, `dataOffset` and `alignment` are the first shard's).
   */
  splits?: GgufShard[];
}

interface ByteSource {
  size: number;
  /** Whole content when in memory. */
  whole?: Uint8Array;
  read(offset: number, length: number): Uint8Array;
}

const bufferSources = new WeakMap<GgufFile, Uint8Array>();
/** Header bytes fetched per ranged read (headers are KiBs; vocab-heavy ones a few MiB). */
const CHUNK = 64 * 1024;
// ignoreBOM keeps a leading U+FEFF in the string (the default would strip it and break round-trips).
const utf8 = new TextDecoder("utf-8", { ignoreBOM: true });
/** Keys must be valid UTF-8: decoding them fails instead of substituting U+FFFD. */
const utf8Strict = new TextDecoder("utf-8", { ignoreBOM: true, fatal: true });
// C0 controls, DEL and C1 controls.
const CONTROL_CHAR = /[\u0000-\u001f\u007f-\u009f]/;
/** The GGUF specification's naming convention: lower_snake_case segments separated by dots. */
const KEY_CONVENTION = /^[a-z0-9_]+(\.[a-z0-9_]+)*$/;

/**
 * Why a metadata key breaks the GGUF naming convention (ASCII lower_snake_case segments separated by
 * dots, at most 65535 bytes), or undefined when it follows it. Such keys are read (a warning, not an
 * error); see {@link GgufErrorCode} `BAD_KEY` for keys that are refused.
 */
export function keyConventionProblem(key: string): string | undefined {
  if (KEY_CONVENTION.test(key) && key.length <= 65535) return undefined;
  if (key.length > 65535) return `metadata key "${key.slice(0, 40)}…" is longer than 65535 bytes`;
  return `metadata key ${JSON.stringify(key)} does not follow the GGUF naming convention (ASCII lower_snake_case segments separated by dots)`;
}

/**
 * Why a metadata key is refused — empty, or containing control characters — or undefined when it is
 * acceptable. (Invalid UTF-8 is caught when the key's bytes are decoded.)
 */
export function keyProblem(key: string): string | undefined {
  if (key.length === 0) return "metadata key is empty";
  const m = CONTROL_CHAR.exec(key);
  if (m) {
    const hex = m[0].charCodeAt(0).toString(16).padStart(2, "0");
    const shown = JSON.stringify(key).replace(
      /[\u007f-\u009f]/g,
      (ch) => `\\u${ch.charCodeAt(0).toString(16).padStart(4, "0")}`,
    );
    return `metadata key ${shown} contains the control character U+00${hex.toUpperCase()}`;
  }
  if (/[\ud800-\udbff](?![\udc00-\udfff])|(?<![\ud800-\udbff])[\udc00-\udfff]/.test(key)) {
    return `metadata key ${JSON.stringify(key)} is not valid Unicode (a lone surrogate)`;
  }
  return undefined;
}

class Cursor {
  pos = 0;
  private buf: Uint8Array;
  private bufStart = 0;
  private dv: DataView;

  constructor(
    private readonly src: ByteSource,
    private readonly path: string,
    /** Where the container starts in the file (added to the offsets errors report). */
    private readonly base = 0,
  ) {
    this.buf = src.whole ?? new Uint8Array(0);
    this.dv = new DataView(this.buf.buffer, this.buf.byteOffset, this.buf.byteLength);
  }

  get remaining(): number {
    return this.src.size - this.pos;
  }

  fail(code: GgufErrorCode, message: string, offset = this.pos): never {
    throw new GgufError(code, message, { offset: offset + this.base, path: this.path });
  }

  /** Make [pos, pos+n) addressable in `buf`; return the index of pos in it. */
  private need(n: number, what: string): number {
    if (n > this.src.size - this.pos) {
      this.fail("TRUNCATED", `expected ${n} bytes of ${what}, but the file ends at byte ${this.src.size}`);
    }
    let i = this.pos - this.bufStart;
    if (i < 0 || i + n > this.buf.length) {
      const len = Math.min(Math.max(n, CHUNK), this.src.size - this.pos);
      this.buf = this.src.read(this.pos, len);
      this.bufStart = this.pos;
      this.dv = new DataView(this.buf.buffer, this.buf.byteOffset, this.buf.byteLength);
      i = 0;
    }
    return i;
  }

  u8(what: string): number {
    const i = this.need(1, what);
    this.pos += 1;
    return this.buf[i];
  }
  u32(what: string): number {
    const i = this.need(4, what);
    this.pos += 4;
    return this.dv.getUint32(i, true);
  }
  u64(what: string): bigint {
    const i = this.need(8, what);
    this.pos += 8;
    return this.dv.getBigUint64(i, true);
  }
  /** A view of the next n bytes (valid until the next read). */
  bytes(n: number, what: string): Uint8Array {
    const i = this.need(n, what);
    this.pos += n;
    return this.buf.subarray(i, i + n);
  }

  scalar(t: GgufValueType, what: string): number | bigint | boolean {
    const size = valueTypeSize(t);
    const i = this.need(size, what);
    this.pos += size;
    const dv = this.dv;
    switch (t) {
      case GgufValueType.UINT8:
        return dv.getUint8(i);
      case GgufValueType.INT8:
        return dv.getInt8(i);
      case GgufValueType.UINT16:
        return dv.getUint16(i, true);
      case GgufValueType.INT16:
        return dv.getInt16(i, true);
      case GgufValueType.UINT32:
        return dv.getUint32(i, true);
      case GgufValueType.INT32:
        return dv.getInt32(i, true);
      case GgufValueType.FLOAT32:
        return dv.getFloat32(i, true);
      case GgufValueType.BOOL: {
        const b = dv.getUint8(i);
        if (b > 1) this.fail("BAD_VALUE", `${what}: expected a bool (0 or 1), found ${b}`, this.pos - 1);
        return b === 1;
      }
      case GgufValueType.UINT64:
        return dv.getBigUint64(i, true);
      case GgufValueType.INT64:
        return dv.getBigInt64(i, true);
      case GgufValueType.FLOAT64:
        return dv.getFloat64(i, true);
      default:
        return this.fail("UNKNOWN_TYPE", `${what}: not a scalar type ${t}`);
    }
  }

  /** Read a u64 count/length and check that `count * minItemBytes` bytes remain after it. */
  count(what: string, minItemBytes: number): number {
    const at = this.pos;
    const i = this.need(8, what);
    const lo = this.dv.getUint32(i, true);
    const hi = this.dv.getUint32(i + 4, true);
    this.pos += 8;
    const rem = this.remaining;
    // hi > 0x1fffff means n > 2^53, which no file can hold.
    if (hi > 0x1fffff || (hi * 2 ** 32 + lo) * minItemBytes > rem) {
      const n = (BigInt(hi) << 32n) | BigInt(lo);
      const need = minItemBytes === 1 ? `${n} bytes` : `${n} items of at least ${minItemBytes} bytes`;
      this.fail("LENGTH_PAST_END", `${what} claims ${need}, but only ${rem} bytes remain in the file`, at);
    }
    return hi * 2 ** 32 + lo;
  }

  string(what: string): string {
    const n = this.count(what, 1);
    return decodeUtf8(this.bytes(n, what));
  }

  /** A metadata key: a string that must be non-empty, valid UTF-8 and free of control characters. */
  key(what: string): string {
    const at = this.pos;
    const n = this.count(what, 1);
    const b = this.bytes(n, what);
    let key: string;
    try {
      key = utf8Strict.decode(b);
    } catch {
      const hex = Array.from(b.subarray(0, 32), (x) => x.toString(16).padStart(2, "0")).join(" ");
      this.fail("BAD_KEY", `${what} is not valid UTF-8 (bytes ${hex}${b.length > 32 ? " …" : ""})`, at);
    }
    const problem = keyProblem(key);
    if (problem) this.fail("BAD_KEY", key.length === 0 ? `${what} is empty` : problem, at);
    return key;
  }

  typedArray(t: GgufValueType, n: number, what: string): GgufValue {
    const size = valueTypeSize(t);
    const src = this.bytes(n * size, what);
    const copy = new Uint8Array(n * size);
    copy.set(src);
    if (!HOST_LE && size > 1) byteSwapInPlace(copy, size);
    const b = copy.buffer;
    switch (t) {
      case GgufValueType.UINT8:
        return copy;
      case GgufValueType.INT8:
        return new Int8Array(b);
      case GgufValueType.UINT16:
        return new Uint16Array(b);
      case GgufValueType.INT16:
        return new Int16Array(b);
      case GgufValueType.UINT32:
        return new Uint32Array(b);
      case GgufValueType.INT32:
        return new Int32Array(b);
      case GgufValueType.FLOAT32:
        return new Float32Array(b);
      case GgufValueType.UINT64:
        return new BigUint64Array(b);
      case GgufValueType.INT64:
        return new BigInt64Array(b);
      case GgufValueType.FLOAT64:
        return new Float64Array(b);
      default:
        return this.fail("UNKNOWN_TYPE", `${what}: not a numeric type ${t}`);
    }
  }

  value(t: GgufValueType, what: string, depth: number): { value: GgufValue; info: GgufValueTypeInfo } {
    if (t === GgufValueType.STRING) return { value: this.string(what), info: { type: t } };
    if (t !== GgufValueType.ARRAY) return { value: this.scalar(t, what), info: { type: t } };
    if (depth >= MAX_ARRAY_DEPTH) this.fail("BAD_VALUE", `${what}: arrays nested deeper than ${MAX_ARRAY_DEPTH}`);
    const typeAt = this.pos;
    const itemType = this.u32(`${what} array item type`);
    if (!isValueType(itemType)) this.fail("UNKNOWN_TYPE", `${what}: unknown array item type ${itemType}`, typeAt);
    const minItem =
      itemType === GgufValueType.STRING ? 8 : itemType === GgufValueType.ARRAY ? 12 : valueTypeSize(itemType);
    const n = this.count(what, minItem);
    if (itemType === GgufValueType.STRING) {
      const out: string[] = new Array(n);
      for (let i = 0; i < n; i++) out[i] = this.string(what);
      return { value: out, info: { type: GgufValueType.ARRAY, itemType } };
    }
    if (itemType === GgufValueType.BOOL) {
      const out: boolean[] = new Array(n);
      for (let i = 0; i < n; i++) out[i] = this.scalar(itemType, what) as boolean;
      return { value: out, info: { type: GgufValueType.ARRAY, itemType } };
    }
    if (itemType === GgufValueType.ARRAY) {
      const out: GgufValue[] = new Array(n);
      const items: GgufValueTypeInfo[] = new Array(n);
      for (let i = 0; i < n; i++) {
        const r = this.value(GgufValueType.ARRAY, what, depth + 1);
        out[i] = r.value;
        items[i] = r.info;
      }
      return { value: out, info: { type: GgufValueType.ARRAY, itemType, items } };
    }
    return { value: this.typedArray(itemType, n, what), info: { type: GgufValueType.ARRAY, itemType } };
  }
}

function byteSwapInPlace(b: Uint8Array, size: number): void {
  for (let i = 0; i < b.length; i += size) b.subarray(i, i + size).reverse();
}

function decodeUtf8(b: Uint8Array): string {
  if (b.length < 64) {
    let ascii = true;
    for (let i = 0; i < b.length; i++) {
      if (b[i] >= 0x80) {
        ascii = false;
        break;
      }
    }
    if (ascii) return String.fromCharCode.apply(null, b as unknown as number[]);
  }
  return utf8.decode(b);
}

const MAX_I64 = (1n << 63n) - 1n;
const MAX_SAFE = BigInt(Number.MAX_SAFE_INTEGER);

function parse(src: ByteSource, path: string, base = 0): GgufFile {
  const c: Cursor = new Cursor(src, path, base);
  const magicBytes = c.bytes(4, "magic");
  const magic = String.fromCharCode(...magicBytes);
  if (magic !== "GGUF" && magic !== "PWRI") {
    const hex = Array.from(magicBytes, (b) => b.toString(16).padStart(2, "0")).join(" ");
    c.fail("BAD_MAGIC", `expected magic "GGUF" or "PWRI", found bytes ${hex}`, 0);
  }
  const format = magic as "GGUF" | "PWRI";
  const version = c.u32("version");
  if (version !== 2 && version !== 3) {
    const swapped =
      ((version & 0xff) << 24) | ((version & 0xff00) << 8) | ((version >>> 8) & 0xff00) | (version >>> 24);
    const hint =
      version === 1
        ? " (GGUF v1 is not supported)"
        : swapped === 2 || swapped === 3
          ? " (this looks like a big-endian file, which is not supported)"
          : "";
    c.fail("UNSUPPORTED_VERSION", `expected GGUF version 2 or 3, found ${version}${hint}`, 4);
  }
  const tensorCountAt = c.pos;
  const tensorCount = c.u64("tensor count");
  const kvCountAt = c.pos;
  // A kv needs at least 8 (key length) + 4 (type) + 1 (smallest value) bytes.
  const kvCount = c.u64("metadata kv count");
  if (kvCount * 13n > BigInt(c.remaining)) {
    c.fail("LENGTH_PAST_END", `metadata kv count ${kvCount} needs more than the ${c.remaining} bytes left`, kvCountAt);
  }

  const metadata = new Map<string, GgufValue>();
  const metadataTypes = new Map<string, GgufValueTypeInfo>();
  let alignment = GGUF_DEFAULT_ALIGNMENT;
  for (let i = 0; i < Number(kvCount); i++) {
    const keyAt = c.pos;
    const key = c.key(`metadata key #${i}`);
    if (metadata.has(key)) c.fail("DUPLICATE_KEY", `duplicate metadata key "${key}"`, keyAt);
    const typeAt = c.pos;
    const type = c.u32(`type of "${key}"`);
    if (!isValueType(type)) c.fail("UNKNOWN_TYPE", `metadata "${key}": unknown value type ${type}`, typeAt);
    const valueAt = c.pos;
    const { value, info } = c.value(type, `metadata "${key}"`, 0);
    metadata.set(key, value);
    metadataTypes.set(key, info);
    if (key === "general.alignment") {
      if (type !== GgufValueType.UINT32) {
        c.fail("BAD_VALUE", `general.alignment must be a uint32, found value type ${type}`, typeAt);
      }
      const a = value as number;
      if (a === 0 || (a & (a - 1)) !== 0) {
        c.fail("BAD_VALUE", `general.alignment must be a non-zero power of two, found ${a}`, valueAt);
      }
      alignment = a;
    }
  }

  // A tensor info needs at least 8 (name length) + 4 (n_dims) + 4 (type) + 8 (offset) bytes.
  if (tensorCount * 24n > BigInt(c.remaining)) {
    c.fail(
      "LENGTH_PAST_END",
      `tensor count ${tensorCount} needs more than the ${c.remaining} bytes left`,
      tensorCountAt,
    );
  }
  const tensors: GgufTensorInfo[] = [];
  const tensorMap = new Map<string, GgufTensorInfo>();
  const offsetFieldAt: number[] = [];
  const arch = metadata.get("general.architecture");
  for (let i = 0; i < Number(tensorCount); i++) {
    const nameAt = c.pos;
    const name = c.string(`tensor #${i} name`);
    if (tensorMap.has(name)) c.fail("DUPLICATE_TENSOR", `duplicate tensor name "${name}"`, nameAt);
    const dimsAt = c.pos;
    const nDims = c.u32(`tensor "${name}" n_dims`);
    if (nDims > GGML_MAX_DIMS) {
      c.fail("TOO_MANY_DIMS", `tensor "${name}" has ${nDims} dimensions, expected at most ${GGML_MAX_DIMS}`, dimsAt);
    }
    const shape: number[] = [];
    let n = 1n;
    for (let d = 0; d < nDims; d++) {
      const neAt = c.pos;
      const ne = c.u64(`tensor "${name}" ne[${d}]`);
      if (ne > MAX_I64) c.fail("ELEMENT_OVERFLOW", `tensor "${name}" ne[${d}] = ${ne} does not fit in int64`, neAt);
      if (ne === 0n && !zeroSizedAllowed(arch, name)) {
        c.fail("BAD_SHAPE", `tensor "${name}" has a zero-sized dimension (ne[${d}] = 0)`, neAt);
      }
      n *= ne;
      if (n > MAX_SAFE) {
        c.fail("ELEMENT_OVERFLOW", `tensor "${name}" has more than 2^53-1 elements (overflow at ne[${d}])`, neAt);
      }
      shape.push(Number(ne));
    }
    const typeAt = c.pos;
    const rawType = c.u32(`tensor "${name}" type`);
    const type = format === "PWRI" ? pwriTypeToGgml(rawType) : isGgmlType(rawType) ? rawType : undefined;
    if (type === undefined) {
      const numbering = format === "PWRI" ? "PowerInfer (late-2023 ggml) numbering" : "current ggml numbering";
      c.fail("UNKNOWN_TYPE", `tensor "${name}": unknown ggml type id ${rawType} (${numbering})`, typeAt);
    }
    const { blockSize, typeSize, name: typeName } = GGML_TYPE_INFO[type];
    const ne0 = shape.length > 0 ? shape[0] : 1;
    if (ne0 % blockSize !== 0) {
      c.fail(
        "BAD_SHAPE",
        `tensor "${name}": row length ${ne0} is not a multiple of the ${typeName} block size ${blockSize}`,
        dimsAt,
      );
    }
    const nElements = Number(n);
    const byteLength = (nElements / blockSize) * typeSize;
    if (!Number.isSafeInteger(byteLength)) c.fail("ELEMENT_OVERFLOW", `tensor "${name}" byte size overflows`, dimsAt);
    const offAt = c.pos;
    const off = c.u64(`tensor "${name}" data offset`);
    if (off > MAX_SAFE) c.fail("TENSOR_OUT_OF_BOUNDS", `tensor "${name}": data offset ${off} is past any file`, offAt);
    const offset = Number(off);
    if (offset % alignment !== 0) {
      c.fail(
        "MISALIGNED",
        `tensor "${name}": data offset ${offset} is not a multiple of the alignment ${alignment}`,
        offAt,
      );
    }
    const t: GgufTensorInfo = { name, type, shape, nElements, byteLength, offset, fileOffset: 0 };
    tensors.push(t);
    tensorMap.set(name, t);
    offsetFieldAt.push(offAt);
  }
  const dataOffset = Math.ceil(c.pos / alignment) * alignment;
  for (let i = 0; i < tensors.length; i++) {
    const t = tensors[i];
    t.fileOffset = dataOffset + t.offset;
    if (t.fileOffset + t.byteLength > src.size) {
      c.fail(
        "TENSOR_OUT_OF_BOUNDS",
        `tensor "${t.name}": data [${t.fileOffset}, ${t.fileOffset + t.byteLength}) extends past the end of the file (${src.size} bytes)`,
        offsetFieldAt[i],
      );
    }
  }
  // no two tensors share bytes (a type or offset changed in the header would otherwise read another
  // tensor's data as this one's)
  const order = tensors.map((_, i) => i).filter((i) => tensors[i]!.byteLength > 0);
  order.sort((a, b) => tensors[a]!.offset - tensors[b]!.offset);
  for (let j = 1; j < order.length; j++) {
    const prev = tensors[order[j - 1]!]!;
    const t = tensors[order[j]!]!;
    if (t.offset < prev.offset + prev.byteLength) {
      c.fail(
        "TENSOR_OVERLAP",
        `tensor "${t.name}": data at offset ${t.offset} overlaps tensor "${prev.name}" [${prev.offset}, ${prev.offset + prev.byteLength}) in the data section`,
        offsetFieldAt[order[j]!],
      );
    }
  }
  if (base !== 0) for (const t of tensors) t.fileOffset += base;
  return {
    path,
    format,
    version,
    alignment,
    dataOffset: dataOffset + base,
    fileSize: src.size + base,
    metadata,
    metadataTypes,
    tensors,
    tensorMap,
  };
}

/**
 * Parse a GGUF / PWRI file held in memory (the whole file, or a prefix of it: tensors whose data
 * lies past the end raise `TENSOR_OUT_OF_BOUNDS`).
 * @param buf file bytes
 * @param path name used in error messages and `GgufFile.path` (default `"<buffer>"`)
 * @throws GgufError with the byte offset of the bad field (see {@link GgufErrorCode})
 */
export function parseGgufBuffer(buf: Uint8Array, path = "<buffer>"): GgufFile {
  const src: ByteSource = { size: buf.length, whole: buf, read: (o, n) => buf.subarray(o, o + n) };
  const file = parse(src, path);
  bufferSources.set(file, buf);
  return file;
}

function ioError(path: string, what: string, e: unknown): GgufError {
  const msg = e instanceof Error ? e.message : String(e);
  return new GgufError("IO", `cannot ${what}: ${msg}`, { path, cause: e });
}

function readFully(fd: number, pos: number, length: number): Uint8Array {
  const out = new Uint8Array(length);
  let done = 0;
  while (done < length) {
    const n = fs.readSync(fd, out, done, length - done, pos + done);
    if (n === 0) break;
    done += n;
  }
  return done === length ? out : out.subarray(0, done);
}

/**
 * Read the header of a GGUF or PowerInfer GGUF (PWRI) file: metadata and tensor infos, with ranged
 * reads (64 KiB chunks); tensor data is not read. Synchronous.
 * @param path file path
 * @throws GgufError `IO` when the file cannot be opened or read, otherwise a parse error with the
 *   byte offset of the bad field (see {@link GgufErrorCode})
 */
export function openGguf(path: string): GgufFile {
  return openGgufAt(path, 0);
}

/**
 * Read the header of a GGUF container that starts at byte `base` of a file (e.g. the second of several
 * shards joined with `cat`). Offsets in the result (`dataOffset`, tensors' `fileOffset`) and in errors
 * are absolute in the file; `fileSize` is the whole file's.
 * @throws GgufError as {@link openGguf}
 */
export function openGgufAt(path: string, base: number): GgufFile {
  let fd: number;
  try {
    fd = fs.openSync(path, "r");
  } catch (e) {
    throw ioError(path, "open the file", e);
  }
  try {
    let size: number;
    try {
      size = fs.fstatSync(fd).size;
    } catch (e) {
      throw ioError(path, "stat the file", e);
    }
    if (base < 0 || base > size) {
      throw new GgufError("TRUNCATED", `no GGUF container at byte ${base}: the file has ${size} bytes`, { path });
    }
    const src: ByteSource = {
      size: size - base,
      read: (o, n) => {
        try {
          return readFully(fd, base + o, n);
        } catch (e) {
          throw ioError(path, `read ${n} bytes at offset ${base + o}`, e);
        }
      },
    };
    return parse(src, path, base);
  } finally {
    fs.closeSync(fd);
  }
}

/** Look up a tensor by name. @throws GgufError `MISSING_TENSOR` */
export function getTensor(file: GgufFile, name: string): GgufTensorInfo {
  const t = file.tensorMap.get(name);
  if (!t) throw new GgufError("MISSING_TENSOR", `no tensor named "${name}"`, { path: file.path });
  return t;
}

/**
 * The raw bytes of one tensor (`byteLength` bytes at `fileOffset`), read with one ranged read from
 * disk, or a view into the buffer for files from {@link parseGgufBuffer} (do not modify it). `part`: only
 * bytes [offset, offset + length) of the tensor (e.g. one expert of a stack).
 * @throws GgufError `MISSING_TENSOR` for an unknown name, `IO` / `TRUNCATED` on read failure; RangeError
 *   for a part outside the tensor
 */
export function readTensorBytes(
  file: GgufFile,
  tensor: GgufTensorInfo | string,
  part?: { offset: number; length: number },
): Uint8Array {
  const full = typeof tensor === "string" ? getTensor(file, tensor) : tensor;
  if (part && !(part.offset >= 0 && part.length >= 0 && part.offset + part.length <= full.byteLength)) {
    throw new RangeError(
      `bytes [${part.offset}, +${part.length}) are outside tensor "${full.name}" (${full.byteLength} bytes)`,
    );
  }
  // a part: the same read, over the range
  const t = part ? { ...full, fileOffset: full.fileOffset + part.offset, byteLength: part.length } : full;
  const buf = t.path === undefined ? bufferSources.get(file) : undefined;
  if (buf) return buf.subarray(t.fileOffset, t.fileOffset + t.byteLength);
  const path = t.path ?? file.path;
  let fd: number;
  try {
    fd = fs.openSync(path, "r");
  } catch (e) {
    throw ioError(path, "open the file", e);
  }
  try {
    const out = readFully(fd, t.fileOffset, t.byteLength);
    if (out.length !== t.byteLength) {
      throw new GgufError("TRUNCATED", `tensor "${t.name}": file ends before its ${t.byteLength} bytes`, {
        offset: t.fileOffset,
        path,
      });
    }
    return out;
  } catch (e) {
    if (e instanceof GgufError) throw e;
    throw ioError(path, `read tensor "${t.name}"`, e);
  } finally {
    fs.closeSync(fd);
  }
}

/**
 * One tensor dequantized to float32 (ranged read + {@link dequantize}); for tools and tests on small
 * tensors. @throws GgufError as {@link readTensorBytes} and {@link dequantize}
 */
export function readTensorF32(file: GgufFile, tensor: GgufTensorInfo | string): Float32Array {
  const t = typeof tensor === "string" ? getTensor(file, tensor) : tensor;
  return dequantize(t.type, readTensorBytes(file, t), t.nElements);
}
