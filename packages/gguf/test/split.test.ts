import { copyFileSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { basename, join } from "node:path";
import { afterAll, describe, expect, it } from "vitest";
import {
  assertModelFile,
  GGMLType,
  GgufError,
  type GgufErrorCode,
  GgufValueType,
  ggufFileKind,
  mergeGgufSplit,
  metadataEntries,
  openGguf,
  openGgufModel,
  parseSplitPath,
  planGgufSplit,
  readTensorBytes,
  splitPath,
  writeGguf,
  writeGgufSplit,
} from "../src/index.js";
import { model, rng } from "./helpers.js";

const dir = mkdtempSync(join(tmpdir(), "gguf-split-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const ORIGINAL = model("stories260K.gguf");
const original = openGguf(ORIGINAL);

function catchGguf(fn: () => unknown): GgufError {
  try {
    fn();
  } catch (e) {
    if (e instanceof GgufError) return e;
    throw e;
  }
  throw new Error("expected a GgufError, but nothing was thrown");
}

/** Split stories260K into a fresh folder; returns the shard paths. */
async function split(name: string, maxTensors = 20): Promise<string[]> {
  const sub = mkdtempSync(join(dir, `${name}-`));
  return writeGgufSplit(original, join(sub, "stories260K"), { maxTensors });
}

describe("split models (gguf-split layout)", () => {
  it("names shards as gguf-split does, and parses those names", () => {
    expect(splitPath("m/x", 0, 3)).toBe("m/x-00001-of-00003.gguf");
    expect(splitPath("x", 11, 12)).toBe("x-00012-of-00012.gguf");
    expect(parseSplitPath("/a/b-c-00002-of-00010.gguf")).toEqual({ prefix: "/a/b-c", no: 1, count: 10 });
    expect(parseSplitPath("x-00004-of-00003.gguf")).toBeUndefined();
    expect(parseSplitPath("x-1-of-3.gguf")).toBeUndefined();
  });

  it("plans shards by tensor count or by size (tensor data padded to the alignment)", () => {
    const counts = (p: ReturnType<typeof planGgufSplit>) => p.map((s) => s.length);
    expect(original.tensors.length).toBe(48);
    expect(counts(planGgufSplit(original, { maxTensors: 20 }))).toEqual([20, 20, 8]);
    expect(counts(planGgufSplit(original, { maxTensors: 48 }))).toEqual([48]);
    // token_embd is 512 × 64 F32 = 131072 bytes; a shard limit below it still gives it a shard of its own
    const bySize = planGgufSplit(original, { maxBytes: 100_000 });
    for (const s of bySize) {
      const bytes = s.reduce((n, t) => n + Math.ceil(t.byteLength / 32) * 32, 0);
      expect(s.length === 1 || bytes <= 100_000).toBe(true);
    }
    expect(bySize.flat().map((t) => t.name)).toEqual(original.tensors.map((t) => t.name));
    expect(catchGguf(() => planGgufSplit(original, {})).code).toBe("BAD_VALUE");
    expect(catchGguf(() => planGgufSplit(original, { maxTensors: 0 })).code).toBe("BAD_VALUE");
  });

  it("writes shards with llama.cpp's split keys, and opens them from the first as one model", async () => {
    const paths = await split("basic");
    expect(paths.map((p) => basename(p))).toEqual([
      "stories260K-00001-of-00003.gguf",
      "stories260K-00002-of-00003.gguf",
      "stories260K-00003-of-00003.gguf",
    ]);
    const shards = paths.map((p) => openGguf(p));
    expect(shards.map((s) => s.tensors.length)).toEqual([20, 20, 8]);
    // first shard: all the original metadata, then split.no (u16), split.count (u16), split.tensors.count (i32)
    const first = metadataEntries(shards[0]);
    expect(first.slice(0, -3)).toEqual(metadataEntries(original));
    expect(first.slice(-3)).toEqual([
      { key: "split.no", type: { type: GgufValueType.UINT16 }, value: 0 },
      { key: "split.count", type: { type: GgufValueType.UINT16 }, value: 3 },
      { key: "split.tensors.count", type: { type: GgufValueType.INT32 }, value: 48 },
    ]);
    expect(metadataEntries(shards[2])).toEqual([
      { key: "split.no", type: { type: GgufValueType.UINT16 }, value: 2 },
      { key: "split.count", type: { type: GgufValueType.UINT16 }, value: 3 },
      { key: "split.tensors.count", type: { type: GgufValueType.INT32 }, value: 48 },
    ]);

    const m = openGgufModel(paths[0]);
    expect(m.splits?.map((s) => [s.path, s.tensorCount])).toEqual([
      [paths[0], 20],
      [paths[1], 20],
      [paths[2], 8],
    ]);
    expect(m.tensors.map((t) => [t.name, t.type, t.shape])).toEqual(
      original.tensors.map((t) => [t.name, t.type, t.shape]),
    );
    expect(m.tensors[47].path).toBe(paths[2]);
    expect(m.tensors[20].path).toBe(paths[1]);
    expect(m.tensorMap.get("token_embd.weight")?.path).toBe(paths[0]);
    for (const t of original.tensors) {
      expect(Buffer.compare(readTensorBytes(m, t.name), readTensorBytes(original, t))).toBe(0);
    }
    expect(ggufFileKind(m)).toBe("model");
    // a file that is not split opens as itself
    expect(openGgufModel(ORIGINAL).splits).toBeUndefined();
  });

  it("refuses a non-first shard naming the first, a missing shard, a renamed first shard, cat-joined shards", async () => {
    const paths = await split("refuse");
    let e = catchGguf(() => openGgufModel(paths[1]));
    expect(e.code).toBe("BAD_SPLIT");
    expect(e.message).toBe(`${paths[1]}: this is shard 2 of 3 of a split model; give the first shard, ${paths[0]}`);

    const joined = join(dir, "joined.gguf");
    writeFileSync(joined, Buffer.concat(paths.map((p) => readFileSync(p))));
    e = catchGguf(() => openGgufModel(joined));
    expect(e.code).toBe("BAD_SPLIT");
    expect(e.message).toMatch(/joined\.gguf: holds the 3 shards of a split model joined into one file \(with cat\)/);
    expect(e.message).toContain(`powerinfer gguf-split --merge ${joined} OUT`);
    // ... which merges them: the same file as merging the shards
    const fromJoined = openGgufModel(joined, { joined: true });
    expect(fromJoined.tensors.map((t) => [t.name, t.path])).toEqual(original.tensors.map((t) => [t.name, joined]));
    for (const t of original.tensors) {
      expect(Buffer.compare(readTensorBytes(fromJoined, t.name), readTensorBytes(original, t))).toBe(0);
    }
    await mergeGgufSplit(joined, join(dir, "from-joined.gguf"));
    await mergeGgufSplit(paths[0], join(dir, "from-shards.gguf"));
    expect(
      Buffer.compare(readFileSync(join(dir, "from-joined.gguf")), readFileSync(join(dir, "from-shards.gguf"))),
    ).toBe(0);
    // a joined file cut inside its last shard
    const cut = join(dir, "cut.gguf");
    writeFileSync(
      cut,
      readFileSync(joined).subarray(0, readFileSync(paths[0]).length + readFileSync(paths[1]).length + 100),
    );
    e = catchGguf(() => openGgufModel(cut, { joined: true }));
    expect(["TRUNCATED", "LENGTH_PAST_END", "TENSOR_OUT_OF_BOUNDS"]).toContain(e.code);

    const renamed = join(dir, "renamed.gguf");
    copyFileSync(paths[0], renamed);
    e = catchGguf(() => openGgufModel(renamed));
    expect(e.message).toMatch(/its name does not end in -00001-of-00003\.gguf/);

    rmSync(paths[2]);
    e = catchGguf(() => openGgufModel(paths[0]));
    expect(e.code).toBe("BAD_SPLIT");
    expect(e.path).toBe(paths[2]);
    expect(e.message).toMatch(/shard 3 of 3 of the split model stories260K-00001-of-00003\.gguf is missing/);
  });

  it("refuses a tensor in two shards and counts that do not add up", () => {
    const sub = mkdtempSync(join(dir, "dup-"));
    const t = { name: "w", type: GGMLType.F32, shape: [8], data: new Uint8Array(32) };
    const keys = (no: number, total: number) => [
      { key: "split.no", type: { type: GgufValueType.UINT16 as const }, value: no },
      { key: "split.count", type: { type: GgufValueType.UINT16 as const }, value: 2 },
      { key: "split.tensors.count", type: { type: GgufValueType.INT32 as const }, value: total },
    ];
    writeGguf(splitPath(join(sub, "d"), 0, 2), { metadata: keys(0, 2), tensors: [t] });
    writeGguf(splitPath(join(sub, "d"), 1, 2), { metadata: keys(1, 2), tensors: [t] });
    let e = catchGguf(() => openGgufModel(splitPath(join(sub, "d"), 0, 2)));
    expect(e.code).toBe("DUPLICATE_TENSOR");
    expect(e.message).toMatch(/tensor "w" is in shard 1 \(d-00001-of-00002\.gguf\) and in shard 2$/);
    writeGguf(splitPath(join(sub, "d"), 0, 2), { metadata: keys(0, 3), tensors: [t] });
    writeGguf(splitPath(join(sub, "d"), 1, 2), { metadata: keys(1, 3), tensors: [{ ...t, name: "v" }] });
    e = catchGguf(() => openGgufModel(splitPath(join(sub, "d"), 0, 2)));
    expect(e.code).toBe("BAD_SPLIT");
    expect(e.message).toMatch(/the 2 shards hold 2 tensors \(1 \+ 1\), but "split.tensors.count" is 3/);
  });

  it("merges as gguf-split --merge: first shard's metadata with split.count 0, tensor data byte-identical", async () => {
    const paths = await split("merge");
    const out = join(dir, "merged.gguf");
    await mergeGgufSplit(paths[0], out);
    const merged = openGguf(out);
    const expected = metadataEntries(openGguf(paths[0]));
    expected[expected.findIndex((e) => e.key === "split.count")].value = 0;
    expect(metadataEntries(merged)).toEqual(expected);
    expect(merged.tensors.map((t) => [t.name, t.offset])).toEqual(original.tensors.map((t) => [t.name, t.offset]));
    const a = readFileSync(out).subarray(merged.dataOffset);
    const b = readFileSync(ORIGINAL).subarray(original.dataOffset);
    expect(a.length).toBe(b.length);
    expect(Buffer.compare(a, b)).toBe(0);
    // split.count 0: not a shard any more; it can be split again, and merging a whole file is refused
    expect(openGgufModel(out).splits).toBeUndefined();
    const again = await writeGgufSplit(merged, join(dir, "again"), { maxTensors: 30 });
    expect(metadataEntries(openGguf(again[0])).filter((e) => e.key.startsWith("split."))).toEqual([
      { key: "split.no", type: { type: GgufValueType.UINT16 }, value: 0 },
      { key: "split.count", type: { type: GgufValueType.UINT16 }, value: 2 },
      { key: "split.tensors.count", type: { type: GgufValueType.INT32 }, value: 48 },
    ]);
    expect((await catchAsync(() => mergeGgufSplit(ORIGINAL, join(dir, "x.gguf")))).code).toBe("BAD_SPLIT");
    // never over an input
    expect((await catchAsync(() => mergeGgufSplit(paths[0], paths[1]))).code).toBe("IO");
    expect(
      (
        await catchAsync(() =>
          writeGgufSplit(openGgufModel(paths[0]), join(paths[0], "../stories260K"), { maxTensors: 20 }),
        )
      ).code,
    ).toBe("IO");
  });

  it("names a vocabulary-only file, a GPU index and activation statistics", () => {
    const vocab = openGgufModel(model("vocab/ggml-vocab-llama-spm.gguf"));
    expect(ggufFileKind(vocab)).toBe("vocabulary");
    expect(catchGguf(() => assertModelFile(vocab)).message).toMatch(
      /ggml-vocab-llama-spm\.gguf: this is a vocabulary-only file: it holds a tokenizer but no weights$/,
    );
    const idx = openGguf(model("powerinfer/tiny.generated.gpuidx"));
    expect(ggufFileKind(idx)).toBe("gpu-index");
    const e = catchGguf(() => assertModelFile(idx));
    expect(e.code).toBe("NOT_A_MODEL");
    expect(e.message).toMatch(/this is a PowerInfer GPU index/);
    expect(
      ggufFileKind({ metadata: new Map([["general.architecture", "powerinfer.activation_stats"]]), tensors: [] }),
    ).toBe("activation-stats");
    expect(ggufFileKind({ metadata: new Map(), tensors: [] })).toBe("empty");
  });
});

async function catchAsync(fn: () => Promise<unknown>): Promise<GgufError> {
  try {
    await fn();
  } catch (e) {
    if (e instanceof GgufError) return e;
    throw e;
  }
  throw new Error("expected a GgufError, but nothing was thrown");
}

/** Offset of the value of metadata key `key` (after its type field) in a file's bytes. */
function valueAt(buf: Uint8Array, key: string): number {
  const k = Buffer.from(key);
  const at = Buffer.from(buf).indexOf(Buffer.concat([Buffer.from(new BigUint64Array([BigInt(k.length)]).buffer), k]));
  expect(at).toBeGreaterThan(0);
  return at + 8 + k.length + 4;
}

describe("fuzz: damaged split models open whole or throw a typed GgufError", () => {
  it("300 seeded damages (shards truncated, split counts changed, shards removed or swapped), as files and joined with cat", async () => {
    const base = await split("fuzz-base");
    const bytes = base.map((p) => new Uint8Array(readFileSync(p)));
    const rand = rng(0x5911_7);
    const pick = <T>(a: readonly T[]): T => a[rand() % a.length];
    const allowed = new Set<GgufErrorCode>([
      "BAD_SPLIT",
      "DUPLICATE_TENSOR",
      "TRUNCATED",
      "LENGTH_PAST_END",
      "TENSOR_OUT_OF_BOUNDS",
      "IO", // the first shard removed
    ]);
    const outcomes = new Map<string, number>();
    const joinedOutcomes = new Map<string, number>();
    const sub = mkdtempSync(join(dir, "fuzz-"));
    const prefix = join(sub, "m");
    for (let iter = 0; iter < 300; iter++) {
      const files = bytes.map((b) => b.slice());
      const present = [true, true, true];
      const kinds: string[] = [];
      for (let m = 1 + (rand() % 2); m > 0; m--) {
        const i = rand() % 3;
        const kind = rand() % 5;
        if (kind === 0) {
          files[i] = files[i].subarray(0, rand() % (files[i].length + 1));
          kinds.push(`truncate ${i}`);
        } else if (kind === 1 || kind === 2) {
          const key = pick(["split.no", "split.count", "split.tensors.count"]);
          const at = valueAt(bytes[i], key);
          if (at + 4 > files[i].length) continue;
          const dv = new DataView(files[i].buffer, files[i].byteOffset);
          const v = pick([0, 1, 2, 3, 4, 47, 49, 0xffff, rand() & 0xffff]);
          if (key === "split.tensors.count") dv.setInt32(at, pick([v, -1]), true);
          else dv.setUint16(at, v, true);
          kinds.push(`${key}=${v} in ${i}`);
        } else if (kind === 3) {
          present[i] = false;
          kinds.push(`remove ${i}`);
        } else {
          const j = (i + 1) % 3;
          [files[i], files[j]] = [files[j], files[i]];
          kinds.push(`swap ${i} ${j}`);
        }
      }
      for (let i = 0; i < 3; i++) {
        const p = splitPath(prefix, i, 3);
        rmSync(p, { force: true });
        if (present[i]) writeFileSync(p, files[i]);
      }
      let outcome: string;
      try {
        const f = openGgufModel(splitPath(prefix, 0, 3));
        outcome = f.splits ? "opened" : "single";
        if (f.splits) {
          // whatever opens as a split model is the whole model, byte for byte
          expect(f.tensors.map((t) => t.name)).toEqual(original.tensors.map((t) => t.name));
          for (const t of original.tensors) {
            expect(Buffer.compare(readTensorBytes(f, t.name), readTensorBytes(original, t))).toBe(0);
          }
        }
      } catch (e) {
        if (!(e instanceof GgufError)) throw new Error(`#${iter} (${kinds.join(", ")}): ${(e as Error).stack}`);
        expect(allowed.has(e.code), `#${iter} (${kinds.join(", ")}): ${e.code} ${e.message}`).toBe(true);
        outcome = e.code;
      }
      outcomes.set(outcome, (outcomes.get(outcome) ?? 0) + 1);
      // the same shards joined with cat, opened for merging
      const joined = join(sub, "joined.gguf");
      writeFileSync(joined, Buffer.concat(files.filter((_, i) => present[i])));
      try {
        const f = openGgufModel(joined, { joined: true });
        if (f.splits) {
          expect(f.tensors.map((t) => t.name)).toEqual(original.tensors.map((t) => t.name));
          for (const t of original.tensors) {
            expect(Buffer.compare(readTensorBytes(f, t.name), readTensorBytes(original, t))).toBe(0);
          }
        }
        joinedOutcomes.set("opened", (joinedOutcomes.get("opened") ?? 0) + 1);
      } catch (e) {
        if (!(e instanceof GgufError)) throw new Error(`joined #${iter} (${kinds.join(", ")}): ${(e as Error).stack}`);
        expect(allowed.has(e.code) || e.code === "BAD_MAGIC", `joined #${iter}: ${e.code} ${e.message}`).toBe(true);
        joinedOutcomes.set(e.code, (joinedOutcomes.get(e.code) ?? 0) + 1);
      }
    }
    if (process.env.FUZZ_VERBOSE) console.log("joined", [...joinedOutcomes]);
    expect(joinedOutcomes.get("opened") ?? 0).toBeGreaterThan(0);
    expect(joinedOutcomes.get("BAD_SPLIT") ?? 0).toBeGreaterThan(0);
    if (process.env.FUZZ_VERBOSE) console.log([...outcomes]);
    expect(outcomes.get("BAD_SPLIT") ?? 0).toBeGreaterThan(50);
    expect(outcomes.get("opened") ?? 0).toBeGreaterThan(0);
    expect(outcomes.get("TENSOR_OUT_OF_BOUNDS") ?? 0).toBeGreaterThan(0);
  });
});
