/**
 * The GPU backend tests, written once and run on whichever GPU backend is usable: the CUDA backend
 * (this package), the ROCm backend (`@powerinfer/backend-rocm` imports this file) and the SIMT
 * emulator (warp 32 and 64), which runs the same kernel source on the CPU so that these tests run in
 * CI without a GPU. A backend that is not usable gets one skipped test whose title gives the reason.
 *
 * Covers: core's conformance kit (dense, sparse and routed-expert ops); which op × dtype pairs are claimed (placement keeps the others on
 * the CPU); out-of-memory as BackendError 'OUT_OF_MEMORY' (budget and arena); KV-cache attention and
 * the sparse ops over compact hot-row buckets; hybrid execution (hot rows on this backend, cold on the
 * CPU backend) against the CPU-only run: same greedy ids, logits within 1e-4 relative; whole models with
 * routed experts (SmallThinker: router on the layer input, ReGLU experts, sigmoid gating, dense and
 * oracle-sparse experts; Qwen3-MoE: per-head q/k norms through reshape, SiLU experts) against the CPU.
 */
import { mkdtempSync, rmSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import {
  type Backend,
  type BackendDescriptor,
  BackendError,
  EXPERT_OPS,
  type BackendLoadOptions,
  formatConformanceReport,
  Graph,
  type OpName,
  runConformance,
} from "@powerinfer/core";
import { argmax, Model } from "@powerinfer/engine";
import { generateSyntheticMoeModel } from "@powerinfer/synthetic";
import { describe, expect, it } from "vitest";

export interface GpuSuiteOptions {
  /** Extra load options (the emulator's warp size). */
  load?: BackendLoadOptions & Record<string, unknown>;
  /** Only these conformance ops (the emulator's second warp size runs the ops with reductions). Default: all. */
  ops?: readonly OpName[];
  /** Run the hybrid-execution test. Default true. */
  hybrid?: boolean;
}

const models = process.env["POWERINFER_TEST_MODELS"] ?? "";

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

/** Registers the suite for `descriptor` (await it at the top level of a test file: it probes first). */
export async function describeGpuBackend(
  label: string,
  descriptor: BackendDescriptor,
  opts: GpuSuiteOptions = {},
): Promise<void> {
  const probe = await descriptor.probe();
  describe(label, () => {
    if (!probe.usable) {
      it.skip(`GPU tests skipped: ${descriptor.name} ${probe.reason}`, () => {});
      return;
    }
    const load = () => descriptor.load(opts.load ?? {});

    it("passes core's conformance kit", async () => {
      const b = await load();
      try {
        const report = await runConformance(b, opts.ops ? { ops: opts.ops } : {});
        expect(report.ok, formatConformanceReport(report)).toBe(true);
        expect(report.claimed.length).toBe(opts.ops ? report.claimed.length : 58); // 7 weight ops × 5 dtypes, attention ×2 ×2, cpy ×3, 16 f32 ops
      } finally {
        b.dispose();
      }
    });

    it("claims the dense, sparse and routed-expert ops for F32, F16, BF16, Q8_0, Q4_0 and no other weight dtype", async () => {
      const b = await load();
      try {
        for (const op of [
          "get_rows",
          "mul_mat",
          "mul_mat_sparse",
          "axpy_sparse",
          "mul_mat_id",
          "mul_mat_id_sparse",
          "axpy_id_sparse",
        ] as const) {
          for (const d of ["f32", "f16", "bf16", "q8_0", "q4_0"] as const)
            expect(b.supportsOp(op, [d]), `${op} ${d}`).toBe(true);
          for (const d of ["q4_1", "q5_0", "q5_1", "q4_K", "q5_K", "q6_K"] as const) {
            expect(b.supportsOp(op, [d]), `${op} ${d}`).toBe(false);
          }
        }
        expect(b.supportsOp("attention", ["f16"])).toBe(true);
        expect(b.supportsOp("attention", ["bf16"])).toBe(false);
        expect(b.supportsOp("attention_swa", ["f16"])).toBe(true);
        for (const op of EXPERT_OPS) expect(b.supportsOp(op, ["f32"]), op).toBe(true);
        for (const op of [
          "rms_norm",
          "rope",
          "softmax",
          "add",
          "mul",
          "silu",
          "relu",
          "gelu",
          "sigmoid",
          "reshape",
        ] as const) {
          expect(b.supportsOp(op, ["f32"])).toBe(true);
        }
      } finally {
        b.dispose();
      }
    });

    it("refuses allocations beyond the memory budget with OUT_OF_MEMORY, and q4_K compute with UNSUPPORTED_OP", async () => {
      const b = await descriptor.load({ ...opts.load, memoryBudget: 1 << 20 });
      try {
        const t = b.createTensor("f32", [1024, 200]); // 800 KiB
        let err: unknown;
        try {
          b.createTensor("f32", [1024, 100]);
        } catch (e) {
          err = e;
        }
        expect(err).toBeInstanceOf(BackendError);
        expect((err as BackendError).code).toBe("OUT_OF_MEMORY");
        expect(b.allocatedBytes()).toBe(1024 * 200 * 4);
        b.freeTensor(t);
        const q = b.createTensor("q4_K", [256, 2]);
        const g = new Graph();
        g.output(g.mulMat(g.handle(q), g.input("f32", [256, 1], new Float32Array(256))));
        expect(() => b.compute(g)).toThrow(expect.objectContaining({ code: "UNSUPPORTED_OP" }));
      } finally {
        b.dispose();
      }
    });

    it("keeps a KV cache on the device across calls (cpy then attention, decode steps)", async () => {
      const b = await load();
      try {
        const d = 32;
        const ctx = 8;
        const k = b.createTensor("f16", [d, ctx]);
        const v = b.createTensor("f16", [d, ctx]);
        const keys: Float32Array[] = [];
        const vals: Float32Array[] = [];
        for (let pos = 0; pos < 4; pos++) {
          const kv = [0, 1].map(() => Float32Array.from({ length: d }, (_, i) => Math.sin(pos * 7 + i) / 2));
          keys.push(kv[0]!);
          vals.push(kv[1]!.map((x) => x + pos));
          const q = Float32Array.from({ length: d }, (_, i) => Math.cos(i + pos));
          const g = new Graph();
          const kc = g.cpy(g.input("f32", [d, 1], keys[pos]!), g.handle(k), pos);
          const vc = g.cpy(g.input("f32", [d, 1], vals[pos]!), g.handle(v), pos);
          const y = g.output(
            g.attention(g.input("f32", [d, 1], q), kc, vc, {
              headDim: d,
              nHead: 1,
              nHeadKv: 1,
              nPast: pos,
              scale: 0.25,
            }),
          );
          b.compute(g);
          const s = keys.map((kk) => 0.25 * kk.reduce((a, x, i) => a + x * q[i]!, 0));
          const m = Math.max(...s);
          const w = s.map((x) => Math.exp(x - m));
          const z = w.reduce((a, x) => a + x, 0);
          for (let i = 0; i < d; i++) {
            const want = vals.reduce((a, vv, p) => a + (w[p]! / z) * vv[i]!, 0);
            expect(Math.abs(y[i]! - want)).toBeLessThan(5e-3 * (1 + Math.abs(want)));
          }
        }
      } finally {
        b.dispose();
      }
    });

    it("computes only the listed, active rows of a compact hot-row bucket (rowsRead)", async () => {
      const b = await load();
      try {
        const k = 64;
        const nOut = 40;
        const hot = Int32Array.from([1, 5, 6, 20, 39]);
        const w = Float32Array.from({ length: k * hot.length }, (_, i) => ((i * 37) % 11) / 10 - 0.5);
        const W = b.createTensor("f32", [k, hot.length], w);
        const rows = b.createTensor("i32", [hot.length], hot);
        const x = Float32Array.from({ length: k * 2 }, (_, i) => ((i * 13) % 7) / 7 - 0.5);
        const logits = new Float32Array(nOut * 2).fill(-1);
        for (const i of [5, 20]) logits[i] = 1; // token 0: neurons 5, 20 active
        for (const i of [1, 2, 39]) logits[nOut + i] = 1; // token 1: 1, 39 (2 is not hot)
        const g = new Graph();
        const y = g.output(
          g.mulMatSparse(g.handle(W), g.input("f32", [k, 2], x), {
            logits: g.input("f32", [nOut, 2], logits),
            rows: g.handle(rows),
            threshold: 0,
            nOut,
          }),
        );
        const r = await b.computeAsync(g);
        expect(r.rowsRead[0]).toBe(4);
        for (let t = 0; t < 2; t++) {
          for (let i = 0; i < nOut; i++) {
            const j = hot.indexOf(i);
            const active = j >= 0 && logits[t * nOut + i]! >= 0;
            let want = 0;
            if (active) for (let e = 0; e < k; e++) want += w[j * k + e]! * x[t * k + e]!;
            if (!active) expect(y[t * nOut + i]).toBe(0);
            else expect(Math.abs(y[t * nOut + i]! - want)).toBeLessThan(1e-5);
          }
        }
      } finally {
        b.dispose();
      }
    });

    const fixture = join(models, "powerinfer", "tiny-f32.powerinfer.gguf");
    // F32 weights: only summation order differs. Q4_0: the CPU kernels round activations to Q8_0 (as
    // llama.cpp does), the GPU keeps them F32; run dense, so that no predictor decision near the
    // threshold flips between the two.
    for (const [file, sparse, tol] of [
      ["tiny-f32.powerinfer.gguf", "predictor", 1e-4],
      ["tiny-q4_0.powerinfer.gguf", "off", 0.05],
    ] as const) {
      it(`runs a whole model as the main backend (${file}, sparse ${sparse}, KV cache on the device): the CPU's greedy ids`, async () => {
        const cpu = await cpuBackend.load({ threads: 1 });
        const gpu = await load();
        const onCpu = await Model.load(join(models, "powerinfer", file), { backend: cpu, sparse });
        const onGpu = await Model.load(join(models, "powerinfer", file), { backend: gpu, sparse });
        const a = onCpu.createSession({ nCtx: 32, kvType: "f32" });
        const b = onGpu.createSession({ nCtx: 32, kvType: "f32" });
        try {
          expect(gpu.allocatedBytes()).toBeGreaterThan(0);
          let la = a.evaluate([1, 259, 260, 261]);
          let lb = b.evaluate([1, 259, 260, 261]);
          for (let step = 0; step < 4; step++) {
            expect(relErr(lb, la), `step ${step}`).toBeLessThan(tol);
            const id = argmax(la);
            expect(argmax(lb)).toBe(id);
            la = a.evaluate([id]);
            lb = b.evaluate([id]);
          }
        } finally {
          a.dispose();
          b.dispose();
          onCpu.dispose();
          onGpu.dispose();
          gpu.dispose();
          cpu.dispose();
        }
      });
    }
    for (const [arch, sparse, gating] of [
      ["smallthinker", "off", "sigmoid"],
      ["smallthinker", "oracle", "softmax"],
      ["qwen3moe", "off", "softmax"],
    ] as const) {
      it(`runs a model with routed experts as the main backend (${arch}, ${gating} gating, sparse ${sparse}): the CPU's greedy ids, logits within 1e-4`, async () => {
        const dir = mkdtempSync(join(tmpdir(), "gpu-moe-"));
        const path = join(dir, `${arch}.gguf`);
        generateSyntheticMoeModel(path, {
          arch,
          shape: {
            n_embd: 64,
            n_ff: 64,
            n_ff_exp: 48,
            n_expert: 6,
            n_expert_used: 2,
            n_head: 4,
            n_head_kv: 2,
            n_layer: 2,
            n_ctx: 64,
          },
          gating,
          seed: 5,
        });
        const cpu = await cpuBackend.load({ threads: 1 });
        const gpu = await load();
        const onCpu = await Model.load(path, { backend: cpu, sparse });
        const onGpu = await Model.load(path, { backend: gpu, sparse });
        const a = onCpu.createSession({ nCtx: 32, kvType: "f32" });
        const b = onGpu.createSession({ nCtx: 32, kvType: "f32" });
        try {
          let la = a.evaluate([1, 259, 260, 261]);
          let lb = b.evaluate([1, 259, 260, 261]);
          for (let step = 0; step < 4; step++) {
            expect(relErr(lb, la), `step ${step}`).toBeLessThan(1e-4);
            const id = argmax(la);
            expect(argmax(lb)).toBe(id);
            la = a.evaluate([id]);
            lb = b.evaluate([id]);
          }
          if (sparse === "oracle") expect(b.stats.rowsRead).toBe(a.stats.rowsRead);
        } finally {
          a.dispose();
          b.dispose();
          onCpu.dispose();
          onGpu.dispose();
          gpu.dispose();
          cpu.dispose();
          rmSync(dir, { recursive: true, force: true });
        }
      });
    }
    it.skipIf(opts.hybrid === false)(
      "hybrid: hot neurons here, cold on the CPU — the CPU-only greedy ids, logits within 1e-4",
      async () => {
        const cpu = await cpuBackend.load({ threads: 1 });
        const device = await load();
        const model = await Model.load(fixture, { backend: cpu, sparse: "predictor" });
        const cfg = model.config;
        // every third neuron hot, the rest cold
        const plan = {
          layers: Array.from({ length: cfg.n_layer }, () => ({
            hot: Int32Array.from({ length: Math.ceil(cfg.n_ff / 3) }, (_, i) => 3 * i),
          })),
        };
        const single = model.createSession({ nCtx: 32, kvType: "f32" });
        // the single-backend reference first: its logits arrays are its own
        const ref: Float32Array[] = [];
        let a = single.evaluate([1, 259, 260, 261]);
        const ids: number[] = [];
        for (let step = 0; step < 4; step++) {
          ref.push(Float32Array.from(a));
          ids.push(argmax(a));
          a = single.evaluate([ids[step]!]);
        }
        single.dispose();
        const placed = model.offload(device, plan);
        const hybrid = model.createSession({ nCtx: 32, kvType: "f32" });
        try {
          expect(placed.deviceBytes()).toBeGreaterThan(0);
          let h = await hybrid.evaluateAsync([1, 259, 260, 261]);
          for (let step = 0; step < 4; step++) {
            expect(relErr(h, ref[step]!), `step ${step}`).toBeLessThan(1e-4);
            expect(argmax(h)).toBe(ids[step]);
            h = await hybrid.evaluateAsync([ids[step]!]);
          }
        } finally {
          hybrid.dispose();
          model.dispose();
          device.dispose();
          (cpu as Backend).dispose();
        }
      },
    );
  });
}
