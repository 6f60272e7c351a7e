/**
 * The conformance kit's perf mode through `powerinfer backends --perf`: the reference backend beside the
 * CPU backend. Rows must exist for every claimed pair with both columns; no time is asserted (speed is
 * measured by benchmarks, not tests).
 */
import { spawnSync } from "node:child_process";
import { fileURLToPath } from "node:url";
import { describe, expect, it } from "vitest";

const bin = fileURLToPath(new URL("../dist/bin.js", import.meta.url));
const cli = (args: string[]) =>
  spawnSync(process.execPath, [bin, ...args], {
    encoding: "utf8",
    timeout: 300_000,
    env: { ...process.env, POWERINFER_BACKEND: "", POWERINFER_BACKENDS: "" },
  });

describe("backends --perf", () => {
  it("prints one row per op and dtype for the reference backend beside the CPU backend", () => {
    const r = cli(["backends", "--perf", "ts-reference", "--perf-size", "256", "--perf-repeats", "1", "--json"]);
    expect(r.status, r.stderr).toBe(0);
    const [report] = JSON.parse(r.stdout) as {
      backend: string;
      baseline: string;
      rows: { op: string; dtype: string; shape: string; us?: number; baselineUs?: number }[];
    }[];
    expect(report!.backend).toBe("ts-reference");
    expect(report!.baseline).toBe("cpu");
    const pairs = new Set(report!.rows.map((x) => `${x.op}/${x.dtype}`));
    for (const p of [
      "mul_mat/f16",
      "mul_mat/q4_0",
      "mul_mat_sparse/q8_0",
      "axpy_sparse/f32",
      "attention/f16",
      "rms_norm/f32",
      "cpy/bf16",
      "mul_mat_id/q4_K",
      "top_k/f32",
    ]) {
      expect(pairs, p).toContain(p);
    }
    for (const row of report!.rows) {
      expect(row.us, `${row.op}/${row.dtype}`).toBeGreaterThan(0);
      expect(row.baselineUs, `${row.op}/${row.dtype}`).toBeGreaterThan(0);
      expect(row.shape.length).toBeGreaterThan(0);
    }
  });

  it("prints the table as markdown, and refuses a bad size", () => {
    const r = cli(["backends", "--perf", "cpu", "--perf-size", "256", "--perf-repeats", "1"]);
    expect(r.status, r.stderr).toBe(0);
    expect(r.stdout).toMatch(/^perf of backend "cpu" beside "cpu"/);
    expect(r.stdout).toMatch(
      /^\| mul_mat \| q4_0 \| W\[256,256\]·x\[256,1\] \| [0-9.]+ (µs|ms) \| [0-9.]+ (µs|ms) \| [0-9.e+-]+× \|/m,
    );
    const bad = cli(["backends", "--perf", "cpu", "--perf-size", "100"]);
    expect(bad.status).toBe(1);
    expect(bad.stderr).toMatch(/--perf-size must be a positive multiple of 256, at most 16384, got 100/);
  });
});
