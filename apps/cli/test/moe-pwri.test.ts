/**
 * Routed experts in the PowerInfer layout (`gen-model --format pwri`, `convert --to pwri`): each expert's
 * down projection stored neuron-major, `blk.N.ffn_down_exps_t.weight` {n_embd, n_ff_exp, n_expert}, so that
 * sparse experts read only the firing neurons' down rows in any dtype (a quantized `ffn_down_exps` runs
 * densely: it has no neuron-major form of its own size).
 * - The generator writes the GGUF's values: F32 `ffn_down_exps_t` is `ffn_down_exps` transposed expert by
 *   expert, bit for bit, and every other tensor holds the same bytes.
 * - F32: predictor-mode logits equal the GGUF's bit for bit (the GGUF's down stack is transposed at load to
 *   the same rows); dense logits within float rounding (the GGUF's dense down is a dot, the PWRI's an axpy).
 * - Q4_0 (the layout's reason): oracle mode and predictor mode with every neuron predicted give the dense
 *   run's logits bit for bit; the kernels' row counters show the down projection reading exactly the rows
 *   up reads (the firing neurons of the chosen experts), where the GGUF's quantized down reads none sparsely.
 * - `convert --to pwri` and back: F32 round trip is bit-exact; a quantized stack is re-quantized, with a note.
 * - The configuration reader refuses a layer that stores both layouts, and a stack of the wrong shape.
 */
import { spawnSync } from "node:child_process";
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import type { Backend } from "@powerinfer/core";
import { argmax, Model, type SparseMode } from "@powerinfer/engine";
import {
  type GgufTensorSpec,
  openGguf,
  parseModelConfig,
  readTensorBytes,
  readTensorF32,
  writeGguf,
  metadataEntries,
} from "@powerinfer/gguf";
import { generateSyntheticMoeModel } from "@powerinfer/synthetic";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { TINY_MOE_SHAPE } from "./moe-shape.js";

const probe = await cpuBackend.probe();
const bin = join(dirname(fileURLToPath(import.meta.url)), "..", "dist", "bin.js");
const dir = mkdtempSync(join(tmpdir(), "moe-pwri-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const { n_embd: E, n_ff_exp: F, n_expert: X, n_layer: NL } = TINY_MOE_SHAPE;
const PROMPT = [1, 20, 30, 40, 50, 60, 70, 80];

function gen(name: string, dtype: "F32" | "Q4_0", format: "GGUF" | "PWRI"): string {
  const path = join(dir, name);
  generateSyntheticMoeModel(path, {
    arch: "smallthinker",
    shape: TINY_MOE_SHAPE,
    dtype,
    untiedOutput: false,
    seed: 5,
    design: {},
    predictors: {},
    format,
  });
  return path;
}

/** Logits of the prompt and of `n` greedy steps after it; the session's sparse counters. */
function run(model: Model, n: number) {
  const s = model.createSession({ nCtx: 64, kvType: "f32" });
  try {
    let l = s.evaluate(PROMPT);
    const logits: Float32Array[] = [];
    for (let i = 0; i < n; i++) {
      logits.push(Float32Array.from(l));
      l = s.evaluate([argmax(l)]);
    }
    return { logits, stats: { ...s.stats, activeRows: [...s.stats.activeRows] } };
  } finally {
    s.dispose();
  }
}

function cli(...args: string[]) {
  return spawnSync(process.execPath, [bin, ...args], { encoding: "utf8", timeout: 120_000 });
}

describe.skipIf(!probe.usable)(`routed experts, PowerInfer layout (${probe.reason})`, () => {
  let backend: Backend;
  const f: Record<string, string> = {};
  beforeAll(async () => {
    backend = await cpuBackend.load({ threads: 2 });
    f.gF32 = gen("g-f32.gguf", "F32", "GGUF");
    f.pF32 = gen("p-f32.gguf", "F32", "PWRI");
    f.gQ4 = gen("g-q4.gguf", "Q4_0", "GGUF");
    f.pQ4 = gen("p-q4.gguf", "Q4_0", "PWRI");
  });
  afterAll(() => backend?.dispose());

  it("the generator writes the GGUF's down values neuron-major, and every other tensor unchanged", () => {
    const g = openGguf(f.gF32!);
    const p = openGguf(f.pF32!);
    expect(p.format).toBe("PWRI");
    expect(parseModelConfig(p).down_transposed).toBe(true);
    expect(parseModelConfig(g).down_transposed).toBe(false);
    for (const t of g.tensors) {
      const m = /^blk\.(\d+)\.ffn_down_exps\.weight$/.exec(t.name);
      if (!m) {
        expect(Buffer.compare(readTensorBytes(p, t.name), readTensorBytes(g, t.name)), t.name).toBe(0);
        continue;
      }
      const name = `blk.${m[1]}.ffn_down_exps_t.weight`;
      expect(p.tensorMap.get(name)!.shape).toEqual([E, F, X]);
      expect(p.tensorMap.has(t.name)).toBe(false);
      const a = readTensorF32(g, t.name); // [F, E, X]: row r of expert x = output channel r
      const b = readTensorF32(p, name); // [E, F, X]: row i of expert x = neuron i
      for (let x = 0; x < X; x++)
        for (let r = 0; r < E; r++)
          for (let i = 0; i < F; i++) {
            const o = x * E * F;
            if (b[o + i * E + r] !== a[o + r * F + i])
              throw new Error(`${name}: expert ${x}, channel ${r}, neuron ${i}`);
          }
    }
    expect(p.tensors.length).toBe(g.tensors.length);
  });

  it("inspect counts the chosen experts' share of ffn_down_exps_t, as of ffn_down_exps", async () => {
    const { inspectFile } = await import("../src/commands/inspect.js");
    const want = inspectFile(f.gF32!).experts!.activeParametersPerToken;
    expect(inspectFile(f.pF32!).experts!.activeParametersPerToken).toBe(want);
  });

  it("F32: predictor logits equal the GGUF's bit for bit, dense within float rounding", async () => {
    for (const [mode, exact] of [
      ["predictor", true],
      ["oracle", true],
      ["off", false],
    ] as [SparseMode, boolean][]) {
      const a = await Model.load(f.gF32!, { backend, sparse: mode });
      const b = await Model.load(f.pF32!, { backend, sparse: mode });
      try {
        const ra = run(a, 6);
        const rb = run(b, 6);
        ra.logits.forEach((la, i) => {
          const lb = rb.logits[i]!;
          if (exact)
            expect(Buffer.compare(Buffer.from(la.buffer), Buffer.from(lb.buffer)), `${mode} step ${i}`).toBe(0);
          else
            for (let k = 0; k < la.length; k++)
              expect(Math.abs(la[k]! - lb[k]!), `${mode} step ${i}`).toBeLessThan(1e-4 * (1 + Math.abs(la[k]!)));
        });
      } finally {
        a.dispose();
        b.dispose();
      }
    }
  });

  it("Q4_0: sparse experts give the dense logits bit for bit, and the down projection reads only the firing neurons' rows", async () => {
    const dense = await Model.load(f.pQ4!, { backend, sparse: "off" });
    const want = run(dense, 8).logits;
    dense.dispose();
    const same = (got: Float32Array[], what: string) => {
      for (const [i, l] of got.entries())
        expect(Buffer.compare(Buffer.from(l.buffer), Buffer.from(want[i]!.buffer)), `${what} step ${i}`).toBe(0);
    };
    const oracle = await Model.load(f.pQ4!, { backend, sparse: "oracle" });
    const ro = run(oracle, 8);
    oracle.dispose();
    same(ro.logits, "oracle");
    const all = await Model.load(f.pQ4!, { backend, sparse: "predictor", threshold: -3e38 });
    const ra = run(all, 8);
    all.dispose();
    same(ra.logits, "predictor, every neuron");
    // oracle: per layer up (rows whose gate > 0) and down (the same rows) are the sparse ops
    const active = ro.stats.activeRows.reduce((a, b) => a + b, 0);
    const tokens = ro.stats.layerTokens.reduce((a, b) => a + b, 0);
    expect(active).toBeGreaterThan(0);
    expect(active).toBeLessThan(0.7 * tokens * TINY_MOE_SHAPE.n_expert_used * F);
    expect(ro.stats.rowsRead).toBe(2 * active);
    // the GGUF's quantized down stack runs densely: only up is counted
    const g = await Model.load(f.gQ4!, { backend, sparse: "oracle" });
    const rg = run(g, 8);
    g.dispose();
    expect(rg.stats.rowsRead).toBe(rg.stats.activeRows.reduce((a, b) => a + b, 0));
  });

  it("convert --to pwri and back: F32 bit-exact, a quantized stack re-quantized with a note", () => {
    const p = join(dir, "conv-p.gguf");
    const back = join(dir, "conv-g.gguf");
    const a = cli("convert", f.gF32!, p, "--to", "pwri");
    expect(a.status, a.stderr).toBe(0);
    const b = cli("convert", p, back, "--to", "gguf", "--keep-predictors");
    expect(b.status, b.stderr).toBe(0);
    const [g, pp, gg] = [openGguf(f.gF32!), openGguf(p), openGguf(back)];
    expect(pp.format).toBe("PWRI");
    for (let l = 0; l < NL; l++) {
      const n = `blk.${l}.ffn_down_exps`;
      expect(
        Buffer.compare(readTensorBytes(pp, `${n}_t.weight`), readTensorBytes(openGguf(f.pF32!), `${n}_t.weight`)),
      ).toBe(0);
      expect(Buffer.compare(readTensorBytes(gg, `${n}.weight`), readTensorBytes(g, `${n}.weight`))).toBe(0);
    }
    const q = cli("convert", f.gQ4!, join(dir, "conv-q4.gguf"), "--to", "pwri");
    expect(q.status, q.stderr).toBe(0);
    expect(q.stderr).toMatch(/ffn_down_exps_t\.weight: transposed through F32 and re-quantized to Q4_0/);
    // a SiLU expert model is refused (a PWRI file is read as ReLU)
    const silu = join(dir, "silu.gguf");
    generateSyntheticMoeModel(silu, { arch: "llama-moe", shape: TINY_MOE_SHAPE, dtype: "F32" });
    const s = cli("convert", silu, join(dir, "silu-p.gguf"), "--to", "pwri");
    expect(s.status).not.toBe(0);
    expect(s.stderr).toMatch(/PWRI is for ReLU models/);
  });

  it("a layer with both down layouts, or a neuron-major stack of the wrong shape, is refused by name", () => {
    const g = openGguf(f.gF32!);
    const p = openGguf(f.pF32!);
    const spec = (file: typeof g, name: string, shape?: number[]): GgufTensorSpec => {
      const t = file.tensorMap.get(name)!;
      return { name, type: t.type, shape: shape ?? [...t.shape], data: () => readTensorBytes(file, name) };
    };
    const both = join(dir, "both.gguf");
    writeGguf(both, {
      metadata: metadataEntries(p),
      tensors: [...p.tensors.map((t) => spec(p, t.name)), spec(g, "blk.0.ffn_down_exps.weight")],
    });
    expect(() => parseModelConfig(openGguf(both))).toThrow(
      /blk\.0\.ffn_down_exps_t\.weight.*stores its experts' down projections twice/,
    );
    const wrong = join(dir, "wrong.gguf");
    writeGguf(wrong, {
      metadata: metadataEntries(p),
      tensors: p.tensors.map((t) =>
        t.name === "blk.1.ffn_down_exps_t.weight" ? spec(p, t.name, [2 * E, F / 2, X]) : spec(p, t.name),
      ),
    });
    expect(() => parseModelConfig(openGguf(wrong))).toThrow(/blk\.1\.ffn_down_exps_t\.weight.*does not fit n_embd/);
  });
});
