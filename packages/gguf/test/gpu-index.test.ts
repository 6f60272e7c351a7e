import { mkdtempSync, readFileSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { afterAll, describe, expect, it } from "vitest";
import {
  GGMLType,
  GgufError,
  GgufTypes,
  openGguf,
  parseGgufBuffer,
  readGpuIndex,
  type serializeGguf,
  serializeGpuIndex,
  writeGguf,
  writeGpuIndex,
} from "../src/index.js";
import { model } from "./helpers.js";

const dir = mkdtempSync(join(tmpdir(), "gpuidx-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
const FIXTURE = model("powerinfer/tiny.generated.gpuidx");

describe("PowerInfer's tiny.generated.gpuidx", () => {
  const idx = readGpuIndex(FIXTURE);

  it("has the documented keys and a consistent plan per layer", () => {
    expect(idx.blockCount).toBe(2);
    expect(idx.vramCapacity).toBe(123456n);
    expect(idx.extra).toBeUndefined();
    expect(idx.layers.map((l) => [l.gpuIdx.length, l.gpuBucket.length])).toEqual([
      [1024, 512],
      [1024, 256],
    ]);
    for (const { gpuIdx, gpuBucket } of idx.layers) {
      // gpu_idx is a 0/1 mask; gpu_bucket lists exactly the 1s, ascending.
      expect(gpuIdx.every((v) => v === 0 || v === 1)).toBe(true);
      const hot = [...gpuIdx.keys()].filter((i) => gpuIdx[i] === 1);
      expect(Array.from(gpuBucket)).toEqual(hot);
    }
    // 1000 neurons of capacity were given to the solver; 768 were placed (512 + 256).
    expect(idx.layers[0].gpuBucket.length + idx.layers[1].gpuBucket.length).toBeLessThanOrEqual(1000);
  });

  it("re-writes byte-identically (PWRI magic, I32 as PowerInfer's type id 18)", () => {
    const out = join(dir, "rewritten.gpuidx");
    writeGpuIndex(out, idx);
    expect(readFileSync(out).equals(readFileSync(FIXTURE))).toBe(true);
    expect(Buffer.from(serializeGpuIndex(idx)).equals(readFileSync(FIXTURE))).toBe(true);
  });
});

describe("layers are ordered numerically", () => {
  const layers = Array.from({ length: 12 }, (_, l) => ({
    gpuIdx: Int32Array.from({ length: 16 }, (_, i) => (i === l ? 1 : 0)),
    gpuBucket: Int32Array.of(l),
  }));

  it("the writer interleaves blk.N.gpu_idx / blk.N.gpu_bucket in numeric layer order", () => {
    const f = parseGgufBuffer(serializeGpuIndex({ blockCount: 12, vramCapacity: 1n << 40n, layers }));
    expect(f.format).toBe("PWRI");
    expect(f.tensors.map((t) => t.name).slice(0, 6)).toEqual([
      "blk.0.gpu_idx",
      "blk.0.gpu_bucket",
      "blk.1.gpu_idx",
      "blk.1.gpu_bucket",
      "blk.2.gpu_idx",
      "blk.2.gpu_bucket",
    ]);
    expect(f.tensors.map((t) => t.name).slice(-4)).toEqual([
      "blk.10.gpu_idx",
      "blk.10.gpu_bucket",
      "blk.11.gpu_idx",
      "blk.11.gpu_bucket",
    ]);
    expect(f.metadata.get("split.vram_capacity")).toBe(1n << 40n);
  });

  it("the reader orders layers by number even when the file lists them textually (1, 10, 11, 2, …)", () => {
    const textual = layers.map((_, l) => String(l)).sort();
    expect(textual.slice(0, 4)).toEqual(["0", "1", "10", "11"]);
    const path = join(dir, "textual.gpuidx");
    writeGguf(path, {
      format: "PWRI",
      metadata: [
        { key: "general.architecture", type: GgufTypes.string, value: "generic.gpu_index" },
        { key: "generic.gpu_index.block_count", type: GgufTypes.u32, value: 12 },
        { key: "split.vram_capacity", type: GgufTypes.u64, value: 0n },
      ],
      tensors: textual.flatMap((s) => {
        const l = Number(s);
        return [
          { name: `blk.${l}.gpu_idx`, type: GGMLType.I32, shape: [16], data: new Uint8Array(layers[l].gpuIdx.buffer) },
          {
            name: `blk.${l}.gpu_bucket`,
            type: GGMLType.I32,
            shape: [1],
            data: new Uint8Array(layers[l].gpuBucket.buffer),
          },
        ];
      }),
    });
    const idx = readGpuIndex(path);
    expect(idx.layers.map((l) => l.gpuBucket[0])).toEqual([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]);
  });
});

describe("extra metadata and errors", () => {
  it("records what the plan was solved for, after the standard keys", () => {
    const path = join(dir, "extra.gpuidx");
    writeGpuIndex(path, {
      blockCount: 1,
      vramCapacity: 4096n,
      layers: [{ gpuIdx: Int32Array.of(1, 0), gpuBucket: Int32Array.of(0) }],
      extra: [
        { key: "powerinfer.plan.budget_bytes", type: GgufTypes.u64, value: 8192n },
        { key: "powerinfer.plan.backend", type: GgufTypes.string, value: "cuda" },
        { key: "powerinfer.plan.stats_file", type: GgufTypes.string, value: "m.activations.gguf" },
      ],
    });
    const f = openGguf(path);
    expect([...f.metadata.keys()]).toEqual([
      "general.architecture",
      "generic.gpu_index.block_count",
      "split.vram_capacity",
      "powerinfer.plan.budget_bytes",
      "powerinfer.plan.backend",
      "powerinfer.plan.stats_file",
    ]);
    const idx = readGpuIndex(path);
    expect(idx.extra?.map((e) => [e.key, e.value])).toEqual([
      ["powerinfer.plan.budget_bytes", 8192n],
      ["powerinfer.plan.backend", "cuda"],
      ["powerinfer.plan.stats_file", "m.activations.gguf"],
    ]);
  });

  it("refuses files that are not GPU indexes, and missing layers", () => {
    const bad = (
      meta: Parameters<typeof serializeGguf>[0]["metadata"],
      tensors: Parameters<typeof serializeGguf>[0]["tensors"] = [],
    ) => {
      const path = join(dir, "bad.gpuidx");
      writeGguf(path, { format: "PWRI", metadata: meta, tensors });
      try {
        readGpuIndex(path);
      } catch (e) {
        return e as GgufError;
      }
      throw new Error("expected an error");
    };
    expect(() => readGpuIndex(model("stories260K.gguf"))).toThrow(/generic\.gpu_index/);
    const arch = { key: "general.architecture", type: GgufTypes.string, value: "generic.gpu_index" };
    expect(bad([arch]).message).toContain('"generic.gpu_index.block_count"');
    const two = [
      arch,
      { key: "generic.gpu_index.block_count", type: GgufTypes.u32, value: 2 },
      { key: "split.vram_capacity", type: GgufTypes.u64, value: 0n },
    ];
    const e = bad(two, [
      { name: "blk.0.gpu_idx", type: GGMLType.I32, shape: [1], data: new Uint8Array(4) },
      { name: "blk.0.gpu_bucket", type: GGMLType.I32, shape: [1], data: new Uint8Array(4) },
    ]);
    expect(e.code).toBe("MISSING_TENSOR");
    expect(e.message).toContain('"blk.1.gpu_idx"');
    expect(() => serializeGpuIndex({ blockCount: 2, vramCapacity: 0n, layers: [] })).toThrow(GgufError);
  });
});
