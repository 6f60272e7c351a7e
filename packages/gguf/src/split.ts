/**
 * Split models (llama.cpp's `gguf-split` layout) and file kinds.
 *
 * A split model is published as shards `NAME-00001-of-0000N.gguf` … `NAME-0000N-of-0000N.gguf`
 * (1-based, five digits). Each shard is a complete GGUF with its own tensor infos and data section,
 * and carries three keys: `split.no` (uint16, 0-based shard number), `split.count` (uint16, number of
 * shards) and `split.tensors.count` (int32, tensors in all shards together). The first shard also
 * holds all of the model's other metadata; the others hold only the split keys. A file merged back by
 * `gguf-split --merge` keeps the first shard's metadata with `split.count` = 0, which means "not split".
 *
 * {@link openGgufModel} opens a model from its first shard: the other shards are found by name,
 * checked, and their tensors described with the path of the shard that holds them, so a backend maps
 * each tensor from its own file (no copy).
 */

import * as fs from "node:fs";
import * as nodePath from "node:path";
import { ACTIVATION_STATS_ARCH } from "./activation-stats.js";
import { GgufError } from "./errors.js";
import { GPU_INDEX_ARCH } from "./gpu-index.js";
import { type GgufFile, type GgufTensorInfo, openGguf, openGgufAt } from "./reader.js";
import { writeGgufStreaming } from "./stream-writer.js";
import { GgufValueType } from "./values.js";
import { type GgufMetadataEntry, metadataEntries } from "./writer.js";

/** `split.no`: 0-based shard number (uint16). */
export const KEY_SPLIT_NO = "split.no";
/** `split.count`: number of shards (uint16; 0 in a merged file). */
export const KEY_SPLIT_COUNT = "split.count";
/** `split.tensors.count`: tensors in all shards together (int32). */
export const KEY_SPLIT_TENSORS_COUNT = "split.tensors.count";

/** The split keys of one shard. */
export interface GgufSplitInfo {
  /** 0-based shard number (`split.no`). */
  no: number;
  /** Number of shards (`split.count`, ≥ 1). */
  count: number;
  /** Tensors in all shards together (`split.tensors.count`). */
  tensorsCount: number;
}

/** One shard of a split model as {@link openGgufModel} found it. */
export interface GgufShard {
  path: string;
  /** Bytes in the shard file. */
  fileSize: number;
  /** Tensors stored in this shard. */
  tensorCount: number;
}

const SPLIT_NAME = /^(.*)-(\d{5})-of-(\d{5})\.gguf$/;

/**
 * The path of shard `no` (0-based) of `count`: `PREFIX-0000{no+1}-of-0000{count}.gguf`, as
 * llama.cpp's gguf-split names them.
 */
export function splitPath(prefix: string, no: number, count: number): string {
  const five = (n: number) => String(n).padStart(5, "0");
  return `${prefix}-${five(no + 1)}-of-${five(count)}.gguf`;
}

/** Prefix, 0-based shard number and count encoded in a shard's file name, or undefined when it has none. */
export function parseSplitPath(path: string): { prefix: string; no: number; count: number } | undefined {
  const m = SPLIT_NAME.exec(path);
  if (!m) return undefined;
  const no = Number(m[2]) - 1;
  const count = Number(m[3]);
  if (no < 0 || count < 1 || no >= count) return undefined;
  return { prefix: m[1], no, count };
}

function splitNumber(file: GgufFile, key: string): number | undefined {
  const v = file.metadata.get(key);
  if (v === undefined) return undefined;
  const n = typeof v === "bigint" ? Number(v) : v;
  if (typeof n !== "number" || !Number.isInteger(n) || n < 0) {
    throw new GgufError("BAD_SPLIT", `metadata "${key}" must be a non-negative integer, found ${String(v)}`, {
      path: file.path,
    });
  }
  return n;
}

/**
 * The split keys of a file, or undefined when it is not a shard (no `split.count`, or `split.count` = 0
 * as in a merged file).
 * @throws GgufError `BAD_SPLIT` when the keys are not non-negative integers, `split.no` ≥ `split.count`,
 *   or `split.no` / `split.tensors.count` is missing
 */
export function splitInfo(file: GgufFile): GgufSplitInfo | undefined {
  const count = splitNumber(file, KEY_SPLIT_COUNT);
  if (count === undefined || count === 0) return undefined;
  const no = splitNumber(file, KEY_SPLIT_NO);
  const tensorsCount = splitNumber(file, KEY_SPLIT_TENSORS_COUNT);
  const fail = (msg: string) => {
    throw new GgufError("BAD_SPLIT", msg, { path: file.path });
  };
  if (no === undefined) fail(`"${KEY_SPLIT_COUNT}" is ${count} but "${KEY_SPLIT_NO}" is missing`);
  if (tensorsCount === undefined) fail(`"${KEY_SPLIT_COUNT}" is ${count} but "${KEY_SPLIT_TENSORS_COUNT}" is missing`);
  if ((no as number) >= count) fail(`"${KEY_SPLIT_NO}" ${no} is not below "${KEY_SPLIT_COUNT}" ${count}`);
  return { no: no as number, count, tensorsCount: tensorsCount as number };
}

/** Absolute end of a file's own GGUF content: its tensor data, each tensor padded to the alignment. */
function contentEnd(file: GgufFile): number {
  let end = file.dataOffset;
  for (const t of file.tensors) {
    end = Math.max(end, t.fileOffset + Math.ceil(t.byteLength / file.alignment) * file.alignment);
  }
  return end;
}

/** Where another GGUF container starts right after this one's own content (shards joined with `cat`), if one does. */
function nextJoined(file: GgufFile): number | undefined {
  const end = contentEnd(file);
  const starts = [end, Math.ceil(end / file.alignment) * file.alignment];
  let fd: number;
  try {
    fd = fs.openSync(file.path, "r");
  } catch {
    return undefined;
  }
  try {
    const b = Buffer.alloc(4);
    for (const at of starts) {
      if (at + 4 > file.fileSize) continue;
      if (fs.readSync(fd, b, 0, 4, at) === 4 && b.toString("latin1") === "GGUF") return at;
    }
    return undefined;
  } finally {
    fs.closeSync(fd);
  }
}

function splitError(path: string, msg: string): GgufError {
  return new GgufError("BAD_SPLIT", msg, { path });
}

/** Checks shard i of `files` against the first shard's split keys. */
function checkShard(f: GgufFile, i: number, info: GgufSplitInfo, where: string): void {
  const s = splitInfo(f);
  if (!s) throw splitError(f.path, `${where}has no "${KEY_SPLIT_COUNT}": not shard ${i + 1} of this model`);
  if (s.count !== info.count) {
    throw splitError(f.path, `${where}"${KEY_SPLIT_COUNT}" is ${s.count}, but the first shard says ${info.count}`);
  }
  if (s.no !== i) {
    throw splitError(
      f.path,
      `${where}"${KEY_SPLIT_NO}" is ${s.no}; as shard ${i + 1} of ${info.count} it must be ${i}`,
    );
  }
}

/** The shards as one model: tensor counts add up, no tensor twice, each tensor with its shard's path. */
function combine(path: string, info: GgufSplitInfo, files: GgufFile[]): GgufFile {
  const first = files[0];
  const total = files.reduce((n, f) => n + f.tensors.length, 0);
  if (total !== info.tensorsCount) {
    throw splitError(
      path,
      `the ${info.count} shards hold ${total} tensors (${files.map((f) => f.tensors.length).join(" + ")}), but "${KEY_SPLIT_TENSORS_COUNT}" is ${info.tensorsCount}`,
    );
  }
  const tensors: GgufTensorInfo[] = [];
  const tensorMap = new Map<string, GgufTensorInfo>();
  const shardOf = new Map<string, number>();
  files.forEach((f, i) => {
    for (const t of f.tensors) {
      const prev = shardOf.get(t.name);
      if (prev !== undefined) {
        throw new GgufError(
          "DUPLICATE_TENSOR",
          `tensor "${t.name}" is in shard ${prev + 1} (${nodePath.basename(files[prev].path)}) and in shard ${i + 1}`,
          { path: f.path },
        );
      }
      shardOf.set(t.name, i);
      const withPath = { ...t, path: f.path };
      tensors.push(withPath);
      tensorMap.set(t.name, withPath);
    }
  });
  return {
    ...first,
    tensors,
    tensorMap,
    splits: files.map((f) => ({ path: f.path, fileSize: f.fileSize, tensorCount: f.tensors.length })),
  };
}

/** Options of {@link openGgufModel}. */
export interface OpenModelOptions {
  /**
   * Accept the shards of a split model joined into one file with `cat` (each shard's container read
   * where the previous one ends; for merging them). Default false: such a file is refused.
   */
  joined?: boolean;
}

/**
 * Open a model file, and when it is the first shard of a split model, all its shards: the result
 * describes the whole model — the first shard's metadata, every shard's tensors in shard order, each
 * tensor with the `path` of the shard holding it — and lists the shards in `splits`. A file that is
 * not split is returned as {@link openGguf} reads it.
 *
 * Checked: every shard `PREFIX-0000i-of-0000N.gguf` exists, has `split.count` N and `split.no` i-1;
 * the shards' tensor counts add up to the first shard's `split.tensors.count`; no tensor is in two
 * shards.
 * @throws GgufError `BAD_SPLIT` for a shard other than the first (the message names the first), a
 *   missing or inconsistent shard, a first shard whose name does not say where the others are, and
 *   shards joined into one file with `cat` (unless `opts.joined`); `DUPLICATE_TENSOR` for a tensor in
 *   two shards; any error of {@link openGguf} for each shard
 */
export function openGgufModel(path: string, opts: OpenModelOptions = {}): GgufFile {
  const first = openGguf(path);
  const info = splitInfo(first);
  if (!info) return first;
  const name = parseSplitPath(path);
  if (info.no !== 0) {
    const firstPath = name && name.count === info.count ? splitPath(name.prefix, 0, info.count) : undefined;
    throw splitError(
      path,
      `this is shard ${info.no + 1} of ${info.count} of a split model; give the first shard${firstPath ? `, ${firstPath}` : ` (the one with "${KEY_SPLIT_NO}" = 0)`}`,
    );
  }
  const files: GgufFile[] = [first];
  if (info.count > 1 && nextJoined(first) !== undefined) {
    if (!opts.joined) {
      throw splitError(
        path,
        `holds the ${info.count} shards of a split model joined into one file (with cat), which no loader reads; keep the shards as separate files (${splitPath("NAME", 0, info.count)} …) and give the first, or make one model file of it with \`powerinfer gguf-split --merge ${path} OUT\``,
      );
    }
    for (let i = 1; i < info.count; i++) {
      const at = nextJoined(files[i - 1]);
      if (at === undefined) {
        throw splitError(path, `the joined file ends after shard ${i} of ${info.count}: shard ${i + 1} is missing`);
      }
      const f = openGgufAt(path, at);
      checkShard(f, i, info, `shard ${i + 1} (at byte ${at}): `);
      files.push(f);
    }
    return combine(path, info, files);
  }
  if (info.count > 1) {
    if (!name || name.count !== info.count || name.no !== 0) {
      throw splitError(
        path,
        `this is shard 1 of ${info.count} of a split model, but its name does not end in -${splitPath("", 0, info.count).slice(1)}, so the other shards cannot be found; give the shards their gguf-split names`,
      );
    }
    for (let i = 1; i < info.count; i++) {
      const p = splitPath(name.prefix, i, info.count);
      if (!fs.existsSync(p)) {
        throw splitError(p, `shard ${i + 1} of ${info.count} of the split model ${nodePath.basename(path)} is missing`);
      }
      const f = openGguf(p);
      checkShard(f, i, info, "");
      files.push(f);
    }
  }
  return combine(path, info, files);
}

/** What a GGUF file holds, as far as running it goes. */
export type GgufFileKind =
  /** Weights (whether or not the architecture is supported). */
  | "model"
  /** A tokenizer (tokenizer.ggml.* keys) and no tensors: llama.cpp's ggml-vocab-*.gguf. */
  | "vocabulary"
  /** A PowerInfer GPU index (neuron placement plan). */
  | "gpu-index"
  /** Activation statistics written by `powerinfer profile`. */
  | "activation-stats"
  /** No tensors and no tokenizer. */
  | "empty";

/** The kind of a file, from its architecture key, tokenizer keys and tensors. */
export function ggufFileKind(file: Pick<GgufFile, "metadata" | "tensors">): GgufFileKind {
  const arch = file.metadata.get("general.architecture");
  if (arch === GPU_INDEX_ARCH) return "gpu-index";
  if (arch === ACTIVATION_STATS_ARCH) return "activation-stats";
  if (file.tensors.length > 0) return "model";
  return file.metadata.has("tokenizer.ggml.tokens") || file.metadata.has("tokenizer.ggml.model")
    ? "vocabulary"
    : "empty";
}

/** One line saying what a non-model file is, or undefined for a model. */
export function notAModelReason(file: Pick<GgufFile, "metadata" | "tensors">): string | undefined {
  switch (ggufFileKind(file)) {
    case "vocabulary":
      return "this is a vocabulary-only file: it holds a tokenizer but no weights";
    case "gpu-index":
      return "this is a PowerInfer GPU index (a neuron placement plan, <model>.generated.gpuidx), not a model: give the model file it was made for";
    case "activation-stats":
      return "this is an activation-statistics file (written by `powerinfer profile`), not a model: give the model file it was measured on";
    case "empty":
      return "this file holds no tensors and no tokenizer: there is no model in it";
    default:
      return undefined;
  }
}

/**
 * Refuse a file that is not a model (before its hyper-parameters are validated).
 * @throws GgufError `NOT_A_MODEL` naming what the file is instead
 */
export function assertModelFile(file: GgufFile): void {
  const reason = notAModelReason(file);
  if (reason) throw new GgufError("NOT_A_MODEL", reason, { path: file.path });
}

/** How {@link planGgufSplit} cuts a model into shards (give one). */
export interface GgufSplitOptions {
  /** At most this many tensors per shard (llama.cpp's `--split-max-tensors`). */
  maxTensors?: number;
  /**
   * At most this many bytes of tensor data per shard, each tensor counted padded to the alignment
   * (llama.cpp's `--split-max-size`); a tensor larger than this gets a shard of its own.
   */
  maxBytes?: number;
}

/**
 * The tensors of each shard, in file order, as llama.cpp's gguf-split cuts them: every `maxTensors`
 * tensors, or before the tensor that would take a shard's data past `maxBytes`.
 * @throws GgufError `BAD_VALUE` unless exactly one of the options is a positive integer;
 *   `BAD_SPLIT` when more than 65535 shards (the uint16 `split.count`) would be needed
 */
export function planGgufSplit(
  file: Pick<GgufFile, "tensors" | "alignment">,
  opts: GgufSplitOptions,
): GgufTensorInfo[][] {
  const { maxTensors, maxBytes } = opts;
  if ((maxTensors === undefined) === (maxBytes === undefined)) {
    throw new GgufError("BAD_VALUE", "give either a maximum tensor count or a maximum size per shard");
  }
  const limit = (maxTensors ?? maxBytes) as number;
  if (!Number.isSafeInteger(limit) || limit < 1) {
    throw new GgufError(
      "BAD_VALUE",
      `the maximum ${maxTensors !== undefined ? "tensor count" : "size"} per shard must be a positive integer, got ${limit}`,
    );
  }
  const shards: GgufTensorInfo[][] = [[]];
  let bytes = 0;
  for (const t of file.tensors) {
    const cur = shards[shards.length - 1];
    const n = Math.ceil(t.byteLength / file.alignment) * file.alignment;
    const full = maxTensors !== undefined ? cur.length >= maxTensors : cur.length > 0 && bytes + n > limit;
    if (full) {
      shards.push([t]);
      bytes = n;
    } else {
      cur.push(t);
      bytes += n;
    }
  }
  if (shards.length > 0xffff) {
    throw new GgufError(
      "BAD_SPLIT",
      `${shards.length} shards would be needed; "split.count" is a uint16 (at most 65535)`,
    );
  }
  return shards;
}

const COPY_CHUNK = 8 * 2 ** 20;

/** A tensor's bytes from its file, in chunks of at most 8 MiB (one buffer, refilled). */
function* tensorChunks(file: GgufFile, t: GgufTensorInfo): Iterable<Uint8Array> {
  const path = t.path ?? file.path;
  const fd = fs.openSync(path, "r");
  try {
    const buf = new Uint8Array(Math.min(COPY_CHUNK, Math.max(1, t.byteLength)));
    let done = 0;
    while (done < t.byteLength) {
      const want = Math.min(buf.length, t.byteLength - done);
      let got = 0;
      while (got < want) {
        const n = fs.readSync(fd, buf, got, want - got, t.fileOffset + done + got);
        if (n === 0) {
          throw new GgufError("TRUNCATED", `tensor "${t.name}": file ends before its ${t.byteLength} bytes`, { path });
        }
        got += n;
      }
      done += want;
      yield buf.subarray(0, want);
    }
  } finally {
    fs.closeSync(fd);
  }
}

function setKey(
  entries: GgufMetadataEntry[],
  key: string,
  type: GgufValueType.UINT16 | GgufValueType.INT32,
  value: number,
): void {
  const e: GgufMetadataEntry = { key, type: { type }, value };
  const i = entries.findIndex((x) => x.key === key);
  if (i >= 0) entries[i] = e;
  else entries.push(e);
}

/** The file's metadata without the split keys (for writing a split model back as one file). */
export function withoutSplitKeys(file: GgufFile): GgufFile {
  const split = [KEY_SPLIT_NO, KEY_SPLIT_COUNT, KEY_SPLIT_TENSORS_COUNT];
  const metadata = new Map([...file.metadata].filter(([k]) => !split.includes(k)));
  const metadataTypes = new Map([...file.metadataTypes].filter(([k]) => !split.includes(k)));
  return { ...file, metadata, metadataTypes };
}

function checkOutputs(outputs: string[], inputs: string[]): void {
  const ins = new Set(inputs.map((p) => nodePath.resolve(p)));
  for (const o of outputs) {
    if (ins.has(nodePath.resolve(o))) {
      throw new GgufError("IO", `output ${o} is also an input; choose another output prefix`, { path: o });
    }
  }
}

/**
 * Write a model as shards `OUT_PREFIX-0000i-of-0000N.gguf`, as llama.cpp's `gguf-split --split`
 * does: the first shard holds all metadata plus `split.no` (uint16), `split.count` (uint16) and
 * `split.tensors.count` (int32) — set where the input has them, appended otherwise — and the others
 * only those three keys; each shard holds its tensors' infos and data (padded to the alignment).
 * Tensor data is copied in chunks, never a whole model in memory. A model opened from a first shard
 * can be re-split. Each shard is written atomically (temporary file + rename).
 * @param file the model, from {@link openGgufModel} or `openGguf`
 * @returns the shard paths written, in order
 * @throws GgufError as {@link planGgufSplit}; `IO` when a shard would overwrite an input file, and
 *   for file-system failures
 */
export async function writeGgufSplit(
  file: GgufFile,
  outPrefix: string,
  opts: GgufSplitOptions & { onShard?: (path: string, tensors: number, bytes: number) => void },
): Promise<string[]> {
  const plan = planGgufSplit(file, opts);
  const n = plan.length;
  const paths = plan.map((_, i) => splitPath(outPrefix, i, n));
  checkOutputs(paths, [file.path, ...(file.splits ?? []).map((s) => s.path)]);
  for (let i = 0; i < n; i++) {
    const entries: GgufMetadataEntry[] = i === 0 ? metadataEntries(file) : [];
    setKey(entries, KEY_SPLIT_NO, GgufValueType.UINT16, i);
    setKey(entries, KEY_SPLIT_COUNT, GgufValueType.UINT16, n);
    setKey(entries, KEY_SPLIT_TENSORS_COUNT, GgufValueType.INT32, file.tensors.length);
    const bytes = await writeGgufStreaming(
      paths[i],
      {
        format: file.format,
        version: 3,
        alignment: file.alignment,
        metadata: entries,
        tensors: plan[i].map((t) => ({
          name: t.name,
          type: t.type,
          shape: t.shape,
          data: () => tensorChunks(file, t),
        })),
      },
      { reserveBytes: 0 },
    );
    opts.onShard?.(paths[i], plan[i].length, bytes);
  }
  return paths;
}

/**
 * Merge the shards of a split model into one file, as llama.cpp's `gguf-split --merge` does: the first
 * shard's metadata with `split.count` set to 0 (so the result is not taken for a shard), then every
 * shard's tensors in order, their data byte for byte. Written atomically. Shards joined into one file
 * with `cat` are merged the same way.
 * @param firstShard path of the first shard (`…-00001-of-0000N.gguf`), or of the shards joined with `cat`
 * @returns the size of the file written
 * @throws GgufError as {@link openGgufModel}; `BAD_SPLIT` when the input is not a split model; `IO`
 *   when `out` is one of the shards, and for file-system failures
 */
export async function mergeGgufSplit(firstShard: string, out: string): Promise<number> {
  const file = openGgufModel(firstShard, { joined: true });
  if (!file.splits) {
    throw new GgufError("BAD_SPLIT", `not a split model (no "${KEY_SPLIT_COUNT}" above 0): nothing to merge`, {
      path: firstShard,
    });
  }
  checkOutputs(
    [out],
    file.splits.map((s) => s.path),
  );
  const entries = metadataEntries(file);
  setKey(entries, KEY_SPLIT_COUNT, GgufValueType.UINT16, 0);
  return writeGgufStreaming(
    out,
    {
      format: file.format,
      version: 3,
      alignment: file.alignment,
      metadata: entries,
      tensors: file.tensors.map((t) => ({
        name: t.name,
        type: t.type,
        shape: t.shape,
        data: () => tensorChunks(file, t),
      })),
    },
    { reserveBytes: 0 },
  );
}
