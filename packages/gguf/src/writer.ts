/**
 * GGUF v3 / PowerInfer-GGUF (PWRI) writer.
 *
 * Layout written (GGUF spec, ggml docs/gguf.md): header, metadata in the given order, tensor infos in
 * the given order with offsets assigned sequentially, zero padding to the alignment, then each
 * tensor's data followed by zero padding to the alignment — the layout ggml's `gguf_write_to_file`
 * and gguf-py produce, so re-writing a file written by either gives identical bytes.
 *
 * PWRI output uses PowerInfer's tensor type ids (late-2023 ggml: I8/I16/I32 = 16/17/18) and refuses
 * types PowerInfer's ggml does not have (BF16, IQ*, TQ*, I64, F64, MXFP4, …).
 */

import * as fs from "node:fs";
import * as nodePath from "node:path";
import { GgufError } from "./errors.js";
import { type GGMLType, ggmlTypeName, ggmlTypeToPwri, isGgmlType, tensorByteLength } from "./ggml-types.js";
import { GGML_MAX_DIMS, GGUF_DEFAULT_ALIGNMENT, type GgufFile, keyProblem, zeroSizedAllowed } from "./reader.js";
import { type GgufValue, GgufValueType, type GgufValueTypeInfo, isValueType, valueTypeSize } from "./values.js";
import { resolveOutputFile } from "./output-path.js";

/** One metadata entry to write. */
export interface GgufMetadataEntry {
  key: string;
  type: GgufValueTypeInfo;
  value: GgufValue;
}

/** One tensor to write. `data` may be a function so large tensors are produced one at a time. */
export interface GgufTensorSpec {
  name: string;
  type: GGMLType;
  /** ggml order, ne0 first; 0 to 4 dimensions. */
  shape: number[];
  /** Exactly `tensorByteLength(type, shape)` bytes. */
  data: Uint8Array | (() => Uint8Array);
}

/** What to write. */
export interface GgufWriteSpec {
  /** Container magic (default `GGUF`). */
  format?: "GGUF" | "PWRI";
  /** Container version (default 3; 2 is also accepted — same layout). */
  version?: number;
  /**
   * Data alignment (default: `general.alignment` from the metadata, else 32). When it differs from 32
   * and the metadata has no `general.alignment`, that key is appended as a uint32.
   */
  alignment?: number;
  /** Entries in order, or the metadata of a parsed file (its stored types are kept). */
  metadata: GgufMetadataEntry[] | Pick<GgufFile, "metadata" | "metadataTypes">;
  tensors: GgufTensorSpec[];
}

/** Metadata of a parsed file as writer entries, in file order. */
export function metadataEntries(file: Pick<GgufFile, "metadata" | "metadataTypes">): GgufMetadataEntry[] {
  const out: GgufMetadataEntry[] = [];
  for (const [key, value] of file.metadata) {
    const type = file.metadataTypes.get(key);
    if (!type) throw new GgufError("BAD_VALUE", `metadata "${key}" has no stored type`);
    out.push({ key, type, value });
  }
  return out;
}

const utf8 = new TextEncoder();
const MAX_NAME = 64; // ggml's GGML_MAX_NAME (including the terminating NUL)

class ByteWriter {
  buf = new Uint8Array(1 << 16);
  dv = new DataView(this.buf.buffer);
  len = 0;

  private grow(n: number): void {
    if (this.len + n <= this.buf.length) return;
    let cap = this.buf.length * 2;
    while (cap < this.len + n) cap *= 2;
    const nb = new Uint8Array(cap);
    nb.set(this.buf.subarray(0, this.len));
    this.buf = nb;
    this.dv = new DataView(nb.buffer);
  }
  bytes(b: Uint8Array): void {
    this.grow(b.length);
    this.buf.set(b, this.len);
    this.len += b.length;
  }
  u32(v: number): void {
    this.grow(4);
    this.dv.setUint32(this.len, v, true);
    this.len += 4;
  }
  u64(v: number | bigint): void {
    this.grow(8);
    this.dv.setBigUint64(this.len, BigInt(v), true);
    this.len += 8;
  }
  string(s: string): void {
    const b = utf8.encode(s);
    this.u64(b.length);
    this.bytes(b);
  }
  zeros(n: number): void {
    this.grow(n);
    this.buf.fill(0, this.len, this.len + n);
    this.len += n;
  }
}

const INT_RANGES: Partial<Record<GgufValueType, [number, number]>> = {
  [GgufValueType.UINT8]: [0, 0xff],
  [GgufValueType.INT8]: [-0x80, 0x7f],
  [GgufValueType.UINT16]: [0, 0xffff],
  [GgufValueType.INT16]: [-0x8000, 0x7fff],
  [GgufValueType.UINT32]: [0, 0xffffffff],
  [GgufValueType.INT32]: [-0x80000000, 0x7fffffff],
};

function badValue(key: string, msg: string): never {
  throw new GgufError("BAD_VALUE", `metadata "${key}": ${msg}`);
}

function writeScalar(w: ByteWriter, t: GgufValueType, v: unknown, key: string): void {
  const size = valueTypeSize(t);
  const range = INT_RANGES[t];
  if (range) {
    if (typeof v !== "number" || !Number.isInteger(v) || v < range[0] || v > range[1]) {
      badValue(key, `expected an integer in [${range[0]}, ${range[1]}] for ${GgufValueType[t]}, found ${String(v)}`);
    }
  }
  if ((t === GgufValueType.FLOAT32 || t === GgufValueType.FLOAT64) && typeof v !== "number") {
    badValue(key, `expected a number for ${GgufValueType[t]}, found ${typeof v}`);
  }
  let big = 0n;
  if (t === GgufValueType.UINT64 || t === GgufValueType.INT64) {
    if (typeof v === "bigint") big = v;
    else if (typeof v === "number" && Number.isSafeInteger(v)) big = BigInt(v);
    else badValue(key, `expected a bigint or safe integer for ${GgufValueType[t]}, found ${String(v)}`);
    const ok = t === GgufValueType.UINT64 ? big >= 0n && big < 1n << 64n : big >= -(1n << 63n) && big < 1n << 63n;
    if (!ok) badValue(key, `${big} is out of range for ${GgufValueType[t]}`);
  }
  if (t === GgufValueType.BOOL && typeof v !== "boolean") badValue(key, `expected a boolean, found ${typeof v}`);
  const at = w.len;
  w.zeros(size);
  const dv = w.dv;
  switch (t) {
    case GgufValueType.UINT8:
      dv.setUint8(at, v as number);
      break;
    case GgufValueType.INT8:
      dv.setInt8(at, v as number);
      break;
    case GgufValueType.UINT16:
      dv.setUint16(at, v as number, true);
      break;
    case GgufValueType.INT16:
      dv.setInt16(at, v as number, true);
      break;
    case GgufValueType.UINT32:
      dv.setUint32(at, v as number, true);
      break;
    case GgufValueType.INT32:
      dv.setInt32(at, v as number, true);
      break;
    case GgufValueType.FLOAT32:
      dv.setFloat32(at, v as number, true);
      break;
    case GgufValueType.FLOAT64:
      dv.setFloat64(at, v as number, true);
      break;
    case GgufValueType.BOOL:
      dv.setUint8(at, v ? 1 : 0);
      break;
    case GgufValueType.UINT64:
      dv.setBigUint64(at, big, true);
      break;
    case GgufValueType.INT64:
      dv.setBigInt64(at, big, true);
      break;
    default:
      badValue(key, `not a scalar type ${t}`);
  }
}

/** Type info of an inner array of an array-of-arrays, when the caller did not give one. */
function inferArrayInfo(v: unknown, key: string): GgufValueTypeInfo {
  const A = GgufValueType.ARRAY;
  if (v instanceof Uint8Array) return { type: A, itemType: GgufValueType.UINT8 };
  if (v instanceof Int8Array) return { type: A, itemType: GgufValueType.INT8 };
  if (v instanceof Uint16Array) return { type: A, itemType: GgufValueType.UINT16 };
  if (v instanceof Int16Array) return { type: A, itemType: GgufValueType.INT16 };
  if (v instanceof Uint32Array) return { type: A, itemType: GgufValueType.UINT32 };
  if (v instanceof Int32Array) return { type: A, itemType: GgufValueType.INT32 };
  if (v instanceof Float32Array) return { type: A, itemType: GgufValueType.FLOAT32 };
  if (v instanceof Float64Array) return { type: A, itemType: GgufValueType.FLOAT64 };
  if (v instanceof BigUint64Array) return { type: A, itemType: GgufValueType.UINT64 };
  if (v instanceof BigInt64Array) return { type: A, itemType: GgufValueType.INT64 };
  if (Array.isArray(v) && v.length > 0 && v.every((x) => typeof x === "string"))
    return { type: A, itemType: GgufValueType.STRING };
  if (Array.isArray(v) && v.length > 0 && v.every((x) => typeof x === "boolean"))
    return { type: A, itemType: GgufValueType.BOOL };
  return badValue(key, "cannot infer the type of an inner array; give `items` in the type info");
}

function writeValue(w: ByteWriter, info: GgufValueTypeInfo, v: unknown, key: string, depth = 0): void {
  if (!isValueType(info.type)) badValue(key, `unknown value type ${info.type}`);
  if (info.type === GgufValueType.STRING) {
    if (typeof v !== "string") badValue(key, `expected a string, found ${typeof v}`);
    w.string(v);
    return;
  }
  if (info.type !== GgufValueType.ARRAY) {
    writeScalar(w, info.type, v, key);
    return;
  }
  if (depth > 32) badValue(key, "arrays nested too deeply");
  const itemType = info.itemType;
  if (!isValueType(itemType)) badValue(key, `unknown array item type ${itemType}`);
  if (!Array.isArray(v) && !(ArrayBuffer.isView(v) && !(v instanceof DataView))) {
    badValue(key, `expected an array, found ${typeof v}`);
  }
  const arr = v as ArrayLike<unknown>;
  w.u32(itemType);
  w.u64(arr.length);
  if (itemType === GgufValueType.ARRAY) {
    for (let i = 0; i < arr.length; i++) {
      const inner = info.items?.[i] ?? inferArrayInfo(arr[i], key);
      writeValue(w, inner, arr[i], key, depth + 1);
    }
    return;
  }
  if (itemType === GgufValueType.STRING) {
    for (let i = 0; i < arr.length; i++) {
      const s = arr[i];
      if (typeof s !== "string") badValue(key, `item ${i}: expected a string, found ${typeof s}`);
      w.string(s);
    }
    return;
  }
  const ctor = TYPED_ARRAY_OF[itemType];
  if (HOST_LE && ctor && v instanceof ctor) {
    const t = v as unknown as ArrayBufferView;
    w.bytes(new Uint8Array(t.buffer, t.byteOffset, t.byteLength));
    return;
  }
  for (let i = 0; i < arr.length; i++) writeScalar(w, itemType, arr[i], key);
}

const HOST_LE = new Uint8Array(new Uint16Array([1]).buffer)[0] === 1;
// biome-ignore lint/suspicious/noExplicitAny: constructors of the typed arrays
const TYPED_ARRAY_OF: Partial<Record<GgufValueType, new (...args: any[]) => ArrayBufferView>> = {
  [GgufValueType.UINT8]: Uint8Array,
  [GgufValueType.INT8]: Int8Array,
  [GgufValueType.UINT16]: Uint16Array,
  [GgufValueType.INT16]: Int16Array,
  [GgufValueType.UINT32]: Uint32Array,
  [GgufValueType.INT32]: Int32Array,
  [GgufValueType.FLOAT32]: Float32Array,
  [GgufValueType.FLOAT64]: Float64Array,
  [GgufValueType.UINT64]: BigUint64Array,
  [GgufValueType.INT64]: BigInt64Array,
};

interface Plan {
  header: Uint8Array;
  dataOffset: number;
  alignment: number;
  tensors: Array<{ spec: GgufTensorSpec; byteLength: number; offset: number }>;
  totalSize: number;
}

function pad(n: number, a: number): number {
  return Math.ceil(n / a) * a;
}

function plan(spec: GgufWriteSpec): Plan {
  const format = spec.format ?? "GGUF";
  if (format !== "GGUF" && format !== "PWRI") throw new GgufError("BAD_VALUE", `unknown format ${String(format)}`);
  const version = spec.version ?? 3;
  if (version !== 2 && version !== 3)
    throw new GgufError("UNSUPPORTED_VERSION", `cannot write GGUF version ${version}`);
  const entries = Array.isArray(spec.metadata) ? [...spec.metadata] : metadataEntries(spec.metadata);

  const keys = new Set<string>();
  for (const e of entries) {
    const problem = typeof e.key === "string" ? keyProblem(e.key) : "metadata key is not a string";
    if (problem) throw new GgufError("BAD_KEY", problem);
    if (keys.has(e.key)) throw new GgufError("DUPLICATE_KEY", `duplicate metadata key "${e.key}"`);
    keys.add(e.key);
  }
  const alignEntry = entries.find((e) => e.key === "general.alignment");
  let alignment = spec.alignment ?? GGUF_DEFAULT_ALIGNMENT;
  if (alignEntry) {
    if (alignEntry.type.type !== GgufValueType.UINT32 || typeof alignEntry.value !== "number") {
      throw new GgufError("BAD_VALUE", `metadata "general.alignment" must be a uint32`);
    }
    if (spec.alignment !== undefined && spec.alignment !== alignEntry.value) {
      throw new GgufError(
        "BAD_VALUE",
        `alignment ${spec.alignment} contradicts metadata "general.alignment" = ${alignEntry.value}`,
      );
    }
    alignment = alignEntry.value;
  }
  if (!Number.isInteger(alignment) || alignment <= 0 || alignment > 0xffffffff || (alignment & (alignment - 1)) !== 0) {
    throw new GgufError("BAD_VALUE", `"general.alignment" must be a non-zero power of two, got ${alignment}`);
  }
  if (!alignEntry && alignment !== GGUF_DEFAULT_ALIGNMENT) {
    entries.push({ key: "general.alignment", type: { type: GgufValueType.UINT32 }, value: alignment });
  }

  const w = new ByteWriter();
  w.bytes(utf8.encode(format));
  w.u32(version);
  w.u64(spec.tensors.length);
  w.u64(entries.length);
  for (const e of entries) {
    w.string(e.key);
    w.u32(e.type.type);
    writeValue(w, e.type, e.value, e.key);
  }

  const arch = entries.find((e) => e.key === "general.architecture")?.value;
  const names = new Set<string>();
  const tensors: Plan["tensors"] = [];
  let offset = 0;
  for (const t of spec.tensors) {
    if (names.has(t.name)) throw new GgufError("DUPLICATE_TENSOR", `duplicate tensor name "${t.name}"`);
    names.add(t.name);
    const nameBytes = utf8.encode(t.name);
    if (nameBytes.length >= MAX_NAME) {
      throw new GgufError(
        "BAD_VALUE",
        `tensor name "${t.name}" is ${nameBytes.length} bytes; ggml allows at most ${MAX_NAME - 1}`,
      );
    }
    if (t.shape.length > GGML_MAX_DIMS) {
      throw new GgufError(
        "TOO_MANY_DIMS",
        `tensor "${t.name}" has ${t.shape.length} dimensions, at most ${GGML_MAX_DIMS} allowed`,
      );
    }
    if (!isGgmlType(t.type)) throw new GgufError("UNKNOWN_TYPE", `tensor "${t.name}": unknown ggml type id ${t.type}`);
    if (t.shape.some((d) => d === 0) && !zeroSizedAllowed(arch, t.name)) {
      throw new GgufError("BAD_SHAPE", `tensor "${t.name}" has a zero-sized dimension [${t.shape}]`);
    }
    let storedType: number = t.type;
    if (format === "PWRI") {
      const id = ggmlTypeToPwri(t.type);
      if (id === undefined) {
        throw new GgufError(
          "UNSUPPORTED_TYPE",
          `tensor "${t.name}": PowerInfer's ggml has no ${ggmlTypeName(t.type)} type, so a PWRI file cannot hold it (convert it to F32, F16 or a type PowerInfer knows)`,
        );
      }
      storedType = id;
    }
    const byteLength = tensorByteLength(t.type, t.shape);
    w.string(t.name);
    w.u32(t.shape.length);
    for (const d of t.shape) w.u64(d);
    w.u32(storedType);
    w.u64(offset);
    tensors.push({ spec: t, byteLength, offset });
    offset += pad(byteLength, alignment);
  }
  // Files without tensors end right after the header (llama.cpp's vocab-only files are written so).
  const dataOffset = tensors.length > 0 ? pad(w.len, alignment) : w.len;
  w.zeros(dataOffset - w.len);
  return { header: w.buf.subarray(0, w.len), dataOffset, alignment, tensors, totalSize: dataOffset + offset };
}

function tensorData(t: GgufTensorSpec, byteLength: number): Uint8Array {
  const data = typeof t.data === "function" ? t.data() : t.data;
  if (!(data instanceof Uint8Array)) throw new GgufError("BAD_VALUE", `tensor "${t.name}": data must be a Uint8Array`);
  if (data.length !== byteLength) {
    throw new GgufError(
      "BAD_VALUE",
      `tensor "${t.name}": ${ggmlTypeName(t.type)} [${t.shape}] needs ${byteLength} bytes of data, got ${data.length}`,
    );
  }
  return data;
}

/**
 * Serialize a GGUF / PWRI file in memory.
 * @throws GgufError `BAD_VALUE` (value does not match its type, wrong data length, bad alignment),
 *   `BAD_KEY` (empty key, control characters), `DUPLICATE_KEY`, `DUPLICATE_TENSOR`, `TOO_MANY_DIMS`, `BAD_SHAPE`, `UNKNOWN_TYPE`,
 *   `UNSUPPORTED_TYPE` (type PowerInfer lacks, in PWRI output)
 */
export function serializeGguf(spec: GgufWriteSpec): Uint8Array {
  const p = plan(spec);
  const out = new Uint8Array(p.totalSize);
  out.set(p.header, 0);
  for (const t of p.tensors) out.set(tensorData(t.spec, t.byteLength), p.dataOffset + t.offset);
  return out;
}

/**
 * Write a GGUF / PWRI file. Data goes to a temporary file in the same directory, which is renamed over
 * the output only when complete: on any error nothing is left half-written. A symbolic link is followed
 * (its target gets the file); a folder, FIFO or device in place of the output is refused
 * ({@link resolveOutputFile}).
 * @throws GgufError as {@link serializeGguf}, and `IO` for file-system failures
 */
export function writeGguf(output: string, spec: GgufWriteSpec): void {
  const p = plan(spec);
  const path = resolveOutputFile(output);
  const dir = nodePath.dirname(path);
  const tmp = nodePath.join(
    dir,
    `.${nodePath.basename(path)}.${process.pid}.${Math.random().toString(36).slice(2)}.tmp`,
  );
  let fd: number | undefined;
  const writeAll = (b: Uint8Array) => {
    let done = 0;
    while (done < b.length) done += fs.writeSync(fd as number, b, done, b.length - done);
  };
  try {
    try {
      fd = fs.openSync(tmp, "wx");
    } catch (e) {
      throw new GgufError("IO", `cannot create ${tmp}: ${(e as Error).message}`, { path, cause: e });
    }
    try {
      writeAll(p.header);
      const zeros = new Uint8Array(p.alignment);
      for (const t of p.tensors) {
        writeAll(tensorData(t.spec, t.byteLength));
        const padding = pad(t.byteLength, p.alignment) - t.byteLength;
        if (padding > 0) writeAll(zeros.subarray(0, padding));
      }
      fs.fsyncSync(fd);
      fs.closeSync(fd);
      fd = undefined;
      fs.renameSync(tmp, path);
    } catch (e) {
      if (e instanceof GgufError) throw e;
      throw new GgufError("IO", `cannot write: ${(e as Error).message}`, { path, cause: e });
    }
  } catch (e) {
    if (fd !== undefined) fs.closeSync(fd);
    fs.rmSync(tmp, { force: true });
    throw e;
  }
}
