/**
 * Hybrid execution without a GPU: two CPU backend instances, one standing in for the device with a
 * memory budget. The split run must give the single-backend run's greedy ids and logits (within
 * summation-order error), keep the device within the plan's bytes, and run both sides at once.
 */
import { join } from "node:path";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import { type Backend, BackendError } from "@powerinfer/core";
import { planPlacement } from "@powerinfer/core/placement";
import { argmax, HybridSession, hotNeuronBytes, Model, type SparseMode } from "@powerinfer/engine";
import { afterAll, beforeAll, describe, expect, it } from "vitest";

const models = process.env.POWERINFER_TEST_MODELS!;
const probe = await cpuBackend.probe();

/** A plan from a synthetic frequency ranking (neuron i hotter than i+1 by its id's hash), half the neurons hot. */
async function halfPlan(model: Model, budgetFraction = 0.5) {
  const cfg = model.config;
  const counts = Array.from({ length: cfg.n_layer }, (_, l) =>
    Int32Array.from({ length: cfg.n_ff }, (_, i) => ((i * 2654435761 + l * 97) >>> 0) % 1000),
  );
  const bytesPerNeuron = counts.map((_, l) => hotNeuronBytes(model, l));
  const budgetBytes = Math.floor((bytesPerNeuron.reduce((a, b) => a + b, 0) * cfg.n_ff * budgetFraction) / cfg.n_layer);
  return {
    plan: await planPlacement({ counts, tokenCount: 1000, bytesPerNeuron, budgetBytes, bucketSize: 64 }),
    budgetBytes,
  };
}

/** Norm-wise relative error ‖a − b‖₂ / ‖b‖₂. */
function relErr(a: Float32Array, b: Float32Array): number {
  let num = 0;
  let den = 0;
  for (let i = 0; i < a.length; i++) {
    num += (a[i]! - b[i]!) ** 2;
    den += b[i]! ** 2;
  }
  return Math.sqrt(num / den);
}

describe.skipIf(!probe.usable)("hybrid execution with two CPU backends", () => {
  let main: Backend;
  beforeAll(async () => {
    main = await cpuBackend.load({ threads: 1 });
  });
  afterAll(() => main?.dispose());

  // F32 weights: only the summation order differs (y_hot + y_cold vs one sum), so 1e-5 relative.
  // F16 / Q4_0 weights: the kernels round activations to F16 / Q8_0 as llama.cpp does, which turns a
  // summation-order difference of 1e-7 into a whole rounding step on a few elements (and can flip a
  // predictor decision near the threshold): ids must still agree, logits within 1e-3.
  const cases: [string, string, SparseMode, number][] = [
    ["ReLU model, dense", join(models, "relu", "tinystories-relu-llama-7m.f32.gguf"), "off", 1e-5],
    ["ReLU model, oracle", join(models, "relu", "tinystories-relu-llama-7m.f32.gguf"), "oracle", 1e-5],
    ["PowerInfer F32 fixture, predictor", join(models, "powerinfer", "tiny-f32.powerinfer.gguf"), "predictor", 1e-5],
    ["PowerInfer F16 fixture, predictor", join(models, "powerinfer", "tiny-f16.powerinfer.gguf"), "predictor", 1e-3],
    ["PowerInfer Q4_0 fixture, predictor", join(models, "powerinfer", "tiny-q4_0.powerinfer.gguf"), "predictor", 1e-3],
  ];
  for (const [what, file, sparse, tol] of cases) {
    it(`${what}: the single-backend greedy ids, logits within ${tol} relative`, async () => {
      const model = await Model.load(file, { backend: main, sparse });
      const { plan, budgetBytes } = await halfPlan(model);
      const device = await cpuBackend.load({ threads: 1, memoryBudget: budgetBytes });
      // F32 KV cache: an F16 cache would round a 1e-7 difference of K/V into a whole F16 step
      const single = model.createSession({ nCtx: 64, kvType: "f32" });
      const hybrid = new HybridSession(model, { device, plan, nCtx: 64, kvType: "f32" });
      try {
        // the device holds what the plan says, within 2 %, never above the budget
        expect(hybrid.deviceBytes()).toBeLessThanOrEqual(budgetBytes);
        expect(Math.abs(hybrid.deviceBytes() - plan.totalBytes) / plan.totalBytes).toBeLessThan(0.02);
        expect(plan.layers.every((L) => L.hot.length > 0 && L.hot.length < model.config.n_ff)).toBe(true);
        const prompt = [1, 259, 260, 261, 262];
        let a = single.evaluate(prompt);
        let b = await hybrid.evaluate(prompt);
        for (let step = 0; step < 12; step++) {
          expect(relErr(b, a), `step ${step}`).toBeLessThan(tol);
          const id = argmax(a);
          expect(argmax(b)).toBe(id);
          a = single.evaluate([id]);
          b = await hybrid.evaluate([id]);
        }
      } finally {
        hybrid.dispose();
        single.dispose();
        model.dispose();
        device.dispose();
      }
    });
  }

  it("device and CPU sides of each layer overlap in time", async () => {
    const model = await Model.load(join(models, "relu", "tinystories-relu-llama-7m.f32.gguf"), {
      backend: main,
      sparse: "off",
    });
    const { plan, budgetBytes } = await halfPlan(model);
    const device = await cpuBackend.load({ threads: 1, memoryBudget: budgetBytes });
    const hybrid = new HybridSession(model, { device, plan, nCtx: 256 });
    try {
      await hybrid.evaluate(Array.from({ length: 128 }, (_, i) => 3 + i));
      let overlapping = 0;
      for (let l = 0; l < model.config.n_layer; l++) {
        const d = hybrid.timeline.find((t) => t.layer === l && t.side === "device")!;
        const c = hybrid.timeline.find((t) => t.layer === l && t.side === "cpu")!;
        if (d.start < c.end && c.start < d.end) overlapping++;
      }
      // on a loaded 2-core machine one side may now and then finish before the other starts
      expect(overlapping).toBeGreaterThanOrEqual(1);
    } finally {
      hybrid.dispose();
      model.dispose();
      device.dispose();
    }
  });

  it("a plan larger than the device's memory fails with a typed out-of-memory error, leaving nothing allocated", async () => {
    const model = await Model.load(join(models, "powerinfer", "tiny-f16.powerinfer.gguf"), { backend: main });
    const { plan } = await halfPlan(model, 0.9);
    const device = await cpuBackend.load({ threads: 1, memoryBudget: 10_000 });
    try {
      let err: unknown;
      try {
        new HybridSession(model, { device, plan, nCtx: 16 });
      } catch (e) {
        err = e;
      }
      expect(err).toBeInstanceOf(BackendError);
      expect((err as BackendError).code).toBe("OUT_OF_MEMORY");
      expect(device.allocatedBytes()).toBe(0);
    } finally {
      model.dispose();
      device.dispose();
    }
  });
});
