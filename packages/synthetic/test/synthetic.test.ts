/**
 * The synthetic-model generator: shapes of the presets, determinism, GGUF/PWRI twins, encoders vs the
 * reference dequantization, the power law, and activation statistics measured on the generated file.
 */
import { createHash } from "node:crypto";
import { mkdtempSync, readdirSync, rmSync, statSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import {
  dequantize,
  f32ToBf16,
  f32ToF16,
  GGMLType,
  GgufError,
  type GgufStreamTensor,
  getTensor,
  openGguf,
  parseModelConfig,
  readTensorF32,
} from "@powerinfer/gguf";
import { afterAll, describe, expect, it } from "vitest";
import { Tokenizer } from "@powerinfer/tokenizer";
import {
  encode,
  encodedBytes,
  gauss,
  generateSyntheticModel,
  hotNeuronShare,
  normalCdf,
  normalQuantile,
  planSyntheticModel,
  powerLawFrequencies,
  SHAPE_PRESETS,
  type SyntheticDType,
  syntheticVocab,
} from "../src/index.js";

const dir = mkdtempSync(join(tmpdir(), "synthetic-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));
const models = process.env.POWERINFER_TEST_MODELS!;

async function tensorBytes(t: GgufStreamTensor): Promise<Uint8Array> {
  const parts: Uint8Array[] = [];
  for await (const c of t.data()) parts.push(c.slice());
  return Buffer.concat(parts);
}

const TINY = { preset: "tiny", statsTokens: 16 } as const;

describe("normal distribution and power law", () => {
  it("normalQuantile inverts normalCdf; gauss has mean 0 and variance 1", () => {
    for (const p of [1e-6, 0.001, 0.0243, 0.1, 0.5, 0.9, 0.99, 0.999999]) {
      expect(normalCdf(normalQuantile(p))).toBeCloseTo(p, 6);
    }
    expect(normalQuantile(0.975)).toBeCloseTo(1.959964, 5);
    let s = 0;
    let s2 = 0;
    let s4 = 0;
    const n = 200_000;
    for (let i = 0; i < n; i++) {
      const g = gauss(12345, i);
      s += g;
      s2 += g * g;
      s4 += g ** 4;
    }
    expect(Math.abs(s / n)).toBeLessThan(0.01);
    expect(s2 / n).toBeCloseTo(1, 2);
    expect(s4 / n).toBeGreaterThan(2.8); // near-Gaussian tails (kurtosis 3)
  });

  it.each([
    [0.1, 0.25],
    [0.05, 0.25],
    [0.1, 0.43],
    [0.3, 0.5],
  ])("mean %s: a share of %s of the neurons covers 80 percent of activations", (mean, hot) => {
    const p = powerLawFrequencies(11008, { mean, hotShare: hot });
    expect(p.reduce((a, b) => a + b, 0) / p.length).toBeCloseTo(mean, 6);
    expect(hotNeuronShare(p)).toBeCloseTo(hot, 3);
    for (let k = 1; k < p.length; k++) expect(p[k]!).toBeLessThanOrEqual(p[k - 1]!);
    expect(p[0]!).toBeLessThanOrEqual(0.99);
  });

  it("rejects laws that cannot exist", () => {
    expect(() => powerLawFrequencies(1000, { mean: 0.5, hotShare: 0.25 })).toThrow(/no power law/);
    expect(() => powerLawFrequencies(1000, { mean: 0.1, hotShare: 0.9 })).toThrow(RangeError);
    expect(() => powerLawFrequencies(1000, { mean: 0, hotShare: 0.25 })).toThrow(/active fraction/);
  });
});

describe("encoders", () => {
  const n = 1024;
  const src = Float32Array.from({ length: n }, (_, i) => gauss(7, i) * (i % 97 === 0 ? 40 : 0.02));
  src[5] = 1e-7; // F16 subnormal
  src[6] = 70000; // F16 overflow
  src[7] = -0;
  it("F16 and BF16 are bit-exact with @powerinfer/gguf's conversions (round to nearest even)", () => {
    for (const [dt, ref] of [
      ["F16", f32ToF16],
      ["BF16", f32ToBf16],
    ] as const) {
      const out = new Uint8Array(encodedBytes(dt, n) + 1);
      for (const off of [0, 1]) {
        const dst = out.subarray(off, off + 2 * n); // unaligned too
        encode(dt, Float32Array.from(src), dst);
        for (let i = 0; i < n; i++) expect(dst[2 * i]! | (dst[2 * i + 1]! << 8)).toBe(ref(src[i]!));
      }
    }
  });

  it.each([
    ["Q8_0", GGMLType.Q8_0, 1 / 127],
    ["Q4_0", GGMLType.Q4_0, 1 / 8],
    ["Q4_K", GGMLType.Q4_K, 1 / 8],
  ] as const)("%s decodes within its quantization step of the block maximum", (dt, type, step) => {
    const x = Float32Array.from({ length: n }, (_, i) => gauss(9, i) * 0.02 + (i === 300 ? 0.5 : 0));
    const dst = new Uint8Array(encodedBytes(dt as SyntheticDType, n));
    encode(dt as SyntheticDType, x, dst);
    const y = dequantize(type, dst, n);
    const block = dt === "Q4_K" ? 32 : 32;
    for (let b = 0; b < n; b += block) {
      let amax = 0;
      for (let j = 0; j < block; j++) amax = Math.max(amax, Math.abs(x[b + j]!));
      const tol = dt === "Q4_K" ? 2.2 * step * amax + 1e-3 : step * amax * 1.01 + 1e-6;
      for (let j = 0; j < block; j++) expect(Math.abs(y[b + j]! - x[b + j]!)).toBeLessThanOrEqual(tol);
    }
  });
});

describe("shape presets", () => {
  it.each([
    ["7b", "relu-llama", 6_738_415_616],
    ["13b", "relu-llama", 13_015_864_320],
    ["70b", "relu-llama", 68_976_648_192],
  ] as const)("%s with a 32000-token vocabulary has Llama 2's parameter count", (preset, arch, params) => {
    const { report, spec } = planSyntheticModel({ preset, arch, vocabSize: 32000, statsTokens: 0 });
    expect(report.params).toBe(params);
    expect(report.layers).toBe(SHAPE_PRESETS[preset].n_layer);
    expect(spec.tensors.length).toBe(3 + 9 * report.layers);
  });

  it("40b is Falcon-40B: fused QKV with 8 KV heads, two layer norms, no gate; 41.8 B parameters with its vocabulary size", () => {
    const { report, spec } = planSyntheticModel({ preset: "40b", vocabSize: 65024, statsTokens: 0 });
    expect(report.arch).toBe("falcon");
    expect(report.params / 1e9).toBeCloseTo(41.84, 1);
    const names = new Map(spec.tensors.map((t) => [t.name, t.shape]));
    expect(names.get("blk.0.attn_qkv.weight")).toEqual([8192, 8192 + 2 * 8 * 64]);
    expect(names.has("blk.0.attn_norm_2.weight")).toBe(true);
    expect(names.has("blk.0.ffn_gate.weight")).toBe(false);
    expect(names.get("blk.59.ffn_up.weight")).toEqual([8192, 32768]);
  });

  it("a slice keeps the shapes and says which part of the model it is", () => {
    const { report, spec } = planSyntheticModel({ preset: "7b", layers: 2, format: "PWRI", statsTokens: 2 });
    expect(report.layers).toBe(2);
    const names = new Map(spec.tensors.map((t) => [t.name, t.shape]));
    expect(names.get("blk.1.ffn_down_t.weight")).toEqual([4096, 11008]);
    expect(names.get("blk.1.fc1.weight")).toEqual([4096, 128]);
    expect(names.get("blk.1.fc2.weight")).toEqual([128, 11008]);
    expect(names.has("blk.2.attn_q.weight")).toBe(false);
    const meta = new Map((spec.metadata as { key: string; value: unknown }[]).map((e) => [e.key, e.value]));
    expect(meta.get("llama.block_count")).toBe(2);
    expect(meta.get("powerinfer.synthetic.full_block_count")).toBe(32);
    expect(meta.get("general.name")).toBe("synthetic relu-llama 7b (2 of 32 layers) F16");
    // 2 layers of F16 7B: 2 × (4·4096² + 3·4096·11008) weights + predictors, 1024-token vocabulary
    expect(report.bytes).toBeGreaterThan(2 * 2 * 202_375_168);
    expect(report.bytes).toBeLessThan(2 * 2 * 202_375_168 + 40 * 2 ** 20);
  });

  it("rejects impossible combinations with a clear message", () => {
    expect(() => planSyntheticModel({ ...TINY, arch: "llama", format: "PWRI" })).toThrow(/ReLU model/);
    expect(() => planSyntheticModel({ ...TINY, dtype: "BF16", format: "PWRI" })).toThrow(/no BF16/);
    expect(() =>
      planSyntheticModel({
        preset: { n_embd: 256, n_ff: 1000, n_head: 4, n_head_kv: 4, n_layer: 1, n_ctx: 64 },
        dtype: "Q4_0",
      }),
    ).toThrow(/multiples of 32/);
    expect(() => planSyntheticModel({ ...TINY, preset: "3b" as never })).toThrow(/unknown shape preset/);
    expect(() => planSyntheticModel({ ...TINY, format: "PWRI", dtype: "Q4_0", predictorRank: 48 })).toThrow(
      /multiple of 32/,
    );
    expect(() => planSyntheticModel({ ...TINY, layers: 0 })).toThrow(/layers/);
  });
});

describe("generated files", () => {
  it("are deterministic for a seed and differ across seeds", async () => {
    const digest = async (seed: number) => {
      const h = createHash("sha256");
      for (const t of planSyntheticModel({ ...TINY, seed, format: "PWRI" }).spec.tensors)
        h.update(await tensorBytes(t));
      return h.digest("hex");
    };
    expect(await digest(3)).toBe(await digest(3));
    expect(await digest(3)).not.toBe(await digest(4));
  });

  it("GGUF and PWRI of the same options hold the same weights (ffn_down is ffn_down_t transposed)", async () => {
    const g = planSyntheticModel({ ...TINY, dtype: "F32" }).spec.tensors;
    const p = planSyntheticModel({ ...TINY, dtype: "F32", format: "PWRI" }).spec.tensors;
    const byName = (ts: GgufStreamTensor[]) => new Map(ts.map((t) => [t.name, t]));
    const G = byName(g);
    const P = byName(p);
    for (const [name, t] of G) {
      if (name.includes("ffn_down")) continue;
      expect(Buffer.from(await tensorBytes(t)).equals(await tensorBytes(P.get(name)!)), name).toBe(true);
    }
    const down = new Float32Array((await tensorBytes(G.get("blk.1.ffn_down.weight")!)).buffer); // {n_ff, n_embd}
    const downT = new Float32Array((await tensorBytes(P.get("blk.1.ffn_down_t.weight")!)).buffer); // {n_embd, n_ff}
    const [E, F] = [256, 1024];
    for (const [e, i] of [
      [0, 0],
      [5, 77],
      [255, 1023],
      [100, 512],
    ] as const) {
      expect(down[e * F + i]).toBe(downT[i * E + e]);
    }
  });

  it("quantized files keep the massive channel alone in its block, so the gate biases survive Q4_0 and Q8_0", async () => {
    const f32 = planSyntheticModel({ ...TINY, dtype: "F32", statsTokens: 0 });
    const c = f32.report.design.massiveChannel;
    const r0 = Math.floor(c / 32) * 32;
    const gate32 = new Float32Array(
      (await tensorBytes(f32.spec.tensors.find((t) => t.name === "blk.0.ffn_gate.weight")!)).buffer,
    );
    const emb32 = new Float32Array((await tensorBytes(f32.spec.tensors[0]!)).buffer);
    for (let e = r0; e < r0 + 32; e++) expect(emb32[e]).toBe(e === c ? 100 : 0);
    for (const [dt, type] of [
      ["Q4_0", GGMLType.Q4_0],
      ["Q8_0", GGMLType.Q8_0],
    ] as const) {
      const q = planSyntheticModel({ ...TINY, dtype: dt, statsTokens: 0 });
      const bytes = await tensorBytes(q.spec.tensors.find((t) => t.name === "blk.0.ffn_gate.weight")!);
      const gate = dequantize(type, bytes, 256 * 1024);
      for (let i = 0; i < 1024; i += 37) {
        expect(Math.abs(gate[i * 256 + c]! - gate32[i * 256 + c]!)).toBeLessThanOrEqual(
          1e-3 * Math.abs(gate32[i * 256 + c]!),
        );
        for (let e = r0; e < r0 + 32; e++) if (e !== c) expect(Math.abs(gate[i * 256 + e]!)).toBe(0);
      }
    }
  });

  it("a PWRI file: the engine's config sees predictors, down_t and the calibrated threshold; the SPM vocabulary round-trips text", async () => {
    const path = join(dir, "tiny.pwri.gguf");
    const report = await generateSyntheticModel(path, { ...TINY, format: "PWRI", dtype: "Q8_0" }, { fsync: false });
    const f = openGguf(path);
    expect(f.format).toBe("PWRI");
    expect(statSync(path).size).toBe(report.bytes);
    const cfg = parseModelConfig(f);
    expect(cfg).toMatchObject({ arch: "llama", n_embd: 256, n_ff: 1024, n_head: 4, n_head_kv: 2, n_layer: 2 });
    expect(cfg.ffn).toEqual({ activation: "relu", gated: true });
    expect(cfg.has_predictors).toBe(true);
    expect(cfg.predictor_ranks).toEqual([128, 128]);
    expect(cfg.down_transposed).toBe(true);
    expect(cfg.sparse_threshold).toBe(report.threshold);
    expect(report.threshold).toBeLessThan(0); // recall 0.95 needs a threshold below 0
    expect(getTensor(f, "blk.0.ffn_gate.weight").type).toBe(GGMLType.Q8_0);
    expect(getTensor(f, "blk.0.fc2.weight").type).toBe(GGMLType.Q8_0);
    expect(getTensor(f, "blk.0.attn_norm.weight").type).toBe(GGMLType.F32);
    const tok = Tokenizer.fromGguf(f);
    const text = "Once upon a time, there was a tiny model. Ünïcödé 123!";
    expect(tok.detokenize(tok.tokenize(text, { addSpecial: false }))).toBe(text);
    expect(tok.tokenize("hi", { addSpecial: true })[0]).toBe(1);
  });

  it("bamboo and falcon files parse with their FFN forms", async () => {
    for (const [arch, ffn] of [
      ["bamboo", { activation: "relu", gated: true, up_activation: "relu" }],
      ["falcon", { activation: "relu", gated: false }],
    ] as const) {
      const path = join(dir, `${arch}.gguf`);
      await generateSyntheticModel(path, { ...TINY, arch, format: "PWRI", dtype: "F16" }, { fsync: false });
      const cfg = parseModelConfig(openGguf(path));
      expect(cfg.arch).toBe(arch);
      expect(cfg.ffn).toEqual(ffn);
      expect(cfg.has_predictors).toBe(true);
    }
  });

  it("copies a vocabulary from a vocab GGUF", () => {
    const { report, spec } = planSyntheticModel({
      ...TINY,
      vocabFrom: join(models, "vocab/ggml-vocab-llama-spm.gguf"),
    });
    expect(report.n_vocab).toBe(32000);
    expect(spec.tensors[0]!.shape).toEqual([256, 32000]);
  });

  it("refuses to write when the disk lacks room and leaves nothing behind", async () => {
    const sub = mkdtempSync(join(dir, "full-"));
    const e = await generateSyntheticModel(join(sub, "m.gguf"), TINY, { reserveBytes: 2 ** 60 }).catch((x) => x);
    expect(e).toBeInstanceOf(GgufError);
    expect((e as GgufError).message).toMatch(/not enough disk space/);
    expect(readdirSync(sub)).toEqual([]);
  });

  it("activations measured on the written file: ~10 % active, ~25 % of neurons give 80 %, predictors recall ≥ 0.93", async () => {
    const path = join(dir, "stats.pwri.gguf");
    const report = await generateSyntheticModel(path, { ...TINY, format: "PWRI", dtype: "F32" }, { fsync: false });
    const f = openGguf(path);
    const [E, F, T] = [256, 1024, 600];
    const emb = readTensorF32(f, "token_embd.weight");
    const cfg = parseModelConfig(f);
    for (let l = 0; l < 2; l++) {
      const gate = readTensorF32(f, `blk.${l}.ffn_gate.weight`);
      const fc1 = readTensorF32(f, `blk.${l}.fc1.weight`);
      const fc2 = readTensorF32(f, `blk.${l}.fc2.weight`);
      const r = 128;
      const counts = new Float64Array(F);
      let tp = 0;
      let pred = 0;
      let pos = 0;
      const h = new Float64Array(E);
      const y = new Float64Array(r);
      for (let t = 0; t < T; t++) {
        const id = 3 + ((t * 7919) % (cfg.n_vocab - 3));
        const x = emb.subarray(id * E, (id + 1) * E);
        let ss = 0;
        for (let e = 0; e < E; e++) ss += x[e]! * x[e]!;
        const inv = 1 / Math.sqrt(ss / E + 1e-5);
        for (let e = 0; e < E; e++) h[e] = x[e]! * inv;
        for (let k = 0; k < r; k++) {
          let s = 0;
          for (let e = 0; e < E; e++) s += fc1[k * E + e]! * x[e]!;
          y[k] = Math.max(0, s);
        }
        for (let i = 0; i < F; i++) {
          let g = 0;
          for (let e = 0; e < E; e++) g += gate[i * E + e]! * h[e]!;
          let z = 0;
          for (let k = 0; k < r; k++) z += fc2[i * r + k]! * y[k]!;
          const on = g > 0;
          const p = z >= cfg.sparse_threshold;
          counts[i]! += on ? 1 : 0;
          pos += on ? 1 : 0;
          pred += p ? 1 : 0;
          tp += on && p ? 1 : 0;
        }
      }
      const active = pos / (T * F);
      expect(active).toBeGreaterThan(0.08);
      expect(active).toBeLessThan(0.12);
      // the empirical hot set of a finite sample is a little smaller than the law's
      expect(hotNeuronShare(counts)).toBeGreaterThan(0.19);
      expect(hotNeuronShare(counts)).toBeLessThan(0.3);
      expect(tp / pos).toBeGreaterThan(0.93);
      expect(pred / pos).toBeLessThan(1.5);
      expect(Math.abs(report.perLayer[l]!.activeFraction - active)).toBeLessThan(0.03);
    }
  });
});

describe("synthetic vocabulary", () => {
  it("has special, byte and piece tokens, no duplicates", () => {
    const v = syntheticVocab(1024);
    const tokens = v.find((e) => e.key === "tokenizer.ggml.tokens")!.value as string[];
    expect(tokens.length).toBe(1024);
    expect(new Set(tokens).size).toBe(1024);
    expect(tokens.slice(0, 4)).toEqual(["<unk>", "<s>", "</s>", "<0x00>"]);
    expect(() => syntheticVocab(100)).toThrow(RangeError);
  });
});
