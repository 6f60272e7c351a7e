/**
 * dReLU experts (TurboSparse-Mixtral: ReLU(gate)·ReLU(up) in Mixtral's layout), which llama.cpp cannot run:
 * the `llama` graph with `powerinfer.ffn_up_activation = "relu"` against a float64 forward pass of the same
 * model written here from the tensors (RMS norm, RoPE on adjacent pairs, causal grouped-query attention,
 * softmax router over the FFN input, top-k, weights renormalised over the chosen, dReLU experts), and
 * oracle-sparse experts against dense.
 */
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import type { Backend } from "@powerinfer/core";
import { argmax, Model } from "@powerinfer/engine";
import { dequantize, openGguf, parseModelConfig, readTensorBytes } from "@powerinfer/gguf";
import { generateSyntheticMoeModel, type SyntheticMoeShape } from "@powerinfer/synthetic";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { TINY_MOE_SHAPE } from "./moe-shape.js";

const probe = await cpuBackend.probe();
const dir = mkdtempSync(join(tmpdir(), "powerinfer-drelu-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const SHAPE: SyntheticMoeShape = TINY_MOE_SHAPE;

/** Float64 logits at every position of `tokens` (one causal pass), from the file's F32 tensors. */
function reference(path: string, tokens: number[]): Float64Array[] {
  const f = openGguf(path);
  const w = (name: string) => {
    const t = f.tensorMap.get(name);
    if (!t) throw new Error(`no ${name}`);
    return dequantize(t.type, readTensorBytes(f, t), t.nElements);
  };
  const { n_embd: E, n_ff_exp: F, n_expert: X, n_expert_used: U, n_head: H, n_head_kv: HK } = SHAPE;
  const hd = E / H;
  const V = f.tensorMap.get("token_embd.weight")!.shape[1]!;
  const eps = 1e-6;
  const base = 10000;
  const rms = (x: Float64Array, g: Float32Array) => {
    let ss = 0;
    for (const v of x) ss += v * v;
    const r = 1 / Math.sqrt(ss / x.length + eps);
    return Float64Array.from(x, (v, i) => v * r * g[i]!);
  };
  /** y = W·x for W stored as `rows` rows of `k` (ggml ne [k, rows]), starting at row r0. */
  const lin = (m: Float32Array, x: Float64Array, k: number, rows: number, r0 = 0) =>
    Float64Array.from({ length: rows }, (_, r) => {
      let s = 0;
      for (let j = 0; j < k; j++) s += m[(r0 + r) * k + j]! * x[j]!;
      return s;
    });
  const rope = (v: Float64Array, pos: number) => {
    for (let h = 0; h < v.length / hd; h++) {
      for (let i = 0; i < hd; i += 2) {
        const th = pos * base ** (-i / hd);
        const [c, s] = [Math.cos(th), Math.sin(th)];
        const a = v[h * hd + i]!;
        const b = v[h * hd + i + 1]!;
        v[h * hd + i] = a * c - b * s;
        v[h * hd + i + 1] = a * s + b * c;
      }
    }
    return v;
  };
  const L = parseModelConfig(f).n_layer;
  const emb = w("token_embd.weight");
  const K: Float64Array[][] = Array.from({ length: L }, () => []);
  const Vs: Float64Array[][] = Array.from({ length: L }, () => []);
  const out: Float64Array[] = [];
  for (const [pos, tok] of tokens.entries()) {
    let x = Float64Array.from(emb.subarray(tok * E, (tok + 1) * E));
    for (let l = 0; l < L; l++) {
      const p = `blk.${l}.`;
      const h = rms(x, w(`${p}attn_norm.weight`));
      const q = rope(lin(w(`${p}attn_q.weight`), h, E, E), pos);
      K[l]!.push(rope(lin(w(`${p}attn_k.weight`), h, E, HK * hd), pos));
      Vs[l]!.push(lin(w(`${p}attn_v.weight`), h, E, HK * hd));
      const att = new Float64Array(E);
      for (let hh = 0; hh < H; hh++) {
        const kv = Math.floor(hh / (H / HK));
        const sc = K[l]!.map((k) => {
          let s = 0;
          for (let i = 0; i < hd; i++) s += q[hh * hd + i]! * k[kv * hd + i]!;
          return s / Math.sqrt(hd);
        });
        const mx = Math.max(...sc);
        const e = sc.map((s) => Math.exp(s - mx));
        const z = e.reduce((a, b) => a + b, 0);
        for (const [j, v] of Vs[l]!.entries()) {
          for (let i = 0; i < hd; i++) att[hh * hd + i]! += (e[j]! / z) * v[kv * hd + i]!;
        }
      }
      const o = lin(w(`${p}attn_output.weight`), att, E, E);
      x = Float64Array.from(x, (v, i) => v + o[i]!);
      const h2 = rms(x, w(`${p}ffn_norm.weight`));
      const logits = lin(w(`${p}ffn_gate_inp.weight`), h2, E, X);
      const mx = Math.max(...logits);
      const pr = logits.map((v) => Math.exp(v - mx));
      const z = pr.reduce((a, b) => a + b, 0);
      const probs = pr.map((v) => v / z);
      const chosen = Array.from({ length: X }, (_, e) => e)
        .sort((a, b) => probs[b]! - probs[a]! || a - b)
        .slice(0, U);
      const wsum = chosen.reduce((s, e) => s + probs[e]!, 0);
      const [gate, up, down] = ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"].map((n) => w(`${p}${n}.weight`));
      for (const e of chosen) {
        const g = lin(gate!, h2, E, F, e * F);
        const u = lin(up!, h2, E, F, e * F);
        const a = Float64Array.from(g, (v, i) => Math.max(0, v) * Math.max(0, u[i]!));
        const y = lin(down!, a, F, E, e * E);
        for (let i = 0; i < E; i++) x[i]! += (probs[e]! / wsum) * y[i]!;
      }
    }
    const fin = rms(x, w("output_norm.weight"));
    out.push(lin(w(f.tensorMap.has("output.weight") ? "output.weight" : "token_embd.weight"), fin, E, V));
  }
  return out;
}

const maxDiff = (a: Float32Array, b: Float64Array) => a.reduce((m, v, i) => Math.max(m, Math.abs(v - b[i]!)), 0);

describe.skipIf(!probe.usable)(`dReLU experts (TurboSparse-Mixtral layout) (${probe.reason})`, () => {
  let backend: Backend;
  beforeAll(async () => {
    backend = await cpuBackend.load({ threads: 2 });
  });
  afterAll(() => backend?.dispose());

  it("equal a float64 forward of ReLU(gate)·ReLU(up) experts, and oracle-sparse experts give the dense logits", async () => {
    const path = join(dir, "drelu.gguf");
    generateSyntheticMoeModel(path, { arch: "llama-moe", shape: SHAPE, seed: 4, upActivation: "relu", design: {} });
    const m = await Model.load(path, { backend });
    const o = await Model.load(path, { backend, sparse: "oracle" });
    try {
      expect(m.config.ffn).toEqual({ activation: "relu", gated: true, up_activation: "relu" });
      expect(m.config.moe?.n_expert).toBe(8);
      const tokens = [1, 403, 17, 261, 378, 42, 42, 286];
      const ref = reference(path, tokens);
      // SiLU experts would differ from this reference by far more: the check can fail
      const s = m.createSession({ nCtx: 32, kvType: "f32" });
      const so = o.createSession({ nCtx: 32, kvType: "f32" });
      for (const [i, tok] of tokens.entries()) {
        const l = Float32Array.from(s.evaluate([tok]));
        const lo = Float32Array.from(so.evaluate([tok]));
        expect(maxDiff(l, ref[i]!), `position ${i}`).toBeLessThan(2e-4);
        expect(argmax(l)).toBe(ref[i]!.indexOf(Math.max(...ref[i]!)));
        // the gate decides (ReLU(gate) = 0 zeroes the neuron whatever up is): same products, summed by axpy
        expect(maxDiff(lo, Float64Array.from(l)), `oracle, position ${i}`).toBeLessThan(1e-4);
      }
      // the oracle computed up only where the gate fired: fewer than all of the chosen experts' neurons
      const rows = so.stats.activeRows;
      for (const r of rows) {
        expect(r).toBeGreaterThan(0);
        expect(r).toBeLessThan(SHAPE.n_ff_exp * SHAPE.n_expert_used * tokens.length);
      }
      s.dispose();
      so.dispose();
    } finally {
      m.dispose();
      o.dispose();
    }
  });

  it("reads powerinfer.ffn_up_activation only as relu on llama, and not against hidden_act", async () => {
    const bad = join(dir, "bad.gguf");
    const { writeGguf, GgufTypes } = await import("@powerinfer/gguf");
    const ok = join(dir, "ok.gguf");
    generateSyntheticMoeModel(ok, { arch: "llama-moe", shape: SHAPE, upActivation: "relu" });
    const f = openGguf(ok);
    const rewrite = (mutate: (meta: { key: string; type: unknown; value: unknown }[]) => void) => {
      const meta = [...f.metadata.entries()]
        .filter(([k]) => !k.startsWith("GGUF."))
        .map(([key, value]) => ({ key, type: f.metadataTypes.get(key)!, value }));
      mutate(meta);
      writeGguf(bad, {
        metadata: meta as never,
        tensors: f.tensors.map((t) => ({ name: t.name, type: t.type, shape: t.shape, data: readTensorBytes(f, t) })),
      });
      return openGguf(bad);
    };
    const withValue = rewrite((meta) => {
      meta.find((e) => e.key === "powerinfer.ffn_up_activation")!.value = "gelu";
    });
    expect(() => parseModelConfig(withValue)).toThrow(/"gelu" is not "relu"/);
    const withSilu = rewrite((meta) => meta.push({ key: "llama.hidden_act", type: GgufTypes.string, value: "silu" }));
    expect(() => parseModelConfig(withSilu)).toThrow(/contradicts powerinfer\.ffn_up_activation's dReLU FFN/);
    expect(() => generateSyntheticMoeModel(bad, { arch: "smallthinker", shape: SHAPE, upActivation: "relu" })).toThrow(
      /only "relu" on llama-moe/,
    );
  });
});
