/**
 * Sparse inference on the CPU backend against real references: the shared ReLU model (PyTorch fp32)
 * and PowerInfer's own outputs on its format fixtures.
 */
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import type { Backend } from "@powerinfer/core";
import { argmax, Model, type SparseMode } from "@powerinfer/engine";
import { dequantize, openGguf, readTensorBytes } from "@powerinfer/gguf";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

const models = process.env.POWERINFER_TEST_MODELS!;
const relu = join(models, "relu", "tinystories-relu-llama-7m.f32.gguf");
const probe = await cpuBackend.probe();

interface ReluRef {
  greedy: {
    prompt_ids: number[];
    generated_ids: number[];
    last_prompt_pos_top5_ids: number[];
    last_prompt_pos_top5_logits: number[];
  }[];
}

describe.skipIf(!probe.usable)("sparse inference on the CPU backend", () => {
  let backend: Backend;
  beforeAll(async () => {
    backend = await cpuBackend.load({ threads: 2 });
  });
  afterAll(() => backend?.dispose());

  describe("the ReLU model against PyTorch fp32", () => {
    const ref = JSON.parse(
      readFileSync(join(models, "relu", "tinystories-relu-llama-7m.reference.json"), "utf8"),
    ) as ReluRef;
    for (const [sparse, kvType, tol] of [
      ["off", "f32", 1e-3],
      ["oracle", "f32", 1e-3],
      ["off", "f16", 5e-3],
      ["oracle", "f16", 5e-3],
    ] as const) {
      it(`${sparse} mode, ${kvType} KV cache: greedy ids exact, top-5 logits within ${tol}`, async () => {
        const model = await Model.load(relu, { backend, sparse: sparse as SparseMode });
        try {
          for (const c of ref.greedy) {
            const s = model.createSession({ nCtx: 256, kvType });
            let logits = s.evaluate(c.prompt_ids);
            c.last_prompt_pos_top5_ids.forEach((id, i) => {
              expect(Math.abs(logits[id]! - c.last_prompt_pos_top5_logits[i]!)).toBeLessThanOrEqual(tol);
            });
            const ids: number[] = [];
            for (let i = 0; i < c.generated_ids.length; i++) {
              ids.push(argmax(logits));
              logits = s.evaluate([ids[i]!]);
            }
            expect(ids).toEqual(c.generated_ids);
            s.dispose();
          }
        } finally {
          model.dispose();
        }
      });
    }

    it("oracle mode reads exactly the firing rows (row counters vs the dense gate)", async () => {
      const dense = await Model.load(relu, { backend, sparse: "off" });
      const oracle = await Model.load(relu, { backend, sparse: "oracle" });
      try {
        const ids = ref.greedy[0]!.prompt_ids;
        const firing: number[] = [];
        const sd = dense.createSession({ nCtx: 64 });
        sd.evaluate(ids, {
          onCapture: (layers) =>
            layers.forEach((L, l) => {
              firing[l] = (firing[l] ?? 0) + L.gate.reduce((n, v) => n + (v > 0 ? 1 : 0), 0);
            }),
        });
        const so = oracle.createSession({ nCtx: 64 });
        // every column's logits: the last layer's FFN runs on every token too (else on the last one only)
        so.evaluate(ids, { allLogits: true });
        expect(so.stats.layerTokens).toEqual(firing.map(() => ids.length));
        const nff = oracle.config.n_ff;
        for (let l = 0; l < firing.length; l++) {
          // the up projection reads one row per firing (neuron, token); the down projection the same
          expect(so.stats.activeRows[l]).toBe(firing[l]);
          expect(firing[l]! / (ids.length * nff)).toBeLessThan(0.5);
        }
        expect(so.stats.rowsRead).toBe(2 * firing.reduce((a, b) => a + b, 0));
      } finally {
        dense.dispose();
        oracle.dispose();
      }
    });

    it("refuses sparse modes the model cannot run, naming why", async () => {
      await expect(Model.load(relu, { backend, sparse: "predictor" })).rejects.toThrow(/needs predictors/);
      await expect(Model.load(join(models, "stories260K.gguf"), { backend, sparse: "oracle" })).rejects.toThrow(
        /a dense model gains nothing from sparse inference/,
      );
      await expect(
        Model.load(join(models, "powerinfer", "tiny-f16.powerinfer.gguf"), { backend, threshold: Number.NaN }),
      ).rejects.toThrow(/threshold NaN is not a number/);
    });
  });

  describe("PowerInfer fixtures against PowerInfer's logits", () => {
    const pw = (f: string) => join(models, "powerinfer", f);
    const refF16 = JSON.parse(readFileSync(pw("tiny-f16.logits.json"), "utf8"));
    const refQ4 = JSON.parse(readFileSync(pw("tiny-q4_0.logits.json"), "utf8"));

    async function run(file: string, sparse: SparseMode, threshold?: number): Promise<Float32Array[]> {
      const model = await Model.load(pw(file), { backend, sparse, threshold });
      const s = model.createSession({ nCtx: 64 });
      const out = (refF16.tokens as number[]).map((t) => Float32Array.from(s.evaluate([t])));
      s.dispose();
      model.dispose();
      return out;
    }
    const maxDiff = (a: Float32Array, b: number[]) => a.reduce((m, v, i) => Math.max(m, Math.abs(v - b[i]!)), 0);

    it("all neurons forced on (threshold −1e30): F16 within 2e-2, Q4_0 within its quantization error", async () => {
      const f16 = await run("tiny-f16.powerinfer.gguf", "predictor", -1e30);
      for (const [p, l] of f16.entries()) expect(maxDiff(l, refF16.logits_all_neurons[p])).toBeLessThan(2e-2);
      const q4 = await run("tiny-q4_0.powerinfer.gguf", "predictor", -1e30);
      // Q4_0 weights, activations rounded to Q8_0 by PowerInfer: logits move by up to ~0.1 with the rounding
      for (const [p, l] of q4.entries()) expect(maxDiff(l, refQ4.logits_all_neurons[p])).toBeLessThan(0.15);
    });

    it("the F32 file (NaN in PowerInfer) gives the F16 file's logits within 2e-2, dense and all neurons on", async () => {
      for (const [mode, threshold] of [
        ["off", undefined],
        ["predictor", -1e30],
      ] as const) {
        const f32 = await run("tiny-f32.powerinfer.gguf", mode, threshold);
        const f16 = await run("tiny-f16.powerinfer.gguf", mode, threshold);
        f32.forEach((l, p) => {
          expect(l.every(Number.isFinite)).toBe(true);
          expect(maxDiff(l, Array.from(f16[p]!))).toBeLessThan(2e-2);
        });
      }
    });

    it("with predictors: PowerInfer's logits until a position where a predictor logit within 5e-3 of the threshold can flip", async () => {
      // Our own float64 predictor logits per position tell where a neuron can flip between engines.
      const file = openGguf(pw("tiny-f16.powerinfer.gguf"));
      const dense = await Model.load(pw("tiny-f16.powerinfer.gguf"), { backend, sparse: "off" });
      const cfg = dense.config;
      const fc = (n: string) => {
        const t = file.tensorMap.get(n)!;
        return { w: dequantize(t.type, readTensorBytes(file, t), t.nElements), ne: t.shape };
      };
      const nearThreshold: number[] = []; // positions with a near-threshold neuron
      const s = dense.createSession({ nCtx: 64 });
      for (const [p, tok] of (refF16.tokens as number[]).entries()) {
        s.evaluate([tok], {
          onCapture: (layers) => {
            for (const [l, L] of layers.entries()) {
              const f1 = fc(`blk.${l}.fc1.weight`);
              const f2 = fc(`blk.${l}.fc2.weight`);
              const r = f1.ne[1]!;
              const h = Array.from({ length: r }, (_, j) => {
                let a = 0;
                for (let k = 0; k < cfg.n_embd; k++) a += f1.w[j * cfg.n_embd + k]! * L.ffnInput[k]!;
                return Math.max(0, a);
              });
              for (let i = 0; i < cfg.n_ff; i++) {
                let z = 0;
                for (let j = 0; j < r; j++) z += f2.w[i * r + j]! * h[j]!;
                if (Math.abs(z - cfg.sparse_threshold) < 5e-3) nearThreshold.push(p);
              }
            }
          },
        });
      }
      s.dispose();
      dense.dispose();
      const sparse = await run("tiny-f16.powerinfer.gguf", "predictor");
      const diverged = sparse.findIndex((l, p) => maxDiff(l, refF16.logits_predictor[p]) >= 2e-2);
      // PowerInfer rounds the predictor input to F16, we keep F32: a neuron whose logit lies within 5e-3 of
      // the threshold may run in one engine and not the other. Every position before the first divergence
      // matches; the divergence must sit at a position with such a neuron.
      expect(diverged === -1 || diverged > 0).toBe(true);
      if (diverged >= 0) {
        expect(nearThreshold, `divergence at position ${diverged} without a near-threshold neuron`).toContain(diverged);
        console.warn(
          `tiny-f16 with predictors: matches PowerInfer at positions 0..${diverged - 1}; position ${diverged} has a near-threshold neuron`,
        );
      }
    });
  });
});
