/**
 * --ram-budget: sparse FFN rows served from the model file through the CPU backend's neuron cache.
 * With any budget the greedy ids must equal the unlimited run's (the cached ops compute every output
 * exactly as the mapped ones): the shared ReLU model (oracle mode; up and ffn_down_t cached) and a
 * generated PowerInfer model with predictors (up, gate and ffn_down_t cached), at the resident part plus
 * 30 %, 60 % and 100 % of the FFN bytes; routed-expert models (SiLU, ReGLU with predictors, dReLU Q8_0) with
 * their expert stacks cached one expert per row, likewise; a budget below the resident part is refused before loading;
 * and the CLI under a cgroup v1 memory limit (root only; skipped with the reason otherwise).
 */
import { spawnSync } from "node:child_process";
import {
  existsSync,
  mkdirSync,
  mkdtempSync,
  readFileSync,
  rmdirSync,
  rmSync,
  symlinkSync,
  writeFileSync,
} from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import type { Backend, NeuronCacheStats } from "@powerinfer/core";
import {
  argmax,
  DEFAULT_HOT_SHARE,
  EngineError,
  formatBytes,
  Model,
  planRamBudget,
  type SparseMode,
} from "@powerinfer/engine";
import { openGgufModel, parseModelConfig, readTensorBytes, writeActivationStats } from "@powerinfer/gguf";
import { generateSyntheticMoeModel } from "@powerinfer/synthetic";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { TINY_MOE_SHAPE } from "./moe-shape.js";

const models = process.env.POWERINFER_TEST_MODELS!;
const relu = join(models, "relu", "tinystories-relu-llama-7m.f32.gguf");
const bin = join(dirname(fileURLToPath(import.meta.url)), "..", "dist", "bin.js");
const probe = await cpuBackend.probe();

function cli(args: string[]): { status: number | null; stdout: string; stderr: string } {
  const r = spawnSync(process.execPath, [bin, ...args], { encoding: "utf8", timeout: 300_000 });
  return { status: r.status, stdout: r.stdout, stderr: r.stderr };
}

/** Greedy ids: the prompt evaluated, then `n` tokens one at a time. */
function greedy(model: Model, prompt: number[], n: number): number[] {
  const s = model.createSession({ nCtx: 128, kvType: "f32" });
  try {
    let logits = s.evaluate(prompt);
    const ids: number[] = [];
    for (let i = 0; i < n; i++) {
      ids.push(argmax(logits));
      logits = s.evaluate([ids[i]!]);
    }
    return ids;
  } finally {
    s.dispose();
  }
}

/** The budget holding the resident part plus `share` of the FFN bytes. */
function budgetFor(path: string, sparse: string, share: number): number {
  const file = openGgufModel(path);
  const p = planRamBudget(file, parseModelConfig(file), Number.MAX_SAFE_INTEGER, sparse);
  return p.residentBytes + share * p.ffnBytes;
}

describe.skipIf(!probe.usable)("--ram-budget: FFN rows from the file through the neuron cache", () => {
  let backend: Backend;
  let dir: string;
  let reluPwri: string;
  let gen: string;
  beforeAll(async () => {
    backend = await cpuBackend.load({ threads: 2 });
    dir = mkdtempSync(join(tmpdir(), "pi-ram-"));
    reluPwri = join(dir, "relu.pwri.gguf");
    gen = join(dir, "gen.pwri.gguf");
    const c = cli(["convert", relu, reluPwri, "--to", "pwri"]);
    expect(c.status, c.stderr).toBe(0);
    const g = cli(["gen-model", "-o", gen, "--preset", "tiny", "--format", "pwri", "--dtype", "F16", "--seed", "3"]);
    expect(g.status, g.stderr).toBe(0);
  }, 300_000);
  afterAll(() => {
    backend?.dispose();
    if (dir) rmSync(dir, { recursive: true, force: true });
  });

  const cases: [string, () => string, SparseMode][] = [
    ["the ReLU model (oracle: up and ffn_down_t cached)", () => reluPwri, "oracle"],
    ["a generated PowerInfer model (predictor: up, gate, ffn_down_t cached)", () => gen, "predictor"],
  ];
  for (const [what, path, sparse] of cases) {
    it(`${what}: greedy ids at resident + 30/60/100 % of the FFN bytes equal the unlimited run's`, async () => {
      const prompt = [1, 20, 30, 40, 50, 60, 70];
      const full = await Model.load(path(), { backend, sparse });
      const want = greedy(full, prompt, 24);
      full.dispose();
      for (const share of [0.3, 0.6, 1]) {
        const before: NeuronCacheStats = backend.neuronCacheStats!();
        const m = await Model.load(path(), { backend, sparse, ramBudget: budgetFor(path(), sparse, share) });
        try {
          expect(m.ramPlan!.tensors.length).toBeGreaterThan(0);
          expect(m.ramPlan!.cachedShare).toBeCloseTo(share, 2);
          expect(greedy(m, prompt, 24)).toEqual(want);
          const after = backend.neuronCacheStats!();
          expect(after.ioErrors - before.ioErrors).toBe(0);
          if (share < 1) {
            // rows really came from the file
            expect(after.misses - before.misses).toBeGreaterThan(0);
            expect(after.bytesRead - before.bytesRead).toBeGreaterThan(0);
          } else {
            // everything pinned at load: no read while generating
            expect(after.misses - before.misses).toBe(0);
          }
        } finally {
          m.dispose();
        }
      }
    }, 120_000);
  }

  // Routed experts: the stacks cached one expert per row (experts the unit of caching); an F16/F32 down
  // stack in a sparse mode transposed as it is read (the unlimited sparse run's neuron-major copy), a
  // quantized one run densely as stored — so every case computes what the unlimited run computes.
  const moeCases: [string, Parameters<typeof generateSyntheticMoeModel>[1], SparseMode][] = [
    ["llama-moe SiLU F16 (dense experts)", { arch: "llama-moe", shape: TINY_MOE_SHAPE, dtype: "F16" }, "off"],
    [
      "smallthinker F16 with predictors (down transposed on read)",
      { arch: "smallthinker", shape: TINY_MOE_SHAPE, design: {}, predictors: {}, dtype: "F16" },
      "predictor",
    ],
    ["smallthinker F32, oracle", { arch: "smallthinker", shape: TINY_MOE_SHAPE, design: {}, predictors: {} }, "oracle"],
    [
      "llama-moe dReLU Q8_0 with predictors (quantized down as stored)",
      { arch: "llama-moe", shape: TINY_MOE_SHAPE, upActivation: "relu", design: {}, predictors: {}, dtype: "Q8_0" },
      "predictor",
    ],
    [
      "smallthinker Q4_0 PWRI with predictors (down stored neuron-major, ffn_down_exps_t)",
      { arch: "smallthinker", shape: TINY_MOE_SHAPE, design: {}, predictors: {}, dtype: "Q4_0", format: "PWRI" },
      "predictor",
    ],
  ];
  for (const [what, opts, sparse] of moeCases) {
    it(`routed experts, ${what}: greedy ids at resident + 30/60/100 % of the expert bytes equal the unlimited run's`, async () => {
      const path = join(dir, `${what.replace(/\W+/g, "-")}.gguf`);
      generateSyntheticMoeModel(path, opts);
      const prompt = [1, 20, 30, 40, 50, 60, 70];
      const full = await Model.load(path, { backend, sparse });
      const want = greedy(full, prompt, 16);
      full.dispose();
      for (const share of [0.3, 0.6, 1]) {
        const before: NeuronCacheStats = backend.neuronCacheStats!();
        const m = await Model.load(path, { backend, sparse, ramBudget: budgetFor(path, sparse, share) });
        try {
          const roles = m.ramPlan!.tensors.map((t) => t.role);
          expect(roles.filter((r) => /_exps(_t)?$/.test(r)).length).toBe(3 * m.config.n_layer);
          if (opts.format === "PWRI") expect(roles.filter((r) => r === "down_exps_t").length).toBe(m.config.n_layer);
          expect(m.ramPlan!.tensors.every((t) => t.rows === m.config.moe!.n_expert)).toBe(true);
          expect(greedy(m, prompt, 16)).toEqual(want);
          const after = backend.neuronCacheStats!();
          expect(after.ioErrors - before.ioErrors).toBe(0);
          if (share < 1) expect(after.misses - before.misses).toBeGreaterThan(0);
          else expect(after.misses - before.misses).toBe(0);
        } finally {
          m.dispose();
        }
      }
    }, 120_000);
  }

  for (const format of ["GGUF", "PWRI"] as const)
    it(`routed experts with a device (the CPU standing in), ${format}: same text with and without --ram-budget; the hot rows are read from the file alone`, () => {
      const path = join(dir, `moe-device-${format}.gguf`);
      generateSyntheticMoeModel(path, {
        arch: "smallthinker",
        shape: TINY_MOE_SHAPE,
        design: {},
        predictors: {},
        dtype: format === "PWRI" ? "Q8_0" : "F16",
        format,
      });
      const stats = join(dir, `moe-device-${format}.activations.gguf`);
      const text = relu.replace(/\.f32\.gguf$/, ".eval.txt");
      const p = cli(["profile", "-m", path, "-f", text, "--tokens", "64", "-c", "64", "-o", stats]);
      expect(p.status, p.stderr).toBe(0);
      // a profile output that is the model through a symbolic link is refused (the writer follows links)
      const link = join(dir, `moe-device-link-${format}.gguf`);
      symlinkSync(path, link);
      const bad = cli(["profile", "-m", path, "-f", text, "--tokens", "8", "-o", link, "--force"]);
      expect(bad.status).not.toBe(0);
      expect(bad.stderr).toMatch(/is also an input/);
      const args = [
        "run",
        "-m",
        path,
        "-p",
        "once upon a time",
        "-n",
        "12",
        "--temp",
        "0",
        "-t",
        "2",
        "--stats",
        stats,
      ];
      const dev = ["--device-backend", "cpu", "--vram-budget", "0.001"];
      const cpu = cli(args);
      expect(cpu.status, cpu.stderr).toBe(0);
      const budget = (budgetFor(path, "predictor", 0.3) / 2 ** 30).toFixed(6);
      const r = cli([...args, ...dev, "--ram-budget", budget]);
      expect(r.status, r.stderr).toBe(0);
      expect(r.stderr).toMatch(/hybrid: \d+ hot \(expert, neuron\) pairs/);
      expect(r.stderr).toMatch(/expert cache .* experts pinned .* by profile selection counts/);
      expect(r.stdout).toBe(cpu.stdout);
    }, 120_000);

  it("routed experts: a budget below the resident part plus one token's experts is RAM_BUDGET naming the expert cache", async () => {
    const path = join(dir, "moe-small-budget.gguf");
    generateSyntheticMoeModel(path, { arch: "smallthinker", shape: TINY_MOE_SHAPE, dtype: "F16" });
    const file = openGgufModel(path);
    const cfg = parseModelConfig(file);
    const p = planRamBudget(file, cfg, Number.MAX_SAFE_INTEGER, "off");
    const expertBytes = p.tensors[0]!.rowBytes;
    // the minimum: the resident part and n_expert_used experts of each stack
    const min = p.residentBytes + 3 * cfg.n_layer * cfg.moe!.n_expert_used * expertBytes;
    expect(() => planRamBudget(file, cfg, min, "off")).not.toThrow();
    const err = await Model.load(path, { backend, sparse: "off", ramBudget: min - 1 }).catch((e) => e);
    expect(err).toBeInstanceOf(EngineError);
    expect((err as EngineError).code).toBe("RAM_BUDGET");
    expect((err as EngineError).message).toMatch(/output, routers take .*; the expert cache needs at least/);
  });

  it("the bundled layout (convert --bundle): same greedy ids, fewer reads, inspect names it, convert --to pwri restores the tensors", async () => {
    const bundled = join(dir, "gen.bundle.gguf");
    const back = join(dir, "gen.back.gguf");
    const c = cli(["convert", gen, bundled, "--bundle"]);
    expect(c.status, c.stderr).toBe(0);
    expect(c.stderr).toMatch(/bundled FFN \(\d+ layers, \d+ neurons per 4 KiB-aligned bucket\)/);
    const ins = cli(["inspect", bundled]);
    expect(ins.stdout).toMatch(/FFN layout: +bundled \(ffn_up \+ ffn_gate \+ ffn_down_t rows/);
    expect(cli(["inspect", gen]).stdout).toMatch(/FFN layout: +tensors/);
    const prompt = [1, 20, 30, 40, 50, 60, 70];
    const full = await Model.load(gen, { backend });
    const want = greedy(full, prompt, 24);
    full.dispose();
    const reads: number[] = [];
    const misses: number[] = [];
    for (const [path, budget] of [
      [bundled, undefined],
      [bundled, budgetFor(bundled, "predictor", 0.3)],
      [gen, budgetFor(gen, "predictor", 0.3)],
    ] as const) {
      const before = backend.neuronCacheStats!();
      const m = await Model.load(path, { backend, ramBudget: budget });
      try {
        expect(greedy(m, prompt, 24)).toEqual(want);
      } finally {
        m.dispose();
      }
      reads.push(backend.neuronCacheStats!().reads - before.reads);
      misses.push(backend.neuronCacheStats!().misses - before.misses);
    }
    expect(misses[0]).toBe(0); // no budget: every record pinned at load, nothing read while generating
    expect(reads[1]).toBeLessThan(reads[2]!); // one read per neuron instead of one per part
    const r = cli(["convert", bundled, back, "--to", "pwri"]);
    expect(r.status, r.stderr).toBe(0);
    const a = openGgufModel(gen);
    const b = openGgufModel(back);
    for (const t of a.tensors) {
      const u = b.tensorMap.get(t.name);
      expect(u, t.name).toBeDefined();
      expect(Buffer.compare(readTensorBytes(a, t), readTensorBytes(b, u!)), t.name).toBe(0);
    }
    const bad = cli(["convert", bundled, join(dir, "x.gguf"), "--to", "gguf"]);
    expect(bad.status).not.toBe(0);
    expect(bad.stderr).toMatch(/converts back to PWRI/);
  }, 120_000);

  it("with a device (hybrid split, the CPU standing in for it): same text with and without --ram-budget", () => {
    const args = ["run", "-m", gen, "-p", "once upon a time", "-n", "12", "--temp", "0", "-t", "2"];
    const dev = ["--device-backend", "cpu", "--vram-budget", "0.0005"];
    const p = cli([
      "profile",
      "-m",
      gen,
      "-f",
      relu.replace(/\.f32\.gguf$/, ".eval.txt"),
      "--tokens",
      "96",
      "-c",
      "96",
      "-o",
      join(dir, "gen.activations.gguf"),
    ]);
    expect(p.status, p.stderr).toBe(0);
    const free = cli([...args, ...dev, "--stats", join(dir, "gen.activations.gguf")]);
    expect(free.status, free.stderr).toBe(0);
    expect(free.stderr).toMatch(/hybrid: \d+ hot neurons/);
    const budget = budgetFor(gen, "predictor", 0.3) / 2 ** 30;
    const r = cli([...args, ...dev, "--stats", join(dir, "gen.activations.gguf"), "--ram-budget", String(budget)]);
    expect(r.status, r.stderr).toBe(0);
    expect(r.stderr).toMatch(/hybrid: \d+ hot neurons/);
    expect(r.stdout).toBe(free.stdout);
  }, 120_000);

  it("pins the hottest neurons from activation statistics", async () => {
    const file = openGgufModel(gen);
    const cfg = parseModelConfig(file);
    const counts = Array.from({ length: cfg.n_layer }, () => {
      const c = new Int32Array(cfg.n_ff);
      c[5] = 100;
      c[7] = 90;
      c[1] = 80;
      return c;
    });
    const stats = { counts, nFf: cfg.n_ff, tokenCount: 100 } as never;
    const b = budgetFor(gen, "predictor", 0.3);
    const p = planRamBudget(file, cfg, b, "predictor", stats);
    for (const t of p.tensors) {
      // few neurons fire, so the working set is small: the pinned share is the cap, DEFAULT_HOT_SHARE
      expect(t.hot.length).toBe(Math.floor(Math.floor(0.3 * t.rows) * DEFAULT_HOT_SHARE));
      expect([...t.hot]).toEqual(expect.arrayContaining([1, 5, 7]));
    }
  });

  it("pins nothing when one layer's working set fills the LRU region", () => {
    const file = openGgufModel(gen);
    const cfg = parseModelConfig(file);
    // half of the neurons fire on every token: 1.3 × that × 3 parts is more than 30 % of the rows
    const counts = Array.from({ length: cfg.n_layer }, () => new Int32Array(cfg.n_ff).fill(50));
    const stats = { counts, nFf: cfg.n_ff, tokenCount: 100 } as never;
    const p = planRamBudget(file, cfg, budgetFor(gen, "predictor", 0.3), "predictor", stats);
    for (const t of p.tensors) {
      expect(t.hot.length).toBe(0);
      expect(t.coldRows).toBe(Math.floor(0.3 * t.rows));
    }
  });

  it("a budget below the resident part is a RAM_BUDGET error before loading, naming the bytes needed", async () => {
    const file = openGgufModel(gen);
    const p = planRamBudget(file, parseModelConfig(file), Number.MAX_SAFE_INTEGER, "predictor");
    const allocated = backend.allocatedBytes();
    const err = await Model.load(gen, { backend, ramBudget: p.residentBytes / 2 }).catch((e) => e);
    expect(err).toBeInstanceOf(EngineError);
    expect((err as EngineError).code).toBe("RAM_BUDGET");
    // a small model's megabytes in MiB (not "0.002 GiB")
    expect((err as EngineError).message).toMatch(/needs at least [\d.]+ MiB \(\d+ bytes\)/);
    expect(backend.allocatedBytes()).toBe(allocated);
    const r = cli(["run", "-m", gen, "-p", "hi", "-n", "2", "--ram-budget", "0.0001", "-t", "1"]);
    expect(r.status).not.toBe(0);
    // each amount in a unit that shows it: the budget (0.0001 GiB) in KiB, not "0.000 GiB"
    expect(r.stderr.trim().split("\n").at(-1)).toMatch(
      /^powerinfer: RAM budget 104\.858 KiB \(107374 bytes\) is too small for this model: it needs at least \d+\.\d{3} MiB \(\d+ bytes\) \(resident: embeddings, attention, norms, output and predictors take \d+\.\d{3} MiB; the neuron cache needs at least \d+\.\d{3} KiB\)$/,
    );
    expect(r.stderr).not.toMatch(/0\.000 GiB/);
    // the plan's line, likewise
    const ok = cli([
      "run",
      "-m",
      gen,
      "-p",
      "hi",
      "-n",
      "2",
      "--ram-budget",
      String(budgetFor(gen, "predictor", 0.3) / 2 ** 30),
      "-t",
      "1",
    ]);
    expect(ok.status, ok.stderr).toBe(0);
    expect(ok.stderr).toMatch(
      /^ram budget \d+\.\d{3} MiB: resident \d+\.\d{3} MiB \+ neuron cache \d+\.\d{3} KiB \(30\.0 % of \d+\.\d{3} MiB FFN rows; pinned hot \d+ bytes\)/m,
    );
    expect([1, 512, 1536, 2544640, 3 * 2 ** 30].map((b) => formatBytes(b))).toEqual([
      "1 byte",
      "512 bytes",
      "1.500 KiB",
      "2.427 MiB",
      "3.000 GiB",
    ]);
    // a reader-thread count the native side would silently replace
    for (const bad of ["abc", "0", "1.5", "1000"]) {
      const e = spawnSync(process.execPath, [bin, "run", "-m", gen, "-p", "hi", "-n", "1", "--ram-budget", "1"], {
        encoding: "utf8",
        env: { ...process.env, POWERINFER_IO_THREADS: bad },
      });
      expect(e.status, bad).not.toBe(0);
      expect(e.stderr).toMatch(/POWERINFER_IO_THREADS must be a whole number from 1 to 256/);
    }
    // a read engine the native side would take for io_uring: refused by run with or without a budget (a
    // bundled file reads through the cache without one) and by bench
    for (const args of [
      ["run", "-m", gen, "-p", "hi", "-n", "1", "--ram-budget", "1"],
      ["run", "-m", gen, "-p", "hi", "-n", "1"],
      ["bench", "-m", gen, "-p", "0", "-n", "1", "-r", "1", "--no-llama-cpp", "--ram-budget", "1"],
    ]) {
      const e = spawnSync(process.execPath, [bin, ...args], {
        encoding: "utf8",
        env: { ...process.env, POWERINFER_IO: "uring" },
      });
      expect(e.status, args.join(" ")).not.toBe(0);
      expect(e.stderr).toMatch(/POWERINFER_IO must be io_uring \(the default\) or pread, got "uring"/);
    }
  });

  it("statistics of another model (the default file or --stats) name the file and the fix, with --ram-budget or a device", () => {
    // gen.pwri.gguf seen from a folder of its own, where <model>.activations.gguf is another model's (n_ff 16)
    const own = mkdtempSync(join(tmpdir(), "pi-ram-stats-"));
    const model = join(own, "gen.pwri.gguf");
    symlinkSync(gen, model);
    const wrong = join(own, "gen.pwri.activations.gguf");
    const cfg = parseModelConfig(openGgufModel(gen));
    writeActivationStats(wrong, {
      counts: Array.from({ length: cfg.n_layer }, () => new Int32Array(16)),
      nFf: 16,
      tokenCount: 1,
      corpusName: "other",
      corpusSha256: "",
      modelSha256: "",
    });
    const args = ["run", "-m", model, "-p", "hi", "-n", "1", "-t", "1"];
    const mismatch = `does not fit this model (activation statistics are for n_ff 16, this model has n_ff ${cfg.n_ff})`;
    for (const extra of [
      ["--ram-budget", "1"],
      ["--device-backend", "cpu", "--vram-budget", "0.0005"],
    ]) {
      const r = cli([...args, ...extra]);
      expect(r.status, r.stderr).toBe(1);
      expect(r.stderr.trim().split("\n").at(-1)).toBe(
        `powerinfer: activation statistics file ${wrong} (the default of --stats) ${mismatch}: run \`powerinfer profile -m ${model} -f TEXT --force\` to replace it with this model's, or pass --stats with this model's statistics`,
      );
      const given = cli([...args, ...extra, "--stats", wrong]);
      expect(given.status, given.stderr).toBe(1);
      expect(given.stderr.trim().split("\n").at(-1)).toBe(
        `powerinfer: activation statistics file (--stats) ${wrong} ${mismatch}: pass --stats with this model's statistics (\`powerinfer profile -m ${model} -f TEXT\` measures them)`,
      );
    }
    rmSync(own, { recursive: true, force: true });
  });

  it("the CLI under a cgroup v1 memory limit: greedy text equals the unlimited run's", (ctx) => {
    const root = "/sys/fs/cgroup/memory";
    if (process.getuid?.() !== 0) return ctx.skip("needs root to create a memory cgroup");
    if (!existsSync(join(root, "cgroup.procs"))) return ctx.skip(`no cgroup v1 memory controller at ${root}`);
    const group = join(root, `pi-ram-test-${process.pid}`);
    try {
      mkdirSync(group);
    } catch (e) {
      return ctx.skip(`cannot create ${group}: ${(e as Error).message}`);
    }
    try {
      const limit = 384 * 2 ** 20;
      writeFileSync(join(group, "memory.limit_in_bytes"), String(limit));
      const args = ["run", "-m", gen, "-p", "once upon a time", "-n", "24", "--temp", "0", "-t", "2"];
      const free = cli(args);
      expect(free.status, free.stderr).toBe(0);
      const budget = budgetFor(gen, "predictor", 0.3) / 2 ** 30;
      // the child joins the group through a shell that writes its own pid first
      const r = spawnSync(
        "sh",
        [
          "-c",
          `echo $$ > ${join(group, "cgroup.procs")} && exec "$0" "$@"`,
          process.execPath,
          bin,
          ...args,
          "--ram-budget",
          String(budget),
        ],
        { encoding: "utf8", timeout: 300_000 },
      );
      expect(r.status, r.stderr).toBe(0);
      expect(r.stdout).toBe(free.stdout);
      expect(r.stderr).toMatch(/neuron cache over \d+ tokens: .* MiB read per token/);
      const peak = Number(readFileSync(join(group, "memory.max_usage_in_bytes"), "utf8"));
      expect(peak).toBeLessThanOrEqual(limit);
      // the limit the CLI compares with the model's size (its note suggesting --ram-budget)
      const common = join(dirname(bin), "commands", "common.js");
      const probe = spawnSync(
        "sh",
        [
          "-c",
          `echo $$ > ${join(group, "cgroup.procs")} && exec "$0" "$@"`,
          process.execPath,
          "--input-type=module",
          "-e",
          `import { cgroupMemoryLimit } from ${JSON.stringify(common)}; console.log(cgroupMemoryLimit());`,
        ],
        { encoding: "utf8", timeout: 60_000 },
      );
      expect(probe.status, probe.stderr).toBe(0);
      expect(Number(probe.stdout.trim())).toBe(limit);
    } finally {
      rmdirSync(group);
    }
  }, 300_000);
});
