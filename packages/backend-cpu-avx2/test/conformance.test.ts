import { formatConformanceReport, runConformance } from "@powerinfer/core";
import { describe, expect, it } from "vitest";
import { cpuBackend } from "../src/index.js";

// Every graph on the whole pool (small graphs would otherwise run on one thread), so that the
// 2-thread runs check the threaded paths.
process.env.POWERINFER_CPU_SERIAL_BYTES = "0";

const usable = cpuBackend.probe() as { usable: boolean; reason: string };

describe.skipIf(!usable.usable)("conformance kit (core)", () => {
  for (const opts of [{ threads: 1 }, { threads: 2 }, { threads: 2, forceScalar: true }]) {
    it(`passes at ${JSON.stringify(opts)}`, async () => {
      const b = await cpuBackend.load(opts);
      try {
        const report = await runConformance(b);
        expect(report.claimed.length).toBeGreaterThan(0);
        expect(report.ok, formatConformanceReport(report)).toBe(true);
      } finally {
        b.dispose();
      }
    });
  }
});
