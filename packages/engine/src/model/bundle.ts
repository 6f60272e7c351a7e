/**
 * The bundled FFN layout (`powerinfer convert --bundle`): a PowerInfer GGUF (magic `PWRI`) whose sparse
 * FFN rows are stored per neuron, so that one read brings everything a neuron needs (PowerInfer-2's
 * neuron bundles, Xue et al. 2024).
 *
 * Per layer N the tensors `blk.N.ffn_up.weight`, `blk.N.ffn_gate.weight` (when gated) and
 * `blk.N.ffn_down_t.weight` are replaced by one tensor `blk.N.ffn_bundle.weight` of type I8 and shape
 * [bucket bytes, buckets]:
 *  - a neuron record is the neuron's up row, then its gate row, then its down_t row, each
 *    `row_bytes(type, n_embd)` bytes, back to back (`powerinfer.bundle.parts` names them in order);
 *  - records are grouped in buckets of `powerinfer.bundle.bucket_size` neurons; each bucket is padded to
 *    a multiple of 4096 bytes and every tensor of the file starts 4096-aligned (`general.alignment`), so
 *    buckets start on 4 KiB boundaries (O_DIRECT reads need no extra block);
 *  - the default bucket size is the smallest count of records that fills whole 4 KiB blocks (1 for F16 at
 *    n_embd 4096: 24 KiB records; 16 for Q4_0: 16 × 6912 bytes = 27 blocks), at most 64, else 1.
 * Keys: `powerinfer.bundle.version` (u32, 1), `powerinfer.bundle.bucket_size` (u32),
 * `powerinfer.bundle.alignment` (u32, 4096), `powerinfer.bundle.parts` (string array),
 * `powerinfer.bundle.type` (u32, the ggml type of every part).
 * PowerInfer and llama.cpp cannot read it; `powerinfer convert --to pwri` turns it back.
 */
import {
  GGML_TYPE_INFO,
  GGMLType,
  type GgufFile,
  type GgufMetadataEntry,
  type GgufStreamTensor,
  type GgufTensorInfo,
  GgufTypes,
  GgufValueType,
  metadataEntries,
  readTensorBytes,
  tensorByteLength,
  writeGgufStreaming,
} from "@powerinfer/gguf";
import { EngineError } from "../errors.js";

export const BUNDLE_ALIGN = 4096;
export const BUNDLE_KEY = "powerinfer.bundle.";

/** One layer's bundle as stored. */
export interface BundleLayout {
  info: GgufTensorInfo;
  type: GGMLType;
  /** Part names in record order, e.g. ["ffn_up", "ffn_gate", "ffn_down_t"]. */
  parts: string[];
  /** Bytes of one part's row. */
  rowBytes: number;
  /** Bytes of a neuron record (all parts). */
  recordBytes: number;
  bucketRows: number;
  /** Bytes between bucket starts. */
  bucketStride: number;
  nFf: number;
  nEmbd: number;
}

/** Whether the file is bundled. */
export function isBundled(file: GgufFile): boolean {
  return file.metadata.has(`${BUNDLE_KEY}version`);
}

/** Bytes of a part row of `n` elements of `type`. */
function rowBytesOf(type: GGMLType, n: number): number {
  const t = GGML_TYPE_INFO[type];
  return (n / t.blockSize) * t.typeSize;
}

/** Records per bucket for a record size: the smallest count filling whole 4 KiB blocks (≤ 64), else 1. */
export function defaultBucketSize(recordBytes: number): number {
  for (let b = 1; b <= 64; b++) if ((b * recordBytes) % BUNDLE_ALIGN === 0) return b;
  return 1;
}

/**
 * The bundle of layer `l`, or undefined when the file is not bundled.
 * @throws EngineError 'BAD_SHAPE' when the stored bundle does not match the keys.
 */
export function bundleLayout(file: GgufFile, l: number, nEmbd: number, nFf: number): BundleLayout | undefined {
  if (!isBundled(file)) return undefined;
  const info = file.tensorMap.get(`blk.${l}.ffn_bundle.weight`);
  if (!info) return undefined;
  const type = Number(file.metadata.get(`${BUNDLE_KEY}type`)) as GGMLType;
  const parts = file.metadata.get(`${BUNDLE_KEY}parts`) as string[];
  const bucketRows = Number(file.metadata.get(`${BUNDLE_KEY}bucket_size`));
  const rowBytes = rowBytesOf(type, nEmbd);
  const recordBytes = rowBytes * parts.length;
  const bucketStride = Math.ceil((recordBytes * bucketRows) / BUNDLE_ALIGN) * BUNDLE_ALIGN;
  const buckets = Math.ceil(nFf / bucketRows);
  if (
    !GGML_TYPE_INFO[type] ||
    !(bucketRows >= 1) ||
    info.shape[0] !== bucketStride ||
    (info.shape[1] ?? 1) !== buckets ||
    info.fileOffset % BUNDLE_ALIGN !== 0
  ) {
    throw new EngineError(
      "BAD_SHAPE",
      `${info.name}: shape [${info.shape}] at byte ${info.fileOffset} does not match the bundle keys (${parts.length} parts of ${rowBytes} bytes, ${bucketRows} per bucket: [${bucketStride}, ${buckets}], 4 KiB aligned)`,
    );
  }
  return { info, type, parts, rowBytes, recordBytes, bucketRows, bucketStride, nFf, nEmbd };
}

const FFN_PART = /^blk\.(\d+)\.(ffn_up|ffn_gate|ffn_down_t)\.weight$/;

/**
 * Writes `file` (a PWRI model with ffn_down_t) bundled to `outPath`.
 * @throws EngineError 'BAD_INPUT' when the model has no ffn_down_t or its parts differ in type.
 */
export async function writeBundled(
  file: GgufFile,
  outPath: string,
  opts: { bucketSize?: number; onProgress?: (written: number, total: number) => void } = {},
): Promise<{ bucketSize: number; layers: number }> {
  if (isBundled(file)) throw new EngineError("BAD_INPUT", "the model is bundled already");
  const layers = new Map<number, Map<string, GgufTensorInfo>>();
  for (const t of file.tensors) {
    const m = FFN_PART.exec(t.name);
    if (!m) continue;
    const l = Number(m[1]);
    if (!layers.has(l)) layers.set(l, new Map());
    layers.get(l)!.set(m[2]!, t);
  }
  let type: GGMLType | undefined;
  let parts: string[] | undefined;
  let nEmbd = 0;
  for (const [l, p] of layers) {
    if (!p.has("ffn_down_t") || !p.has("ffn_up")) {
      throw new EngineError(
        "BAD_INPUT",
        `layer ${l} has no ffn_down_t: bundle a PowerInfer GGUF (\`powerinfer convert IN OUT --to pwri\` first)`,
      );
    }
    const names = ["ffn_up", ...(p.has("ffn_gate") ? ["ffn_gate"] : []), "ffn_down_t"];
    if (parts && parts.join() !== names.join()) throw new EngineError("BAD_INPUT", `layer ${l} has other FFN parts`);
    parts = names;
    for (const n of names) {
      const t = p.get(n)!;
      if (type !== undefined && t.type !== type) {
        throw new EngineError(
          "BAD_INPUT",
          `${t.name} is ${GGML_TYPE_INFO[t.type].name}, the other FFN parts ${GGML_TYPE_INFO[type].name}: a bundle holds one type`,
        );
      }
      type = t.type;
      nEmbd = t.shape[0]!;
    }
  }
  if (type === undefined || !parts) throw new EngineError("BAD_INPUT", "the model has no sparse FFN to bundle");
  const rowBytes = rowBytesOf(type, nEmbd);
  const recordBytes = rowBytes * parts.length;
  const bucketSize = opts.bucketSize ?? defaultBucketSize(recordBytes);
  const bucketStride = Math.ceil((recordBytes * bucketSize) / BUNDLE_ALIGN) * BUNDLE_ALIGN;
  const metadata: GgufMetadataEntry[] = metadataEntries(file).filter(
    (e) => e.key !== "general.alignment" && !e.key.startsWith(BUNDLE_KEY),
  );
  metadata.push(
    { key: "general.alignment", type: GgufTypes.u32, value: BUNDLE_ALIGN },
    { key: `${BUNDLE_KEY}version`, type: GgufTypes.u32, value: 1 },
    { key: `${BUNDLE_KEY}bucket_size`, type: GgufTypes.u32, value: bucketSize },
    { key: `${BUNDLE_KEY}alignment`, type: GgufTypes.u32, value: BUNDLE_ALIGN },
    { key: `${BUNDLE_KEY}parts`, type: GgufTypes.array(GgufValueType.STRING), value: parts },
    { key: `${BUNDLE_KEY}type`, type: GgufTypes.u32, value: type },
  );
  const tensors: GgufStreamTensor[] = [];
  for (const t of file.tensors) {
    const m = FFN_PART.exec(t.name);
    if (!m) {
      tensors.push({ name: t.name, type: t.type, shape: [...t.shape], data: () => [readTensorBytes(file, t)] });
      continue;
    }
    if (m[2] !== "ffn_up") continue; // the bundle takes the place of the layer's up tensor
    const p = layers.get(Number(m[1]))!;
    const nFf = t.shape[1]!;
    const buckets = Math.ceil(nFf / bucketSize);
    const src = parts.map((n) => p.get(n)!);
    tensors.push({
      name: `blk.${m[1]}.ffn_bundle.weight`,
      type: GGMLType.I8,
      shape: [bucketStride, buckets],
      data: function* () {
        const bytes = src.map((s) => readTensorBytes(file, s));
        const out = new Uint8Array(bucketStride);
        for (let b = 0; b < buckets; b++) {
          out.fill(0);
          for (let k = 0; k < bucketSize; k++) {
            const i = b * bucketSize + k;
            if (i >= nFf) break;
            bytes.forEach((s, j) => {
              out.set(s.subarray(i * rowBytes, (i + 1) * rowBytes), k * recordBytes + j * rowBytes);
            });
          }
          yield out;
        }
      },
    });
  }
  if (tensorByteLength(GGMLType.I8, [bucketStride, 1]) !== bucketStride) throw new Error("I8 size");
  await writeGgufStreaming(
    outPath,
    { format: "PWRI", alignment: BUNDLE_ALIGN, metadata, tensors },
    { onProgress: opts.onProgress },
  );
  return { bucketSize, layers: layers.size };
}

/**
 * Writes a bundled model back as PWRI (ffn_up, ffn_gate, ffn_down_t tensors, alignment 32).
 * @throws EngineError 'BAD_INPUT' when the file is not bundled.
 */
export async function writeUnbundled(
  file: GgufFile,
  outPath: string,
  nEmbd: number,
  nFf: number,
  opts: { onProgress?: (written: number, total: number) => void } = {},
): Promise<void> {
  if (!isBundled(file)) throw new EngineError("BAD_INPUT", "the model is not bundled");
  const metadata = metadataEntries(file).filter((e) => e.key !== "general.alignment" && !e.key.startsWith(BUNDLE_KEY));
  const tensors: GgufStreamTensor[] = [];
  for (const t of file.tensors) {
    const m = /^blk\.(\d+)\.ffn_bundle\.weight$/.exec(t.name);
    if (!m) {
      tensors.push({ name: t.name, type: t.type, shape: [...t.shape], data: () => [readTensorBytes(file, t)] });
      continue;
    }
    const b = bundleLayout(file, Number(m[1]), nEmbd, nFf)!;
    b.parts.forEach((part, j) => {
      tensors.push({
        name: `blk.${m[1]}.${part}.weight`,
        type: b.type,
        shape: [nEmbd, nFf],
        data: function* () {
          const all = readTensorBytes(file, b.info);
          const out = new Uint8Array(b.rowBytes * nFf);
          for (let i = 0; i < nFf; i++) {
            const at =
              Math.floor(i / b.bucketRows) * b.bucketStride + (i % b.bucketRows) * b.recordBytes + j * b.rowBytes;
            out.set(all.subarray(at, at + b.rowBytes), i * b.rowBytes);
          }
          yield out;
        },
      });
    });
  }
  await writeGgufStreaming(outPath, { format: "PWRI", metadata, tensors }, { onProgress: opts.onProgress });
}
