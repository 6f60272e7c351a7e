/**
 * Predictor-sparse routed experts: per-expert predictors (`blk.N.fc1_exps` {n_embd, r, n_expert},
 * `blk.N.fc2_exps` {r, n_ff_exp, n_expert}) written by the generator for a SmallThinker-layout slice
 * (4 layers, 16 experts of 256 neurons, 4 per token, rank 64, β² = 0.1, threshold calibrated on the
 * design for recall 0.95), run by the CPU backend:
 * - the file without predictors holds the same bytes in every other tensor (llama.cpp's file and ours);
 * - the predictors see the gates: on 192 seeded tokens through the dense model, a float64 evaluation of
 *   the file's predictors on the captured FFN inputs recalls ≥ 0.9 of the firing neurons of the chosen
 *   experts while predicting at most 0.6 of them (0.4 fire);
 * - the kernels compute exactly the predicted neurons: in layer 0 (same input as the dense run) the
 *   predictor-mode row counters equal the float64 predictions up to rows whose logit lies within 1e-4 of
 *   the threshold (F32 rounding), later layers within 1 %;
 * - with every neuron predicted (threshold −3e38) predictor mode gives the dense logits bit for bit (the
 *   sparse gate/up/down read all rows in the dense order), F32 and Q8_0;
 * - at the calibrated threshold greedy ids equal the dense run's for 12 steps (F32, Q8_0);
 * - `train-predictor` on the file without predictors (1,500 positions of TinyStories text, rank 32) trains
 *   one predictor per expert from its own gate: held-out recall ≥ 0.9 per layer, experts with fewer than 32
 *   routed pairs get a zero fc2 (every neuron computed), and the GGUF it writes runs in predictor mode (its
 *   default) with the dense greedy ids;
 * - a model without predictors is refused in predictor mode with a message naming the tensors.
 */
import { spawn, spawnSync } from "node:child_process";
import { existsSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import type { Backend } from "@powerinfer/core";
import { openGguf, readTensorBytes, readTensorF32 } from "@powerinfer/gguf";
import { argmax, type LayerCapture, Model } from "@powerinfer/engine";
import { generateSyntheticMoeModel, type SyntheticMoeShape } from "@powerinfer/synthetic";
import { DESIGN_MOE_SHAPE } from "./moe-shape.js";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

const probe = await cpuBackend.probe();
const models = process.env.POWERINFER_TEST_MODELS!;
const bin = join(dirname(fileURLToPath(import.meta.url)), "..", "dist", "bin.js");
const dir = mkdtempSync(join(tmpdir(), "moe-pred-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

const SHAPE: SyntheticMoeShape = DESIGN_MOE_SHAPE;
const T = 192;
/** Seeded tokens (an LCG), not the special ones. */
const TOKENS = (() => {
  let x = 2024;
  return Array.from({ length: T }, () => {
    x = (Math.imul(x, 1103515245) + 12345) >>> 0;
    return 3 + (x % 500);
  });
})();

function gen(name: string, dtype: "F32" | "Q8_0", predictors: boolean): string {
  const path = join(dir, name);
  generateSyntheticMoeModel(path, {
    arch: "smallthinker",
    shape: SHAPE,
    dtype,
    vocabSize: 512,
    untiedOutput: false,
    seed: 11,
    design: {},
    ...(predictors ? { predictors: {} } : {}),
  });
  return path;
}

const maxDiff = (a: ArrayLike<number>, b: ArrayLike<number>) => {
  let w = 0;
  for (let i = 0; i < a.length; i++) w = Math.max(w, Math.abs(a[i]! - b[i]!));
  return w;
};

/** The shared ReLU model's evaluation text, its first `chars` characters, as a file in the test folder. */
function evalTextFile(name: string, chars: number): string {
  const text = join(dir, name);
  writeFileSync(text, readFileSync(join(models, "relu", "tinystories-relu-llama-7m.eval.txt"), "utf8").slice(0, chars));
  return text;
}

/** train-predictor's arguments for a model with experts: rank 32, 2 threads, `tokens` positions, then `extra`. */
function expertTraining(model: string, text: string, out: string, tokens: number, ...extra: string[]): string[] {
  return ["-m", model, "-f", text, "-o", out, "--tokens", String(tokens), "--rank", "32", "-t", "2", ...extra];
}

/** `powerinfer train-predictor ...args` in a process. */
function trainPredictor(...args: string[]) {
  return spawnSync(process.execPath, [bin, "train-predictor", ...args], { encoding: "utf8", timeout: 600_000 });
}

function greedy(model: Model, prompt: number[], n: number) {
  const s = model.createSession({ nCtx: 128, kvType: "f16" });
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

describe.skipIf(!probe.usable)(`predictor-sparse experts (${probe.reason})`, () => {
  let backend: Backend;
  const files: Record<string, string> = {};
  beforeAll(async () => {
    backend = await cpuBackend.load({ threads: 2 });
    files.F32 = gen("st-f32-p.gguf", "F32", true);
    files.Q8_0 = gen("st-q8-p.gguf", "Q8_0", true);
    files.plain = gen("st-f32.gguf", "F32", false);
  });
  afterAll(() => backend?.dispose());

  it("the predictors are extra tensors: every other tensor holds the same bytes as in the file without them", () => {
    const a = openGguf(files.F32!);
    const b = openGguf(files.plain!);
    const extra = a.tensors.filter((t) => !b.tensorMap.has(t.name)).map((t) => t.name);
    expect(extra.sort()).toEqual(
      Array.from({ length: 4 }, (_, l) => [`blk.${l}.fc1_exps.weight`, `blk.${l}.fc2_exps.weight`])
        .flat()
        .sort(),
    );
    for (const t of b.tensors) {
      expect(Buffer.compare(readTensorBytes(a, t.name), readTensorBytes(b, t.name)), t.name).toBe(0);
    }
    expect(a.tensorMap.get("blk.0.fc1_exps.weight")!.shape).toEqual([256, 64, 16]);
    expect(a.tensorMap.get("blk.0.fc2_exps.weight")!.shape).toEqual([64, 256, 16]);
  });

  it("the predictors recall the chosen experts' firing neurons, and the kernels compute exactly the predicted ones", async () => {
    const { n_embd: E, n_ff_exp: F, n_expert: X, n_expert_used: U } = SHAPE;
    const dense = await Model.load(files.F32!, { backend, sparse: "off" });
    const pred = await Model.load(files.F32!, { backend, sparse: "predictor" });
    try {
      const thr = pred.threshold;
      expect(thr).toBeLessThan(0); // recall 0.95 needs a threshold below the firing point
      let caps: LayerCapture[] = [];
      const sd = dense.createSession({ nCtx: 512, kvType: "f32" });
      sd.evaluate(TOKENS, { onCapture: (layers) => (caps = layers) });
      sd.dispose();
      const sp = pred.createSession({ nCtx: 512, kvType: "f32" });
      sp.evaluate(TOKENS, { allLogits: true });
      const rows = sp.stats.activeRows;
      sp.dispose();
      const file = openGguf(files.F32!);
      for (const [l, c] of caps.entries()) {
        const r = 64;
        const fc1 = readTensorF32(file, `blk.${l}.fc1_exps.weight`); // [E, r, X]
        const fc2 = readTensorF32(file, `blk.${l}.fc2_exps.weight`); // [r, F, X]
        let tp = 0;
        let pos = 0;
        let predicted = 0;
        let nearThreshold = 0;
        const hid = new Float64Array(r);
        for (let t = 0; t < T; t++) {
          const p = c.routerProbs!.subarray(t * X, (t + 1) * X);
          const order = Array.from({ length: X }, (_, e) => e).sort((a, b) => p[b]! - p[a]! || a - b);
          const x = c.ffnInput.subarray(t * E, (t + 1) * E);
          for (let u = 0; u < U; u++) {
            const e = order[u]!;
            for (let k = 0; k < r; k++) {
              let s = 0;
              const w = (e * r + k) * E;
              for (let j = 0; j < E; j++) s += fc1[w + j]! * x[j]!;
              hid[k] = Math.max(0, s);
            }
            const gate = c.expertGate!.subarray((t * U + u) * F, (t * U + u + 1) * F);
            for (let i = 0; i < F; i++) {
              let z = 0;
              const w = (e * F + i) * r;
              for (let k = 0; k < r; k++) z += fc2[w + k]! * hid[k]!;
              const on = z >= thr;
              if (Math.abs(z - thr) < 1e-4) nearThreshold++;
              predicted += on ? 1 : 0;
              if (gate[i]! > 0) {
                pos++;
                if (on) tp++;
              }
            }
          }
        }
        const n = T * U * F;
        const recall = tp / pos;
        console.log(
          `layer ${l}: fire ${(pos / n).toFixed(3)}, predicted ${(predicted / n).toFixed(3)}, recall ${recall.toFixed(3)}; kernels' rows ${rows[l]} vs float64 ${predicted} (${nearThreshold} within 1e-4 of the threshold)`,
        );
        expect(recall, `layer ${l}`).toBeGreaterThanOrEqual(0.9);
        expect(predicted / n, `layer ${l}`).toBeLessThan(0.6);
        if (l === 0) expect(Math.abs(rows[l]! - predicted)).toBeLessThanOrEqual(nearThreshold);
        else expect(Math.abs(rows[l]! - predicted) / predicted, `layer ${l}`).toBeLessThan(0.01);
      }
    } finally {
      dense.dispose();
      pred.dispose();
    }
  }, 120_000);

  for (const dtype of ["F32", "Q8_0"] as const) {
    it(`${dtype}: every neuron predicted gives the dense logits (Q8_0 bit for bit, F32 within float rounding); the calibrated threshold gives the dense greedy ids`, async () => {
      const prompt = TOKENS.slice(0, 16);
      const dense = await Model.load(files[dtype]!, { backend, sparse: "off" });
      const all = await Model.load(files[dtype]!, { backend, sparse: "predictor", threshold: -3e38 });
      const pred = await Model.load(files[dtype]!, { backend, sparse: "predictor" });
      try {
        const d = greedy(dense, prompt, 12);
        const a = greedy(all, prompt, 12);
        const p = greedy(pred, prompt, 12);
        expect(a.ids).toEqual(d.ids);
        // Q8_0: gate and up rows by the dense product's dot, the down product dense over the activations;
        // F32: the down projection is read neuron-major (axpy), so only float rounding (as oracle mode)
        for (let i = 0; i < 12; i++) {
          if (dtype === "Q8_0") expect(Array.from(a.logits[i]!), `step ${i}`).toEqual(Array.from(d.logits[i]!));
          else expect(maxDiff(a.logits[i]!, d.logits[i]!), `step ${i}`).toBeLessThan(5e-4);
        }
        expect(p.ids).toEqual(d.ids);
        const worst = Math.max(...p.logits.map((l, i) => maxDiff(l, d.logits[i]!)));
        // the 5 % of firing neurons the predictors miss are the weakest: the logits move, but far less than a
        // wrong neuron set would (that is the size of the logits themselves)
        expect(worst).toBeGreaterThan(0);
        expect(worst).toBeLessThan(0.05 * Math.max(...d.logits[0]!.map(Math.abs)));
        console.log(`${dtype}: predictor-sparse logits differ from dense by at most ${worst.toExponential(2)}`);
      } finally {
        dense.dispose();
        all.dispose();
        pred.dispose();
      }
    }, 120_000);
  }

  it("train-predictor trains per-expert predictors: held-out recall ≥ 0.9, experts with too few pairs compute every neuron, and the written GGUF runs in predictor mode with the dense greedy ids", async () => {
    const text = evalTextFile("t.txt", 40_000);
    const out = join(dir, "trained.gguf");
    const r = trainPredictor(...expertTraining(files.plain!, text, out, 1500, "--json"));
    expect(r.status, r.stderr).toBe(0);
    const rep = JSON.parse(r.stdout);
    expect(rep.format).toBe("GGUF");
    expect(rep.layers).toHaveLength(4);
    for (const L of rep.layers) {
      console.log(
        `trained layer ${L.layer}: held-out recall ${L.recall.toFixed(3)}, predicted ${L.predictedFraction.toFixed(3)} vs true ${L.trueFraction.toFixed(3)}, ${L.zeroExperts} experts dense`,
      );
      expect(L.recall).toBeGreaterThanOrEqual(0.9);
      expect(L.predictedFraction).toBeLessThan(0.7);
    }
    // an expert with fewer than 32 training pairs gets a zero fc2 (logit 0 ≥ threshold −1: every neuron)
    const f = openGguf(out);
    expect(f.tensorMap.get("blk.0.fc1_exps.weight")!.shape).toEqual([256, 32, 16]);
    const few = (rep.training as { layer: number; expert: number; samples: number; val: unknown }[]).filter(
      (t) => t.samples < 32,
    );
    expect(few.length).toBeGreaterThan(0); // the 16 experts of a Zipf-like router: the rarest get few pairs
    for (const t of rep.training) expect(t.val === null).toBe(t.samples < 32);
    for (const t of few) {
      const fc2 = readTensorF32(f, `blk.${t.layer}.fc2_exps.weight`).subarray(
        t.expert * 256 * 32,
        (t.expert + 1) * 256 * 32,
      );
      expect(fc2.every((v) => v === 0)).toBe(true);
    }
    expect(rep.threshold).toBe(-1);
    // retraining a file that has predictors (at its end, as the generator writes them) replaces them
    const again = join(dir, "retrained.gguf");
    const r2 = trainPredictor(
      "-m",
      files.F32!,
      "-f",
      text,
      "-o",
      again,
      "--tokens",
      "600",
      "--rank",
      "32",
      "--holdout",
      "0",
    );
    expect(r2.status, r2.stderr).toBe(0);
    const g = openGguf(again);
    for (let l = 0; l < 4; l++)
      expect(g.tensorMap.get(`blk.${l}.fc2_exps.weight`)?.shape, `layer ${l}`).toEqual([32, 256, 16]);
    const prompt = TOKENS.slice(0, 16);
    const dense = await Model.load(out, { backend, sparse: "off" });
    const pred = await Model.load(out, { backend });
    try {
      expect(pred.sparse).toBe("predictor");
      expect(greedy(pred, prompt, 12).ids).toEqual(greedy(dense, prompt, 12).ids);
    } finally {
      dense.dispose();
      pred.dispose();
    }
  }, 600_000);

  it("train-predictor on experts resumes after Ctrl-C from its checkpoint and writes the file an uninterrupted run writes", async () => {
    const text = evalTextFile("t-resume.txt", 40_000);
    const run = (out: string) => expertTraining(files.plain!, text, out, 600, "--holdout", "0", "--verbose");
    const whole = join(dir, "whole.gguf");
    expect(trainPredictor(...run(whole)).status).toBe(0);
    const resumed = join(dir, "resumed.gguf");
    // interrupted in layer 1: layer 0's experts are in the checkpoint
    const child = spawn(process.execPath, [bin, "train-predictor", ...run(resumed)], {
      stdio: ["ignore", "pipe", "pipe"],
    });
    let stderr = "";
    let sent = false;
    child.stderr.on("data", (d: Buffer) => {
      stderr += d.toString();
      if (!sent && /layer 1 expert 3:/.test(stderr)) {
        sent = true;
        child.kill("SIGINT");
      }
    });
    const code = await new Promise<number | null>((r) => child.on("exit", (c) => r(c)));
    expect(code, stderr).toBe(130);
    const saved = /interrupted: (\d+) experts saved to (\S+); run the same command again to resume/.exec(stderr);
    expect(saved, stderr).not.toBeNull();
    expect(Number(saved![1])).toBeGreaterThanOrEqual(16);
    expect(existsSync(`${resumed}.ckpt`)).toBe(true);
    expect(existsSync(resumed)).toBe(false);
    // another run's options do not resume it
    const other = trainPredictor(...run(resumed), "--rank", "16");
    expect(other.status).toBe(1);
    expect(other.stderr).toMatch(/checkpoint .* is from another run .*pass --restart to discard it/);
    const again = trainPredictor(...run(resumed));
    expect(again.status, again.stderr).toBe(0);
    expect(again.stderr).toContain(`resuming from ${resumed}.ckpt: ${saved![1]} of 64 experts done`);
    expect(existsSync(`${resumed}.ckpt`)).toBe(false);
    expect(readFileSync(resumed).equals(readFileSync(whole))).toBe(true);
  }, 300_000);

  it("compare-expert-predictors: per-expert and shared predictors at equal storage, each near its calibrated recall on held-out pairs", () => {
    const text = evalTextFile("t-compare.txt", 60_000);
    const script = join(dirname(fileURLToPath(import.meta.url)), "..", "scripts", "compare-expert-predictors.mjs");
    const r = spawnSync(
      process.execPath,
      [script, "-m", files.plain!, "-f", text, "--tokens", "800", "--rank", "16", "-t", "2", "--json"],
      { encoding: "utf8", timeout: 600_000 },
    );
    expect(r.status, r.stderr).toBe(0);
    const out = JSON.parse(r.stdout) as {
      rows: {
        variant: string;
        rank: number;
        storedWeights: number;
        recall: number;
        predicted: number;
        trueActive: number;
      }[];
    };
    expect(out.rows.map((x) => x.variant)).toEqual([
      "per-expert (gate start)",
      "per-expert (random start)",
      "shared (expert as input)",
    ]);
    const [gate, , shared] = out.rows;
    expect(Math.abs(shared!.storedWeights / gate!.storedWeights - 1)).toBeLessThan(0.01);
    for (const x of out.rows) {
      console.log(
        `${x.variant}: rank ${x.rank}, held-out recall ${x.recall.toFixed(3)}, predicted ${x.predicted.toFixed(3)} (true ${x.trueActive.toFixed(3)})`,
      );
      expect(x.recall, x.variant).toBeGreaterThanOrEqual(0.85);
      expect(x.predicted).toBeGreaterThanOrEqual(x.trueActive * x.recall * 0.99);
    }
  }, 600_000);

  it("inspect: a file with per-expert predictors can run sparse; predictors are not counted as parameters read", async () => {
    const { inspectFile } = await import("../src/commands/inspect.js");
    const withP = inspectFile(files.F32!);
    const without = inspectFile(files.plain!);
    expect(withP.sparse.verdict).toBe("sparse");
    expect(withP.sparse.reason).toMatch(/per-expert predictors in all 4 layers \(rank 64\)/);
    expect(without.sparse.verdict).toBe("needs-predictor");
    expect(without.sparse.reason).toMatch(/train-predictor/);
    expect(withP.experts!.activeParametersPerToken).toBe(without.experts!.activeParametersPerToken);
  });

  it("train-predictor refuses a text file that is binary (a model given as the text)", () => {
    const r = spawnSync(
      process.execPath,
      [bin, "train-predictor", "-m", files.plain!, "-f", files.plain!, "-o", join(dir, "bin.gguf")],
      {
        encoding: "utf8",
        timeout: 60_000,
      },
    );
    expect(r.status).toBe(1);
    expect(r.stderr.trim()).toBe(`powerinfer: ${files.plain} is not a text file (it contains NUL bytes)`);
  });

  it("a model without per-expert predictors is refused in predictor mode", async () => {
    await expect(Model.load(files.plain!, { backend, sparse: "predictor" })).rejects.toThrow(/fc1_exps\/fc2_exps/);
  });
});
