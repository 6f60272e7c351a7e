/**
 * The falcon and opt graphs.
 * - falcon: generated files (the 40B layout: fused attn_qkv, attn_norm_2, no ffn_norm) against llama.cpp
 *   built for this CPU (node-llama-cpp), which runs falcon with GELU: the file is rewritten without
 *   `falcon.hidden_act` and with distinct norm weights (so swapping attn_norm and attn_norm_2 would show);
 *   the ReLU file (PowerInfer's ReLU-Falcon) in dense, oracle and predictor modes.
 * - opt (llama.cpp has no OPT): a small random OPT model written here against a float64 forward pass of
 *   Hugging Face's `OPTForCausalLM` (pre-layer-norm, learned positions with the offset of 2, biases, ReLU).
 */
import { spawnSync } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import type { Backend } from "@powerinfer/core";
import { argmax, EngineError, Model } from "@powerinfer/engine";
import { generateSyntheticModel } from "@powerinfer/synthetic";
import {
  GGMLType,
  type GgufMetadataEntry,
  GgufTypes,
  metadataEntries,
  openGguf,
  readTensorBytes,
  readTensorF32,
  writeGguf,
} from "@powerinfer/gguf";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { type LlamaCppPeer, loadLlamaCpp } from "../src/bench/llama-cpp.js";

const models = process.env.POWERINFER_TEST_MODELS!;
const probe = await cpuBackend.probe();
const peer = await loadLlamaCpp();
const dir = mkdtempSync(join(tmpdir(), "archs-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

/** Deterministic values in [-1, 1). */
function noise(n: number, seed: number): Float32Array {
  let s = seed >>> 0 || 1;
  return Float32Array.from({ length: n }, () => {
    s ^= s << 13;
    s ^= s >>> 17;
    s ^= s << 5;
    return (s >>> 0) / 2 ** 31 - 1;
  });
}

const f32Bytes = (a: Float32Array) => new Uint8Array(a.buffer, a.byteOffset, a.byteLength);

/** Greedy ids and the logits before each, one token at a time after the prompt batch. */
function greedy(model: Model, prompt: number[], n: number, kvType: "f16" | "f32" = "f16") {
  const s = model.createSession({ nCtx: 128, kvType });
  let l = s.evaluate(prompt);
  const ids: number[] = [];
  const logits: Float32Array[] = [];
  for (let i = 0; i < n; i++) {
    logits.push(Float32Array.from(l));
    ids.push(argmax(l));
    if (i < n - 1) l = s.evaluate([ids[i]!]);
  }
  s.dispose();
  return { ids, logits };
}

const maxDiff = (a: ArrayLike<number>, b: ArrayLike<number>) => {
  let w = 0;
  for (let i = 0; i < a.length; i++) w = Math.max(w, Math.abs(a[i]! - b[i]!));
  return w;
};

describe.skipIf(!probe.usable)(`falcon (${probe.reason})`, () => {
  let backend: Backend;
  const relu = join(dir, "falcon-relu.gguf");
  const pwri = join(dir, "falcon-relu.pwri.gguf");
  beforeAll(async () => {
    backend = await cpuBackend.load({ threads: 2 });
    const common = { preset: "tiny", arch: "falcon", dtype: "F32", vocabSize: 512, statsTokens: 64 } as const;
    await generateSyntheticModel(relu, { ...common, format: "GGUF" }, { fsync: false });
    await generateSyntheticModel(pwri, { ...common, format: "PWRI" }, { fsync: false });
  }, 120_000);
  afterAll(() => backend?.dispose());

  it("reads the 40B layout: fused q/k/v rows, attn_norm_2, LayerNorm with bias, parallel blocks, ReLU(up)", async () => {
    const m = await Model.load(relu, { backend });
    try {
      expect(m.config.arch).toBe("falcon");
      expect(m.config.parallel_attn).toBe(true);
      expect(m.config.rope.type).toBe("neox");
      expect(m.config.norm.type).toBe("layer");
      expect(m.config.ffn).toEqual({ activation: "relu", gated: false });
    } finally {
      m.dispose();
    }
  });

  it.skipIf("unavailable" in peer)(
    `equals llama.cpp built for this CPU (GELU file, F32 and Q8_0 weights) ${"unavailable" in peer ? peer.unavailable : ""}`,
    async () => {
      const llama = peer as LlamaCppPeer;
      try {
        for (const dtype of ["F32", "Q8_0"] as const) {
          const src = join(dir, `falcon-${dtype}.gguf`);
          await generateSyntheticModel(
            src,
            { preset: "tiny", arch: "falcon", dtype, vocabSize: 512, statsTokens: 0 },
            { fsync: false },
          );
          // without falcon.hidden_act (GELU, as llama.cpp runs falcon), with distinct norm weights
          const f = openGguf(src);
          const gelu = join(dir, `falcon-${dtype}-gelu.gguf`);
          let seed = 7;
          writeGguf(gelu, {
            metadata: metadataEntries(f).filter((e) => !e.key.endsWith(".hidden_act")),
            tensors: f.tensors.map((t) => ({
              name: t.name,
              type: t.type,
              shape: [...t.shape],
              data: /norm(_2)?\.(weight|bias)$/.test(t.name)
                ? f32Bytes(noise(t.shape[0]!, seed++).map((v) => (t.name.endsWith("weight") ? 1 + 0.5 * v : 0.2 * v)))
                : () => readTensorBytes(f, t),
            })),
          });
          const runner = await llama.open(gelu, { contextSize: 128, batchSize: 128, threads: 1 });
          const m = await Model.load(gelu, { backend });
          try {
            expect(m.config.ffn.activation).toBe("gelu");
            for (const prompt of [
              [1, 17, 250, 300, 42],
              [1, 400, 3, 3, 77, 91, 200, 150, 12],
            ]) {
              const theirs = await runner.greedy(prompt, 12);
              const ours = greedy(m, prompt, 12);
              expect(ours.ids).toEqual(theirs.ids);
              ours.logits.forEach((l, i) => {
                expect(maxDiff(l, theirs.logits[i]!), `${dtype} step ${i}`).toBeLessThan(dtype === "F32" ? 1e-4 : 2e-3);
              });
            }
          } finally {
            m.dispose();
            await runner.dispose();
          }
        }
      } finally {
        await llama.dispose();
      }
    },
    120_000,
  );

  it("ReLU falcon: oracle mode equals dense and reads only the firing rows; predictor mode runs its predictors", async () => {
    const dense = await Model.load(relu, { backend });
    const oracle = await Model.load(relu, { backend, sparse: "oracle" });
    const pred = await Model.load(pwri, { backend });
    const all = await Model.load(pwri, { backend, threshold: -3.4e38 });
    try {
      const prompt = [1, 33, 250, 301, 42, 7];
      const d = greedy(dense, prompt, 8);
      const o = greedy(oracle, prompt, 8);
      expect(o.ids).toEqual(d.ids);
      for (const [i, l] of o.logits.entries()) expect(maxDiff(l, d.logits[i]!)).toBeLessThan(1e-4);
      // PWRI (ffn_down_t, predictors): every neuron on gives the dense logits
      const a = greedy(all, prompt, 8);
      expect(a.ids).toEqual(d.ids);
      for (const [i, l] of a.logits.entries()) expect(maxDiff(l, d.logits[i]!)).toBeLessThan(1e-4);
      // predictor mode: the default for PWRI; rows read per token match the predicted set (10 % firing)
      expect(pred.sparse).toBe("predictor");
      // every column's logits: the last layer's FFN runs on every token too
      const s = oracle.createSession({ nCtx: 64 });
      s.evaluate(prompt, { allLogits: true });
      const active = s.stats.activeRows;
      s.dispose();
      const p = pred.createSession({ nCtx: 64 });
      p.evaluate(prompt, { allLogits: true });
      const predicted = p.stats.activeRows;
      p.dispose();
      const nff = dense.config.n_ff * prompt.length;
      for (const rows of [active, predicted]) {
        expect(rows.length).toBe(dense.config.n_layer);
        for (const r of rows) expect(r / nff).toBeGreaterThan(0.02);
        for (const r of rows) expect(r / nff).toBeLessThan(0.3);
      }
    } finally {
      for (const m of [dense, oracle, pred, all]) m.dispose();
    }
  });
});

// ---- OPT ----------------------------------------------------------------------------------------

interface OptSpec {
  E: number;
  F: number;
  H: number;
  L: number;
  V: number;
  ctx: number;
}

/** Writes a random OPT model (F32) with stories260K's vocabulary; returns its weights for the reference. */
function writeOpt(path: string, c: OptSpec, posOffset: 0 | 2) {
  const voc = openGguf(join(models, "stories260K.gguf"));
  const meta: GgufMetadataEntry[] = [
    { key: "general.architecture", type: GgufTypes.string, value: "opt" },
    { key: "general.name", type: GgufTypes.string, value: "tiny random opt" },
    { key: "opt.context_length", type: GgufTypes.u32, value: c.ctx },
    { key: "opt.embedding_length", type: GgufTypes.u32, value: c.E },
    { key: "opt.block_count", type: GgufTypes.u32, value: c.L },
    { key: "opt.feed_forward_length", type: GgufTypes.u32, value: c.F },
    { key: "opt.attention.head_count", type: GgufTypes.u32, value: c.H },
    { key: "opt.attention.layer_norm_epsilon", type: GgufTypes.f32, value: 1e-5 },
    ...metadataEntries(voc).filter((e) => e.key.startsWith("tokenizer.")),
  ];
  const W = new Map<string, { shape: number[]; data: Float32Array }>();
  let seed = 11;
  const add = (name: string, shape: number[], scale: number, base = 0) => {
    const n = shape.reduce((a, b) => a * b, 1);
    W.set(name, { shape, data: noise(n, seed++).map((v) => base + scale * v) });
  };
  add("token_embd.weight", [c.E, c.V], 1);
  add("position_embd.weight", [c.E, c.ctx + posOffset], 0.5);
  const s = 1 / Math.sqrt(c.E);
  for (let l = 0; l < c.L; l++) {
    const p = `blk.${l}.`;
    add(`${p}attn_norm.weight`, [c.E], 0.3, 1);
    add(`${p}attn_norm.bias`, [c.E], 0.1);
    for (const x of ["q", "k", "v"]) {
      add(`${p}attn_${x}.weight`, [c.E, c.E], 2 * s);
      add(`${p}attn_${x}.bias`, [c.E], 0.1);
    }
    add(`${p}attn_output.weight`, [c.E, c.E], s);
    add(`${p}attn_output.bias`, [c.E], 0.1);
    add(`${p}ffn_norm.weight`, [c.E], 0.3, 1);
    add(`${p}ffn_norm.bias`, [c.E], 0.1);
    add(`${p}ffn_up.weight`, [c.E, c.F], 2 * s);
    add(`${p}ffn_up.bias`, [c.F], 0.3, -0.2);
    add(`${p}ffn_down.weight`, [c.F, c.E], 1 / Math.sqrt(c.F));
    add(`${p}ffn_down.bias`, [c.E], 0.1);
  }
  add("output_norm.weight", [c.E], 0.3, 1);
  add("output_norm.bias", [c.E], 0.1);
  // no output.weight: tied to token_embd, as OPT's lm_head
  writeGguf(path, {
    metadata: meta,
    tensors: [...W].map(([name, t]) => ({ name, type: GGMLType.F32, shape: t.shape, data: f32Bytes(t.data) })),
  });
  return W;
}

/** float64 OPT forward (Hugging Face OPTForCausalLM, do_layer_norm_before): logits after every token. */
function optReference(W: Map<string, { data: Float32Array }>, c: OptSpec, posOffset: number, tokens: number[]) {
  const w = (n: string) => W.get(n)!.data;
  const { E, F, H } = c;
  const hd = E / H;
  const ln = (x: Float64Array, g: Float32Array, b: Float32Array) => {
    let mu = 0;
    for (const v of x) mu += v;
    mu /= E;
    let va = 0;
    for (const v of x) va += (v - mu) ** 2;
    va /= E;
    const r = 1 / Math.sqrt(va + 1e-5);
    return Float64Array.from(x, (v, i) => (v - mu) * r * g[i]! + b[i]!);
  };
  /** y[n] = Σ_k W[k + n·K] x[k] + b[n] (ggml layout: row n holds output n). */
  const lin = (m: Float32Array, x: Float64Array, K: number, N: number, b?: Float32Array) =>
    Float64Array.from({ length: N }, (_, n) => {
      let s = b ? b[n]! : 0;
      for (let k = 0; k < K; k++) s += m[n * K + k]! * x[k]!;
      return s;
    });
  const K: Float64Array[][] = Array.from({ length: c.L }, () => []);
  const V: Float64Array[][] = Array.from({ length: c.L }, () => []);
  const out: Float64Array[] = [];
  tokens.forEach((tok, pos) => {
    let x = Float64Array.from(
      { length: E },
      (_, i) => w("token_embd.weight")[tok * E + i]! + w("position_embd.weight")[(pos + posOffset) * E + i]!,
    );
    for (let l = 0; l < c.L; l++) {
      const p = `blk.${l}.`;
      const h = ln(x, w(`${p}attn_norm.weight`), w(`${p}attn_norm.bias`));
      const q = lin(w(`${p}attn_q.weight`), h, E, E, w(`${p}attn_q.bias`));
      K[l]!.push(lin(w(`${p}attn_k.weight`), h, E, E, w(`${p}attn_k.bias`)));
      V[l]!.push(lin(w(`${p}attn_v.weight`), h, E, E, w(`${p}attn_v.bias`)));
      const att = new Float64Array(E);
      for (let hh = 0; hh < H; hh++) {
        const sc = K[l]!.map((k) => {
          let d = 0;
          for (let i = 0; i < hd; i++) d += q[hh * hd + i]! * k[hh * hd + i]!;
          return d / Math.sqrt(hd);
        });
        const mx = Math.max(...sc);
        const e = sc.map((v) => Math.exp(v - mx));
        const z = e.reduce((a, b) => a + b, 0);
        for (let i = 0; i < hd; i++) {
          let s = 0;
          e.forEach((pj, j) => {
            s += pj * V[l]![j]![hh * hd + i]!;
          });
          att[hh * hd + i] = s / z;
        }
      }
      const o = lin(w(`${p}attn_output.weight`), att, E, E, w(`${p}attn_output.bias`));
      x = Float64Array.from(x, (v, i) => v + o[i]!);
      const h2 = ln(x, w(`${p}ffn_norm.weight`), w(`${p}ffn_norm.bias`));
      const a = lin(w(`${p}ffn_up.weight`), h2, E, F, w(`${p}ffn_up.bias`)).map((v) => Math.max(0, v));
      const d = lin(w(`${p}ffn_down.weight`), a, F, E, w(`${p}ffn_down.bias`));
      x = Float64Array.from(x, (v, i) => v + d[i]!);
    }
    const f = ln(x, w("output_norm.weight"), w("output_norm.bias"));
    out.push(lin(W.has("output.weight") ? w("output.weight") : w("token_embd.weight"), f, E, c.V));
  });
  return out;
}

describe.skipIf(!probe.usable)(`opt (${probe.reason})`, () => {
  let backend: Backend;
  beforeAll(async () => {
    backend = await cpuBackend.load({ threads: 2 });
  });
  afterAll(() => backend?.dispose());
  const spec: OptSpec = { E: 64, F: 256, H: 4, L: 2, V: 512, ctx: 32 };

  for (const posOffset of [2, 0] as const) {
    it(`equals a float64 OPTForCausalLM forward (position table ${posOffset ? "with" : "without"} the 2 padding rows)`, async () => {
      const path = join(dir, `opt-${posOffset}.gguf`);
      const W = writeOpt(path, spec, posOffset);
      const m = await Model.load(path, { backend });
      try {
        expect(m.config.arch).toBe("opt");
        expect(m.config.rope.type).toBe("none");
        const tokens = [1, 403, 407, 261, 378, 432, 383, 286];
        const ref = optReference(W, spec, posOffset, tokens);
        // prompt as one batch (all logits), then token by token
        const s = m.createSession({ nCtx: 32, kvType: "f32" });
        const all = s.evaluate(tokens.slice(0, 4), { allLogits: true });
        s.dispose();
        const t = m.createSession({ nCtx: 32, kvType: "f32" });
        tokens.forEach((tok, i) => {
          const l = t.evaluate([tok]);
          expect(maxDiff(l, ref[i]!), `position ${i}`).toBeLessThan(2e-4);
          if (i === 3) expect(maxDiff(l, all.subarray(all.length - spec.V))).toBeLessThan(1e-5);
        });
        t.dispose();
        // sparse oracle mode (the up bias decides the firing set) equals dense
        const o = await Model.load(path, { backend, sparse: "oracle" });
        try {
          expect(greedy(o, tokens, 6, "f32").ids).toEqual(greedy(m, tokens, 6, "f32").ids);
        } finally {
          o.dispose();
        }
      } finally {
        m.dispose();
      }
    });
  }

  it("gen-model --arch opt writes a file the OPT graph runs, equal to the float64 OPTForCausalLM forward", async () => {
    const path = join(dir, "opt-generated.gguf");
    const bin = join(import.meta.dirname, "..", "dist", "bin.js");
    const r = spawnSync(
      process.execPath,
      [bin, "gen-model", "--preset", "tiny", "--arch", "opt", "--dtype", "F32", "--stats-tokens", "0", "-o", path],
      { encoding: "utf8" },
    );
    expect(r.status, r.stderr).toBe(0);
    expect(r.stdout).toMatch(/llama\.cpp has no opt architecture/);
    const file = openGguf(path);
    const W = new Map<string, { data: Float32Array }>();
    for (const t of file.tensors) {
      expect(t.type, t.name).toBe(GGMLType.F32);
      W.set(t.name, { data: readTensorF32(file, t) });
    }
    const c: OptSpec = { E: 256, F: 1024, H: 4, L: 2, V: 1024, ctx: 512 };
    expect(file.tensorMap.get("position_embd.weight")?.shape).toEqual([256, 514]); // HF's 2 padding rows
    expect(file.tensorMap.get("blk.1.attn_k.weight")?.shape).toEqual([256, 256]); // no GQA in OPT
    const m = await Model.load(path, { backend });
    try {
      expect(m.config.arch).toBe("opt");
      expect(m.config.ffn).toEqual({ activation: "relu", gated: false });
      const tokens = [1, 403, 407, 261, 378, 432];
      const ref = optReference(W, c, 2, tokens);
      const t = m.createSession({ nCtx: 64, kvType: "f32" });
      tokens.forEach((tok, i) => {
        const l = t.evaluate([tok]);
        const scale = Math.max(...ref[i]!.map(Math.abs));
        expect(maxDiff(l, ref[i]!) / scale, `position ${i}`).toBeLessThan(1e-4);
      });
      t.dispose();
      // the designed sparsity: about 10 % of the FFN neurons fire per token
      const o = await Model.load(path, { backend, sparse: "oracle" });
      try {
        const s = o.createSession({ nCtx: 64 });
        s.evaluate(tokens, { allLogits: true }); // every token through every layer's FFN
        for (const rows of s.stats.activeRows) {
          expect(rows / (c.F * tokens.length)).toBeGreaterThan(0.04);
          expect(rows / (c.F * tokens.length)).toBeLessThan(0.2);
        }
        s.dispose();
      } finally {
        o.dispose();
      }
    } finally {
      m.dispose();
    }
  });

  it("the context ends with the learned positions: n_ctx capped (said), then a typed CONTEXT_FULL error", async () => {
    const path = join(dir, "opt-short.gguf");
    writeOpt(path, spec, 2);
    const m = await Model.load(path, { backend });
    try {
      const s = m.createSession({ nCtx: 64 });
      expect(s.nCtx).toBe(32);
      expect(s.warnings.join("\n")).toMatch(/capped to the 32 positions this model learned/);
      s.evaluate(Array.from({ length: 32 }, (_, i) => 1 + i));
      let err: unknown;
      try {
        s.evaluate([5]);
      } catch (e) {
        err = e;
      }
      expect(err).toBeInstanceOf(EngineError);
      expect((err as EngineError).code).toBe("CONTEXT_FULL");
      expect((err as Error).message).toMatch(/context full/);
      s.dispose();
    } finally {
      m.dispose();
    }
  });
});
