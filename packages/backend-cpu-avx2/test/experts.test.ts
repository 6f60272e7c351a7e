/**
 * Routed experts (mixture of experts) on the CPU backend: the conformance kit's expert ops at 1 and 2
 * threads and with the scalar kernels, and the typed errors for malformed expert graphs.
 */
import { BackendError, EXPERT_OPS, formatConformanceReport, Graph, runConformance } from "@powerinfer/core";
import { describe, expect, it } from "vitest";
import { cpuBackend } from "../src/index.js";

process.env.POWERINFER_CPU_SERIAL_BYTES = "0";

const usable = cpuBackend.probe() as { usable: boolean; reason: string };
const OPS = [...EXPERT_OPS, "sigmoid", "reshape", "attention_swa"] as const;

describe.skipIf(!usable.usable)("routed experts (cpu)", () => {
  for (const opts of [{ threads: 1 }, { threads: 2 }, { threads: 2, forceScalar: true }]) {
    it(`passes the conformance kit's expert ops at ${JSON.stringify(opts)}`, async () => {
      const b = await cpuBackend.load(opts);
      try {
        const report = await runConformance(b, { ops: OPS });
        // every expert op for f32, f16, q8_0, q4_0 weights at least
        for (const op of ["mul_mat_id", "mul_mat_id_sparse", "axpy_id_sparse"] as const) {
          for (const d of ["f32", "f16", "q8_0", "q4_0"] as const) {
            expect(report.claimed).toContainEqual({ op, dtype: d });
          }
        }
        expect(report.claimed).toContainEqual({ op: "top_k", dtype: "f32" });
        expect(report.claimed).toContainEqual({ op: "moe_sum", dtype: "f32" });
        expect(report.claimed).toContainEqual({ op: "reshape", dtype: "f32" });
        expect(report.claimed).toContainEqual({ op: "attention_swa", dtype: "f16" });
        expect(report.ok, formatConformanceReport(report)).toBe(true);
      } finally {
        b.dispose();
      }
    }, 120_000);
  }

  it("refuses an expert id out of range, ids not from an input or top_k, and top_k over more values than experts", async () => {
    const b = await cpuBackend.load({ threads: 1 });
    try {
      const w = b.createTensor("f32", [4, 3, 2]);
      const g = new Graph();
      g.output(
        g.mulMatId(g.handle(w), g.input("f32", [4, 1], new Float32Array(4)), g.input("i32", [1, 1], Int32Array.of(2))),
      );
      expect(() => b.compute(g)).toThrow(BackendError);
      expect(() => b.compute(g)).toThrow(/expert id 2 .*out of range 0\.\.1/);
      const g2 = new Graph();
      const ids = g2.topK(g2.input("f32", [3, 1], Float32Array.of(1, 2, 3)), 1);
      g2.output(g2.mulMatId(g2.handle(w), g2.input("f32", [4, 1], new Float32Array(4)), ids));
      expect(() => b.compute(g2)).toThrow(/top_k over 3 values, but there are 2 experts/);
    } finally {
      b.dispose();
    }
  });
});
