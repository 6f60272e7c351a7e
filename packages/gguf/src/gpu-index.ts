/**
 * PowerInfer GPU index files (`<model>.generated.gpuidx`): the neuron placement plan.
 *
 * Format (PowerInfer `powerinfer-py/powerinfer/export_split.py`, read by its `llama_gpu_split_loader`):
 * a PWRI GGUF v3 with `general.architecture = "generic.gpu_index"`, `generic.gpu_index.block_count`
 * (u32), `split.vram_capacity` (u64, bytes), and per layer, interleaved in layer order (PowerInfer reads
 * them by position: tensor 2l is layer l's index, 2l+1 its bucket):
 * - `blk.N.gpu_idx`    I32[n_ff]: 1 where the neuron lives on the GPU, else 0;
 * - `blk.N.gpu_bucket` I32[n_hot]: the GPU-resident neuron ids in ascending order.
 * I32 is stored as PowerInfer's type id 18.
 */

import { GgufError } from "./errors.js";
import { GGMLType } from "./ggml-types.js";
import { type GgufFile, openGguf, readTensorBytes } from "./reader.js";
import { GgufValueType } from "./values.js";
import { type GgufMetadataEntry, type GgufWriteSpec, metadataEntries, serializeGguf, writeGguf } from "./writer.js";

export const GPU_INDEX_ARCH = "generic.gpu_index";
const KEY_ARCH = "general.architecture";
const KEY_BLOCKS = "generic.gpu_index.block_count";
const KEY_VRAM = "split.vram_capacity";

/** Placement of one layer's FFN neurons. */
export interface GpuIndexLayer {
  /** [n_ff]: 1 = neuron on the GPU, 0 = on the CPU. */
  gpuIdx: Int32Array;
  /** Ascending ids of the GPU neurons. */
  gpuBucket: Int32Array;
}

/** A GPU index (placement plan) file. */
export interface GpuIndex {
  /** Number of layers (`generic.gpu_index.block_count`). */
  blockCount: number;
  /** `split.vram_capacity`: bytes of VRAM the plan needs. */
  vramCapacity: bigint;
  /** Layers in numeric order (layer 10 after layer 9, never after layer 1). */
  layers: GpuIndexLayer[];
  /**
   * Other metadata, written after the standard keys — e.g. what the plan was solved for
   * (`powerinfer.plan.budget_bytes`, `powerinfer.plan.backend`, `powerinfer.plan.stats_file`).
   */
  extra?: GgufMetadataEntry[];
}

function bad(path: string, msg: string): never {
  throw new GgufError("BAD_VALUE", msg, { path });
}

function i32(file: GgufFile, name: string): Int32Array {
  const t = file.tensorMap.get(name);
  if (!t) throw new GgufError("MISSING_TENSOR", `GPU index has no tensor "${name}"`, { path: file.path });
  if (t.type !== GGMLType.I32 || t.shape.length !== 1) bad(file.path, `tensor "${name}" must be a 1-D I32 tensor`);
  const bytes = readTensorBytes(file, t);
  const out = new Int32Array(t.nElements);
  new Uint8Array(out.buffer).set(bytes);
  return out;
}

/** Decode a GPU index from a parsed file. @throws GgufError naming the bad key or tensor */
export function gpuIndexFromFile(file: GgufFile): GpuIndex {
  const arch = file.metadata.get(KEY_ARCH);
  if (arch !== GPU_INDEX_ARCH) bad(file.path, `"${KEY_ARCH}" must be "${GPU_INDEX_ARCH}", found ${String(arch)}`);
  const bc = file.metadata.get(KEY_BLOCKS);
  if (bc === undefined)
    throw new GgufError("MISSING_KEY", `required metadata key "${KEY_BLOCKS}" is missing`, { path: file.path });
  if (typeof bc !== "number" || !Number.isInteger(bc) || bc < 0) bad(file.path, `"${KEY_BLOCKS}" must be an integer`);
  const vram = file.metadata.get(KEY_VRAM);
  if (vram === undefined)
    throw new GgufError("MISSING_KEY", `required metadata key "${KEY_VRAM}" is missing`, { path: file.path });
  if (typeof vram !== "bigint" && typeof vram !== "number") bad(file.path, `"${KEY_VRAM}" must be an integer`);

  const seen = new Set<number>();
  for (const t of file.tensors) {
    const m = /^blk\.(\d+)\.gpu_(idx|bucket)$/.exec(t.name);
    if (!m) bad(file.path, `unexpected tensor "${t.name}" in a GPU index`);
    seen.add(Number(m[1]));
  }
  for (const l of seen) {
    if (l >= bc) bad(file.path, `tensor for layer ${l} but "${KEY_BLOCKS}" = ${bc}`);
  }
  const layers: GpuIndexLayer[] = [];
  for (let l = 0; l < bc; l++)
    layers.push({ gpuIdx: i32(file, `blk.${l}.gpu_idx`), gpuBucket: i32(file, `blk.${l}.gpu_bucket`) });
  const extra = metadataEntries(file).filter((e) => e.key !== KEY_ARCH && e.key !== KEY_BLOCKS && e.key !== KEY_VRAM);
  const idx: GpuIndex = { blockCount: bc, vramCapacity: BigInt(vram), layers };
  if (extra.length > 0) idx.extra = extra;
  return idx;
}

/**
 * Read a PowerInfer GPU index file.
 * @throws GgufError for a malformed container (see openGguf), `BAD_VALUE` / `MISSING_KEY` /
 *   `MISSING_TENSOR` for a container that is not a valid GPU index
 */
export function readGpuIndex(path: string): GpuIndex {
  return gpuIndexFromFile(openGguf(path));
}

function spec(idx: GpuIndex): GgufWriteSpec {
  if (idx.layers.length !== idx.blockCount) {
    throw new GgufError("BAD_VALUE", `blockCount ${idx.blockCount} but ${idx.layers.length} layers given`);
  }
  const metadata: GgufMetadataEntry[] = [
    { key: KEY_ARCH, type: { type: GgufValueType.STRING }, value: GPU_INDEX_ARCH },
    { key: KEY_BLOCKS, type: { type: GgufValueType.UINT32 }, value: idx.blockCount },
    { key: KEY_VRAM, type: { type: GgufValueType.UINT64 }, value: idx.vramCapacity },
    ...(idx.extra ?? []),
  ];
  const bytes = (a: Int32Array) => new Uint8Array(a.buffer, a.byteOffset, a.byteLength);
  const tensors = idx.layers.flatMap((layer, l) => [
    { name: `blk.${l}.gpu_idx`, type: GGMLType.I32, shape: [layer.gpuIdx.length], data: bytes(layer.gpuIdx) },
    { name: `blk.${l}.gpu_bucket`, type: GGMLType.I32, shape: [layer.gpuBucket.length], data: bytes(layer.gpuBucket) },
  ]);
  return { format: "PWRI", version: 3, metadata, tensors };
}

/** Encode a GPU index as PWRI bytes (layers interleaved in numeric order, I32 as type id 18). */
export function serializeGpuIndex(idx: GpuIndex): Uint8Array {
  return serializeGguf(spec(idx));
}

/** Write a GPU index file readable by PowerInfer (atomic: temp file + rename). @throws GgufError */
export function writeGpuIndex(path: string, idx: GpuIndex): void {
  writeGguf(path, spec(idx));
}
