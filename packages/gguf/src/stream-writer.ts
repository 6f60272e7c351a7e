/**
 * Streaming GGUF / PWRI writer: tensor data comes from producers that yield it in chunks, so a file
 * far larger than memory (a generated 7B-shaped model) is written without holding any tensor whole.
 *
 * The bytes are those {@link serializeGguf} would produce for the same metadata, tensors and data.
 * Before writing, the free space of the target file system is checked (statfs); data goes to a
 * temporary file in the target directory that is renamed over `path` only when complete, so on any
 * error, abort or refusal nothing half-written is left behind.
 */

import * as fs from "node:fs";
import * as nodePath from "node:path";
import { GgufError } from "./errors.js";
import { type GGMLType, ggmlTypeName, ggmlTypeToPwri, isGgmlType, tensorByteLength } from "./ggml-types.js";
import { GGML_MAX_DIMS, GGUF_DEFAULT_ALIGNMENT, zeroSizedAllowed } from "./reader.js";
import { GgufValueType } from "./values.js";
import { type GgufWriteSpec, metadataEntries, serializeGguf } from "./writer.js";
import { resolveOutputFile } from "./output-path.js";

/** One tensor whose data is produced in chunks. */
export interface GgufStreamTensor {
  name: string;
  type: GGMLType;
  /** ggml order, ne0 first; 0 to 4 dimensions. */
  shape: number[];
  /**
   * Yields the tensor's bytes in order, in chunks of any size that add up to exactly
   * `tensorByteLength(type, shape)`. Each chunk is written before the next is asked for, so a producer
   * may refill and yield the same buffer again.
   */
  data: () => Iterable<Uint8Array> | AsyncIterable<Uint8Array>;
}

/** What to write: as {@link GgufWriteSpec}, with streamed tensors. */
export interface GgufStreamSpec extends Omit<GgufWriteSpec, "tensors"> {
  tensors: GgufStreamTensor[];
}

/** Options of {@link writeGgufStreaming}. */
export interface GgufStreamOptions {
  /** Called after each chunk with the bytes written so far and the file size. */
  onProgress?: (written: number, total: number) => void;
  /** Checked between chunks; an abort removes the temporary file and rejects with GgufError `IO`. */
  signal?: AbortSignal;
  /** fsync the file before renaming it (default true). */
  fsync?: boolean;
  /** Free space that must remain on the file system after writing (default 256 MiB). */
  reserveBytes?: number;
  /** Free bytes of the file system holding `dir` (default: statfs; for tests). */
  freeBytes?: (dir: string) => number;
}

interface StreamPlan {
  header: Uint8Array;
  alignment: number;
  tensors: Array<{ spec: GgufStreamTensor; byteLength: number }>;
  totalSize: number;
}

const utf8 = new TextEncoder();
const MAX_NAME = 64; // ggml's GGML_MAX_NAME (including the terminating NUL)
const pad = (n: number, a: number) => Math.ceil(n / a) * a;

function planStream(spec: GgufStreamSpec): StreamPlan {
  const format = spec.format ?? "GGUF";
  // Metadata (and the checks of format, version, alignment, keys and values) as serializeGguf writes it:
  // without tensors the output ends right after the key-value pairs.
  const meta = serializeGguf({ ...spec, tensors: [] });
  const entries = Array.isArray(spec.metadata) ? spec.metadata : metadataEntries(spec.metadata);
  const alignEntry = entries.find((e) => e.key === "general.alignment");
  const alignment =
    alignEntry && alignEntry.type.type === GgufValueType.UINT32
      ? (alignEntry.value as number)
      : (spec.alignment ?? GGUF_DEFAULT_ALIGNMENT);

  const parts: Uint8Array[] = [meta];
  const u32 = (v: number) => {
    const b = new Uint8Array(4);
    new DataView(b.buffer).setUint32(0, v, true);
    parts.push(b);
  };
  const u64 = (v: number) => {
    const b = new Uint8Array(8);
    new DataView(b.buffer).setBigUint64(0, BigInt(v), true);
    parts.push(b);
  };
  const arch = entries.find((e) => e.key === "general.architecture")?.value;
  const names = new Set<string>();
  const tensors: StreamPlan["tensors"] = [];
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
          `tensor "${t.name}": PowerInfer's ggml has no ${ggmlTypeName(t.type)} type, so a PWRI file cannot hold it`,
        );
      }
      storedType = id;
    }
    const byteLength = tensorByteLength(t.type, t.shape);
    u64(nameBytes.length);
    parts.push(nameBytes);
    u32(t.shape.length);
    for (const d of t.shape) u64(d);
    u32(storedType);
    u64(offset);
    tensors.push({ spec: t, byteLength });
    offset += pad(byteLength, alignment);
  }
  let len = parts.reduce((s, p) => s + p.length, 0);
  const dataOffset = tensors.length > 0 ? pad(len, alignment) : len;
  const header = new Uint8Array(dataOffset);
  len = 0;
  for (const p of parts) {
    header.set(p, len);
    len += p.length;
  }
  new DataView(header.buffer).setBigUint64(8, BigInt(tensors.length), true); // tensor count
  return { header, alignment, tensors, totalSize: dataOffset + offset };
}

/**
 * The exact size in bytes of the file {@link writeGgufStreaming} would write for `spec`.
 * @throws GgufError as {@link writeGgufStreaming} for an invalid spec
 */
export function ggufStreamSize(spec: GgufStreamSpec): number {
  return planStream(spec).totalSize;
}

function statfsFree(dir: string): number {
  const s = fs.statfsSync(dir);
  return Number(s.bavail) * Number(s.bsize);
}

const MiB = 2 ** 20;
const fmt = (b: number) => (b >= 2 ** 30 ? `${(b / 2 ** 30).toFixed(2)} GiB` : `${(b / MiB).toFixed(1)} MiB`);

/**
 * Write a GGUF / PWRI file whose tensor data is produced in chunks.
 * @returns the size of the file written
 * @throws GgufError as {@link serializeGguf} for an invalid spec; `BAD_VALUE` when a producer yields
 *   more or fewer bytes than its tensor needs or something that is not a Uint8Array; `IO` when the
 *   file system has less free space than the file needs (nothing is written then), on abort, and for
 *   file-system failures, or when the output is a folder, FIFO or device (a symbolic link is followed:
 *   {@link resolveOutputFile}). Errors thrown by a producer propagate unchanged. In every case no file
 *   and no temporary file is left behind.
 */
export async function writeGgufStreaming(
  output: string,
  spec: GgufStreamSpec,
  opts: GgufStreamOptions = {},
): Promise<number> {
  const p = planStream(spec);
  const path = resolveOutputFile(output);
  const dir = nodePath.dirname(path);
  const reserve = opts.reserveBytes ?? 256 * MiB;
  let free: number;
  try {
    free = (opts.freeBytes ?? statfsFree)(dir);
  } catch (e) {
    throw new GgufError("IO", `cannot check the free space of ${dir}: ${(e as Error).message}`, { path, cause: e });
  }
  if (p.totalSize + reserve > free) {
    throw new GgufError(
      "IO",
      `not enough disk space: the file needs ${fmt(p.totalSize)} (plus ${fmt(reserve)} kept free), ${dir} has ${fmt(free)} free; nothing was written`,
      { path },
    );
  }
  const tmp = nodePath.join(
    dir,
    `.${nodePath.basename(path)}.${process.pid}.${Math.random().toString(36).slice(2)}.tmp`,
  );
  let fd: number | undefined;
  let written = 0;
  const writeAll = (b: Uint8Array) => {
    let done = 0;
    while (done < b.length) done += fs.writeSync(fd as number, b, done, b.length - done);
    written += b.length;
  };
  const aborted = () => {
    if (opts.signal?.aborted) throw new GgufError("IO", "writing aborted", { path });
  };
  try {
    try {
      fd = fs.openSync(tmp, "wx");
    } catch (e) {
      throw new GgufError("IO", `cannot create ${tmp}: ${(e as Error).message}`, { path, cause: e });
    }
    const io = <T>(fn: () => T): T => {
      try {
        return fn();
      } catch (e) {
        throw new GgufError("IO", `cannot write: ${(e as Error).message}`, { path, cause: e });
      }
    };
    io(() => writeAll(p.header));
    const zeros = new Uint8Array(p.alignment);
    for (const t of p.tensors) {
      let got = 0;
      const what = () => `tensor "${t.spec.name}": ${ggmlTypeName(t.spec.type)} [${t.spec.shape}]`;
      for await (const chunk of t.spec.data()) {
        aborted();
        if (!(chunk instanceof Uint8Array))
          throw new GgufError("BAD_VALUE", `${what()}: data chunks must be Uint8Arrays`);
        if (got + chunk.length > t.byteLength) {
          throw new GgufError("BAD_VALUE", `${what()} needs ${t.byteLength} bytes of data, got more`);
        }
        io(() => writeAll(chunk));
        got += chunk.length;
        opts.onProgress?.(written, p.totalSize);
      }
      if (got !== t.byteLength)
        throw new GgufError("BAD_VALUE", `${what()} needs ${t.byteLength} bytes of data, got ${got}`);
      const padding = pad(t.byteLength, p.alignment) - t.byteLength;
      if (padding > 0) io(() => writeAll(zeros.subarray(0, padding)));
    }
    aborted();
    io(() => {
      if (opts.fsync ?? true) fs.fsyncSync(fd as number);
      fs.closeSync(fd as number);
      fd = undefined;
      fs.renameSync(tmp, path);
    });
    opts.onProgress?.(written, p.totalSize);
    return written;
  } catch (e) {
    if (fd !== undefined) fs.closeSync(fd);
    fs.rmSync(tmp, { force: true });
    throw e;
  }
}
