import { formatConformanceReport, runConformance } from "@powerinfer/core";
import { describe, expect, it } from "vitest";
import { cpuBackend } from "../src/index.js";

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
