/** `powerinfer gen-model`: options, errors, and the statistics of the written model measured in the engine. */
import { existsSync, mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import { Model } from "@powerinfer/engine";
import { openGguf, parseModelConfig } from "@powerinfer/gguf";
import { Command } from "commander";
import { afterAll, describe, expect, it, vi } from "vitest";
import { register } from "../src/commands/gen-model.js";

const dir = mkdtempSync(join(tmpdir(), "gen-model-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

/** Runs `powerinfer gen-model ...args` in-process; returns stdout, stderr and the exit code it set. */
async function cli(...args: string[]): Promise<{ out: string; err: string; code: number }> {
  const program = new Command("powerinfer").exitOverride();
  register(program);
  let out = "";
  let err = "";
  const so = vi.spyOn(process.stdout, "write").mockImplementation((s) => {
    out += String(s);
    return true;
  });
  const se = vi.spyOn(process.stderr, "write").mockImplementation((s) => {
    err += String(s);
    return true;
  });
  const before = process.exitCode;
  process.exitCode = undefined;
  try {
    await program.parseAsync(["gen-model", ...args], { from: "user" });
    return { out, err, code: Number(process.exitCode ?? 0) };
  } catch (e) {
    return { out, err: err || String(e), code: 1 };
  } finally {
    so.mockRestore();
    se.mockRestore();
    process.exitCode = before;
  }
}

const probe = cpuBackend.probe() as Awaited<ReturnType<typeof cpuBackend.probe>>;

describe("gen-model", () => {
  it.skipIf(!probe.usable)(
    "tiny relu-llama PWRI: the engine measures ~10 % active neurons, predictor recall ≥ 0.9, and runs it in every FFN mode",
    async () => {
      const path = join(dir, "tiny.pwri.gguf");
      const r = await cli(
        "-o",
        path,
        "--preset",
        "tiny",
        "--format",
        "pwri",
        "--dtype",
        "q8_0",
        "--verify",
        "48",
        "--json",
      );
      expect(r.err).toBe("");
      expect(r.code).toBe(0);
      const rep = JSON.parse(r.out);
      expect(rep).toMatchObject({ arch: "relu-llama", format: "PWRI", dtype: "Q8_0", layers: 2, predictorRank: 128 });
      expect(rep.verify.tokens).toBe(48);
      for (const l of rep.verify.perLayer) {
        expect(l.activeFraction).toBeGreaterThan(0.06);
        expect(l.activeFraction).toBeLessThan(0.14);
        expect(l.recall).toBeGreaterThan(0.9);
        expect(l.predictedFraction).toBeLessThan(1.6 * l.activeFraction);
      }
      const backend = await cpuBackend.load({ threads: 1 });
      try {
        const active: Record<string, number> = {};
        for (const mode of ["predictor", "oracle"] as const) {
          const model = await Model.load(path, { backend, sparse: mode });
          const s = model.createSession({ nCtx: 32 });
          for (let t = 0; t < 16; t++) {
            const logits = s.evaluate([3 + ((t * 131) % 1000)]);
            expect(logits.every(Number.isFinite)).toBe(true);
          }
          active[mode] = s.stats.activeRows.reduce((a, b) => a + b, 0) / (s.stats.tokens * 2 * 1024);
          s.dispose();
          model.dispose();
        }
        // oracle computes exactly the firing neurons; the predictor a few more (recall-oriented threshold)
        expect(active.oracle).toBeGreaterThan(0.05);
        expect(active.oracle).toBeLessThan(0.16);
        expect(active.predictor).toBeGreaterThan(active.oracle!);
        expect(active.predictor).toBeLessThan(1.6 * active.oracle!);
      } finally {
        backend.dispose();
      }
    },
  );

  it("the text report names the file, shape, design and notes; the same seed writes the same bytes", async () => {
    const a = join(dir, "a.gguf");
    const b = join(dir, "b.gguf");
    const r = await cli("-o", a, "--preset", "tiny", "--layers", "1", "--seed", "7", "--stats-tokens", "8");
    expect(r.code).toBe(0);
    expect(r.out).toMatch(
      /^wrote .*a\.gguf: [\d.]+ MiB, [\d.]+ M parameters, relu-llama tiny \(1 of 2 layers\), F16, GGUF/,
    );
    expect(r.out).toContain("n_embd 256, n_ff 1024, n_head 4, n_head_kv 2, n_vocab 1024; seed 7");
    expect(r.out).toContain("note: llama.cpp ignores llama.hidden_act");
    await cli("-o", b, "--preset", "tiny", "--layers", "1", "--seed", "7", "--stats-tokens", "8");
    const { readFileSync } = await import("node:fs");
    expect(readFileSync(a).equals(readFileSync(b))).toBe(true);
  });

  it("falcon and bamboo files; --verify runs the falcon file in the engine", async () => {
    const f = join(dir, "falcon.gguf");
    const r = await cli("-o", f, "--preset", "tiny", "--arch", "falcon", "--stats-tokens", "8", "--verify", "16");
    expect(r.code).toBe(0);
    expect(r.out).not.toMatch(/skipped/);
    expect(r.out).toMatch(/measured in the engine \(16 random tokens/);
    expect(parseModelConfig(openGguf(f)).arch).toBe("falcon");
    const b = join(dir, "bamboo.gguf");
    expect((await cli("-o", b, "--preset", "tiny", "--arch", "bamboo", "--stats-tokens", "8")).out).toMatch(
      /llama\.cpp has no bamboo architecture/,
    );
  });

  it("bad input: one line naming the problem, non-zero exit, nothing written", async () => {
    const existing = join(dir, "exists.gguf");
    writeFileSync(existing, "x");
    const cases: [string[], RegExp][] = [
      [["-o", existing, "--preset", "tiny"], /exists \(use --force/],
      [["-o", join(dir, "x1.gguf"), "--dtype", "Q3_K"], /--dtype must be one of F32, F16, BF16, Q8_0, Q4_0, Q4_K/],
      [["-o", join(dir, "x2.gguf"), "--preset", "tiny", "--format", "pwri", "--dtype", "bf16"], /no BF16/],
      [["-o", join(dir, "x3.gguf"), "--preset", "tiny", "--format", "pwri", "--arch", "llama"], /ReLU model/],
      [["-o", join(dir, "x4.gguf"), "--preset", "9b"], /--preset must be one of tiny, 7b, 13b, 40b, 70b/],
      [["-o", join(dir, "x5.gguf"), "--preset", "tiny", "--active", "0.7"], /no power law|active fraction/],
      [["-o", join(dir, "x6.gguf"), "--preset", "tiny", "--layers", "two"], /layers must be an integer/],
    ];
    for (const [args, re] of cases) {
      const r = await cli(...args);
      expect(r.code, args.join(" ")).not.toBe(0);
      expect(r.err, args.join(" ")).toMatch(re);
      expect(r.err.trim().split("\n")).toHaveLength(1);
    }
    for (let i = 1; i <= 6; i++) expect(existsSync(join(dir, `x${i}.gguf`))).toBe(false);
  });
});

describe("gen-model with routed experts", () => {
  it("writes a Qwen3-30B-A3B-shaped slice (published shape) that parses as qwen3moe", async () => {
    const out = join(dir, "q3moe.gguf");
    const r = await cli(
      "--preset",
      "qwen3-30b-a3b",
      "--layers",
      "1",
      "--dtype",
      "Q8_0",
      "--vocab-size",
      "512",
      "-o",
      out,
      "--json",
    );
    expect(r.code, r.err).toBe(0);
    const rep = JSON.parse(r.out);
    expect(rep.ggufArch).toBe("qwen3moe");
    const cfg = parseModelConfig(openGguf(out));
    expect(cfg.moe).toMatchObject({ n_expert: 128, n_expert_used: 8, n_ff_exp: 768 });
    expect([cfg.n_embd, cfg.n_head, cfg.n_head_kv, cfg.head_dim, cfg.n_layer]).toEqual([2048, 32, 4, 128, 1]);
    // attention 2048·128·(2·32 + 2·4) + q/k norms 2·128 + 2 norms 2·2048 + router 2048·128 + 8 experts ·
    // 3·2048·768, plus the output norm 2048 and matrix 2048·512 — what inspect counts from the file
    expect(rep.activeParametersPerToken).toBe(
      2048 * 128 * 72 + 2 * 128 + 2 * 2048 + 2048 * 128 + 8 * 3 * 2048 * 768 + 2048 + 2048 * 512,
    );
    const { inspectFile } = await import("../src/commands/inspect.js");
    expect(inspectFile(out).experts!.activeParametersPerToken).toBe(rep.activeParametersPerToken);
  }, 120_000);

  it("refuses --format pwri for SiLU experts and a conflicting --arch for an expert preset", async () => {
    const a = await cli("--preset", "mixtral-8x7b", "--format", "pwri", "-o", join(dir, "x.gguf"));
    expect(a.code).toBe(1);
    expect(a.err).toMatch(/experts are SiLU, and a PowerInfer \(PWRI\) file is read as ReLU/);
    expect(existsSync(join(dir, "x.gguf"))).toBe(false);
    const b = await cli("--preset", "smallthinker-4b-a0.6b", "--arch", "falcon", "-o", join(dir, "y.gguf"));
    expect(b.code).toBe(1);
    expect(b.err).toMatch(/is a smallthinker model/);
  });

  it("--predictors: per-expert predictors for ReLU experts (report and tensors), refused for SiLU experts and dense presets", async () => {
    const out = join(dir, "st-pred.gguf");
    const r = await cli(
      "--preset",
      "smallthinker-4b-a0.6b",
      "--layers",
      "1",
      "--dtype",
      "Q8_0",
      "--vocab-size",
      "512",
      "--predictors",
      "--predictor-rank",
      "32",
      "-o",
      out,
    );
    expect(r.code, r.err).toBe(0);
    expect(r.out).toMatch(
      /predictors: per expert, rank 32 Q8_0, threshold -0\.\d+ \(calibrated on the design for recall 0\.95\)/,
    );
    const f = openGguf(out);
    expect(f.tensorMap.get("blk.0.fc1_exps.weight")!.shape).toEqual([1536, 32, 32]);
    expect(f.tensorMap.get("blk.0.fc2_exps.weight")!.shape).toEqual([32, 768, 32]);
    const cfg = parseModelConfig(f);
    expect(cfg.has_predictors).toBe(true);
    expect(cfg.predictor_ranks).toEqual([32]);
    expect(cfg.sparse_threshold).toBeLessThan(0);
    const silu = await cli("--preset", "mixtral-8x7b", "--layers", "1", "--predictors", "-o", join(dir, "z1.gguf"));
    expect(silu.code).toBe(1);
    expect(silu.err).toMatch(/experts are SiLU/);
    const dense = await cli("--preset", "tiny", "--predictors", "-o", join(dir, "z2.gguf"));
    expect(dense.code).toBe(1);
    expect(dense.err).toMatch(/--predictors is for the expert presets; tiny writes its predictors with --format pwri/);
    const q8 = await cli(
      "--preset",
      "smallthinker-4b-a0.6b",
      "--layers",
      "1",
      "--predictors",
      "--dtype",
      "Q8_0",
      "--predictor-rank",
      "48",
      "-o",
      join(dir, "z3.gguf"),
    );
    expect(q8.code).toBe(1);
    expect(q8.err).toMatch(/predictor type Q8_0 needs the predictor rank to be a multiple of 32 \(got 48\)/);
    for (const z of ["z1", "z2", "z3"]) expect(existsSync(join(dir, `${z}.gguf`))).toBe(false);
  }, 120_000);
});
