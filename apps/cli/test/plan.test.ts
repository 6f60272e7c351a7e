/** `powerinfer plan`: profile → plan → GPU index reuse, on the shared ReLU model. */
import { spawnSync } from "node:child_process";
import { copyFileSync, mkdtempSync, readFileSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import { readGpuIndex } from "@powerinfer/gguf";
import { describe, expect, it } from "vitest";

const models = process.env.POWERINFER_TEST_MODELS!;
const bin = join(dirname(fileURLToPath(import.meta.url)), "..", "dist", "bin.js");
const relu = join(models, "relu", "tinystories-relu-llama-7m.f32.gguf");
const probe = await cpuBackend.probe();

function cli(...args: string[]) {
  const r = spawnSync(process.execPath, [bin, ...args], { encoding: "utf8", timeout: 300_000 });
  return { code: r.status, stdout: r.stdout, stderr: r.stderr };
}

describe.skipIf(!probe.usable)("powerinfer plan", () => {
  const dir = mkdtempSync(join(tmpdir(), "powerinfer-plan-"));
  // a copy: a plan solved for another budget than a named GPU index holds goes next to the model
  const model = join(dir, "relu.gguf");
  copyFileSync(relu, model);
  const stats = join(dir, "relu.activations.gguf");
  const idx = join(dir, "relu.named.gpuidx");
  const common = ["-m", model, "--stats", stats, "--gpu-index", idx, "--bucket-size", "64"];

  it("solves within the budget, writes a GPU index, reuses it, and solves again on --reset-gpu-index", () => {
    const p = cli(
      "profile",
      "-m",
      model,
      "-f",
      join(models, "relu", "tinystories-relu-llama-7m.eval.txt"),
      "--tokens",
      "3000",
      "-o",
      stats,
      "-c",
      "256",
    );
    expect(p.code, p.stderr).toBe(0);
    const budget = 4 / 1024; // GiB: ~1/6 of the FFN weights
    const first = cli("plan", ...common, "--vram-budget", String(budget), "--json");
    expect(first.code, first.stderr).toBe(0);
    const r1 = JSON.parse(first.stdout);
    expect(r1.reused).toBe(false);
    expect(r1.plan.totalBytes).toBeLessThanOrEqual(budget * 2 ** 30);
    expect(r1.plan.totalBytes).toBeGreaterThan(0.9 * budget * 2 ** 30);
    // hot neurons serve far more than their share of activations (power law)
    const hotFraction = r1.plan.layers.reduce((s: number, L: { hot: number }) => s + L.hot, 0) / (6 * 1024);
    expect(r1.plan.deviceShare).toBeGreaterThan(hotFraction * 1.5);
    const gi = readGpuIndex(idx);
    expect(gi.blockCount).toBe(6);
    expect(gi.layers.map((L) => L.gpuBucket.length)).toEqual(r1.plan.layers.map((L: { hot: number }) => L.hot));

    const again = JSON.parse(cli("plan", ...common, "--vram-budget", String(budget), "--json").stdout);
    expect(again.reused).toBe(true);
    expect(again.plan.deviceShare).toBeCloseTo(r1.plan.deviceShare, 10);
    const other = JSON.parse(cli("plan", ...common, "--vram-budget", String(budget / 2), "--json").stdout);
    expect(other.reused).toBe(false);
    expect(other.plan.totalBytes).toBeLessThanOrEqual((budget / 2) * 2 ** 30);
    const reset = JSON.parse(
      cli("plan", ...common, "--vram-budget", String(budget / 2), "--reset-gpu-index", "--json").stdout,
    );
    expect(reset.reused).toBe(false);

    const text = cli("plan", ...common, "--vram-budget", String(budget));
    expect(text.stdout).toMatch(
      /^placement \(integer program\): .* expected share of activations served by the device/m,
    );
    expect(text.stdout.split("\n").filter((l) => /^\s+\d+ \|/.test(l))).toHaveLength(6);
  });

  it("a plan is solved again when the statistics at the same path changed, or another solver is asked for", () => {
    const m2 = join(dir, "relu2.gguf");
    copyFileSync(relu, m2);
    const text = join(models, "relu", "tinystories-relu-llama-7m.eval.txt");
    const prof = (n: string) => cli("profile", "-m", m2, "-f", text, "--tokens", n, "-c", "256");
    const plan = (...extra: string[]) =>
      JSON.parse(
        cli("plan", "-m", m2, "--bucket-size", "64", "--vram-budget", String(4 / 1024), "--json", ...extra).stdout,
      );
    expect(prof("600").code).toBe(0);
    expect(plan().reused).toBe(false);
    expect(plan().reused).toBe(true);
    expect(prof("900").code).toBe(0); // same path, other counts
    const after = plan();
    expect(after.reused).toBe(false);
    expect(after.notes.join("\n")).toMatch(
      /solved for another budget, backend, solver, statistics \(file or contents\)/,
    );
    expect(plan().reused).toBe(true);
    expect(plan("--solver", "greedy").reused).toBe(false);
    expect(plan("--solver", "greedy").reused).toBe(true);
    expect(plan().reused).toBe(false); // ilp again
  });

  it("a GPU index of ours is used as it is where there are no statistics to solve again from", () => {
    const m3dir = mkdtempSync(join(tmpdir(), "powerinfer-plan-nostats-"));
    const m3 = join(m3dir, "relu3.gguf");
    copyFileSync(relu, m3);
    const keep = join(dir, "relu2.generated.gpuidx"); // solved above for relu2 (the same weights), other stats path
    const r = cli("plan", "-m", m3, "--gpu-index", keep, "--vram-budget", String(4 / 1024), "--json");
    expect(r.code, r.stderr).toBe(0);
    const out = JSON.parse(r.stdout);
    expect(out.reused).toBe(true);
    expect(out.notes.join("\n")).toMatch(
      /as it is: solved for other settings, and there are no statistics at .* to solve again from/,
    );
    expect(out.plan.layers.map((L: { hot: number }) => L.hot)).toEqual(
      readGpuIndex(keep).layers.map((L) => L.gpuBucket.length),
    );
  });

  it("run with the plan (hot neurons on a stand-in device) prints the same greedy text as the CPU alone", () => {
    const args = [
      "run",
      "-m",
      model,
      "-p",
      "once upon a time",
      "-n",
      "24",
      "--temp",
      "0",
      "--sparse",
      "oracle",
      "-c",
      "128",
    ];
    const cpu = cli(...args, "--disable-gpu-index");
    const hybrid = cli(
      ...args,
      "--device-backend",
      "cpu",
      "--vram-budget",
      String(4 / 1024),
      "--stats",
      stats,
      "--gpu-index",
      idx,
      "--bucket-size",
      "64",
      "--kv-type",
      "f32",
    );
    expect(hybrid.code, hybrid.stderr).toBe(0);
    expect(hybrid.stderr).toMatch(/hybrid: \d+ hot neurons .* on cpu/);
    expect(hybrid.stdout).toBe(cpu.stdout);
  });

  it("inspect reports the statistics found next to the model", () => {
    const m = join(dir, "m.gguf");
    copyFileSync(relu, m);
    copyFileSync(stats, join(dir, "m.activations.gguf"));
    const r = cli("inspect", m, "--json");
    expect(r.code, r.stderr).toBe(0);
    const st = JSON.parse(r.stdout).activationStats;
    expect(st.tokens).toBeGreaterThanOrEqual(3000);
    expect(st.layers).toHaveLength(6);
    expect(st.meanActive).toBeGreaterThan(0.03);
    expect(st.meanActive).toBeLessThan(0.15);
    expect(cli("inspect", m).stdout).toMatch(/activations: .* % of FFN neurons fire per token on average/);
  });

  it("refuses statistics of another model and a missing statistics file, naming the problem", () => {
    const wrong = cli(
      "plan",
      "-m",
      join(models, "powerinfer", "tiny-f16.powerinfer.gguf"),
      "--stats",
      stats,
      "--gpu-index",
      join(dir, "x.gpuidx"),
      "--vram-budget",
      "0.001",
    );
    expect(wrong.code).not.toBe(0);
    expect(wrong.stderr).toMatch(/activation statistics are for a model with 6 layers, this model has 2/);
    const missing = cli(
      "plan",
      "-m",
      relu,
      "--stats",
      join(dir, "none.gguf"),
      "--gpu-index",
      join(dir, "y.gpuidx"),
      "--vram-budget",
      "0.001",
    );
    expect(missing.code).not.toBe(0);
    expect(missing.stderr).toMatch(/no activation statistics at .*none\.gguf: run `powerinfer profile/);
    // a file that is not statistics at all: the option and the path are named, the error's class kept
    const notStats = join(dir, "not-stats.txt");
    writeFileSync(notStats, "not statistics\n");
    const bad = cli("plan", "-m", relu, "--stats", notStats, "--gpu-index", join(dir, "z.gpuidx"), "--verbose");
    expect(bad.code).not.toBe(0);
    expect(bad.stderr.trim()).toMatch(
      /^powerinfer: activation statistics file \(--stats\) .*not-stats\.txt at byte 0: expected magic "GGUF" or "PWRI", .* \[GgufError BAD_MAGIC\]$/,
    );
    // the same through the device path of run
    const run = cli(
      "run",
      "-m",
      relu,
      "--stats",
      notStats,
      "--gpu-index",
      join(dir, "r.gpuidx"),
      "--device-backend",
      "cpu",
      "-p",
      "x",
      "-n",
      "1",
    );
    expect(run.code).not.toBe(0);
    expect(run.stderr).toMatch(/^powerinfer: activation statistics file \(--stats\) .*not-stats\.txt at byte 0: /m);
  });

  it("warns, as run does, when -c is beyond the model's trained context", () => {
    const args = ["plan", ...common.slice(0, 4), "--gpu-index", join(dir, "ctx.gpuidx"), "--vram-budget", "0.004"];
    const over = cli(...args, "-c", "100000");
    expect(over.code, over.stderr).toBe(0);
    expect(over.stderr.split("\n")).toContain("warning: n_ctx 100000 is larger than the model's trained context 256");
    expect(over.stdout).toMatch(/n_ctx 100000/);
    // the words a session gives (run)
    const run = cli("run", "-m", relu, "-p", "Once", "-n", "1", "-c", "300");
    expect(run.stderr.split("\n")).toContain("warning: n_ctx 300 is larger than the model's trained context 256");
    const within = cli(...args, "-c", "256");
    expect(within.code, within.stderr).toBe(0);
    expect(within.stderr).not.toMatch(/trained context/);
  });
});

describe.skipIf(!probe.usable)("powerinfer plan: attention + KV cache on the device", () => {
  const dir = mkdtempSync(join(tmpdir(), "powerinfer-plan-attn-"));
  const model = join(dir, "relu.gguf");
  copyFileSync(relu, model);
  const stats = join(dir, "relu.activations.gguf");
  const idx = join(dir, "relu.attn.gpuidx");
  // the 7M ReLU model: 6 layers; attention per layer F32 wq, wo 256², wk, wv 256×128, attn_norm and ffn_norm
  // 256, and an F16 KV cache of 2 · n_ctx · 128 values: at n_ctx 256, 788 480 + 131 072 = 919 552 bytes
  const attention = 919_552;
  const common = ["-m", model, "--stats", stats, "--gpu-index", idx, "--bucket-size", "64", "--device-backend", "cpu"];
  const plan = (...args: string[]) => cli("plan", ...common, ...args);

  it("decides per layer whether attention lives on the device, within one budget with the hot neurons", () => {
    const text = join(models, "relu", "tinystories-relu-llama-7m.eval.txt");
    expect(cli("profile", "-m", model, "-f", text, "--tokens", "1000", "-o", stats, "-c", "256").code).toBe(0);
    const budget = 4 / 1024; // GiB: room for 4 attention layers and a few buckets
    const p = plan("--vram-budget", String(budget), "-c", "256", "--json");
    expect(p.code, p.stderr).toBe(0);
    const r = JSON.parse(p.stdout);
    expect(r.nCtx).toBe(256);
    const att = r.plan.layers.filter((L: { attention: boolean }) => L.attention);
    expect(att).toHaveLength(4);
    for (const L of att) expect(L.attentionBytes).toBe(attention);
    expect(r.plan.attentionBytes).toBe(4 * attention);
    expect(r.plan.totalBytes).toBe(r.plan.attentionBytes + r.plan.neuronBytes);
    expect(r.plan.totalBytes).toBeLessThanOrEqual(budget * 2 ** 30);
    expect(r.plan.gap).toBe(0);
    expect(r.plan.throughput.source).toBe("defaults");
    // expected tokens/s is 1 / Σ (device bytes / D + CPU bytes / C) over the layers
    const t = r.plan.layers.reduce(
      (s: number, L: { readBytes: { device: number; cpu: number } }) =>
        s + L.readBytes.device / 1008e9 + L.readBytes.cpu / 76.8e9,
      0,
    );
    expect(r.plan.expectedTokensPerSecond).toBeCloseTo(1 / t, 6);
    // the output layer (F32 256 × 2048 and its norm) read on the CPU slows it down
    expect(r.expectedTokensPerSecondWithOutput).toBeCloseTo(1 / (t + (256 * 2048 * 4 + 256 * 4) / 76.8e9), 6);
    // the index records which layers: a second plan reuses it as it is; another context size solves again
    const again = JSON.parse(plan("--vram-budget", String(budget), "-c", "256", "--json").stdout);
    expect(again.reused).toBe(true);
    expect(again.plan.layers.map((L: { attention: boolean }) => L.attention)).toEqual(
      r.plan.layers.map((L: { attention: boolean }) => L.attention),
    );
    expect(again.plan.expectedTokensPerSecond).toBeCloseTo(r.plan.expectedTokensPerSecond, 6);
    const longer = JSON.parse(plan("--vram-budget", String(budget), "-c", "512", "--json").stdout);
    expect(longer.reused).toBe(false);
    expect(longer.notes.join("\n")).toMatch(
      /another budget, backend, solver, statistics \(file or contents\), attention sizes or expert ranking \(--sparse\); solving again/,
    );
    expect(longer.plan.layers.find((L: { attention: boolean }) => L.attention).attentionBytes).toBe(
      attention + 2 * 256 * 128 * 2,
    );
  });

  it("--n-gpu-layers forces the last layers' attention, refuses what the budget cannot hold, and measured speeds are named", () => {
    const forced = plan("--vram-budget", String(2 / 1024), "-c", "256", "--n-gpu-layers", "2", "--reset-gpu-index");
    expect(forced.code, forced.stderr).toBe(0);
    expect(forced.stdout).toMatch(/attention of the last 2 layers forced on the device \(--n-gpu-layers\)/);
    const rows = forced.stdout.split("\n").filter((l) => /^\s+\d+ \|/.test(l));
    expect(rows).toHaveLength(6);
    expect(rows.slice(4).every((l) => /^\s+\d+ \|\s+device \|/.test(l))).toBe(true);
    expect(forced.stdout).toMatch(/attention \+ KV cache of \d of 6 layers/);
    expect(forced.stdout).toMatch(
      /expected [0-9.]+ tokens\/s for the layers \(device 1008.0 GB\/s, CPU 76.8 GB\/s: defaults;/,
    );
    expect(forced.stdout).toMatch(
      /with the output layer on the CPU \(2.00 MiB read per token\): expected [0-9.]+ tokens\/s/,
    );
    const tooMany = plan("--vram-budget", String(4 / 1024), "-c", "256", "--n-gpu-layers", "6", "--reset-gpu-index");
    expect(tooMany.code).not.toBe(0);
    expect(tooMany.stderr).toMatch(
      /^powerinfer: --n-gpu-layers 6 needs 5\.26 MiB on cpu \(attention and KV cache for 256 positions\), more than the 4\.00 MiB budget \(--vram-budget\)\n/,
    );
    // as llama.cpp's -ngl 99: more than the model's layers means all of them
    const beyond = plan("--vram-budget", "1", "--n-gpu-layers", "99", "--reset-gpu-index");
    expect(beyond.code, beyond.stderr).toBe(0);
    expect(beyond.stdout).toMatch(/attention of the last 6 layers forced on the device/);
    // llama.cpp's other values (common/arg.cpp): all or ≤ -2 every layer; auto or -1 the default
    for (const v of ["all", "-2"]) {
      const all = plan("--vram-budget", "1", "--n-gpu-layers", v, "--reset-gpu-index");
      expect(all.code, all.stderr).toBe(0);
      expect(all.stdout).toMatch(/attention of the last 6 layers forced on the device/);
    }
    for (const v of ["auto", "-1"]) {
      const auto = plan("--vram-budget", String(2 / 1024), "-c", "256", "--n-gpu-layers", v, "--reset-gpu-index");
      expect(auto.code, auto.stderr).toBe(0);
      expect(auto.stdout).not.toMatch(/forced on the device/);
    }
    const bad = plan("--vram-budget", "1", "--n-gpu-layers", "most");
    expect(bad.code).not.toBe(0);
    expect(bad.stderr).toMatch(
      /--n-gpu-layers must be an integer, auto \(-1: the default\) or all \(<= -2: every layer\), got "most"/,
    );
    const measured = plan("--vram-budget", String(4 / 1024), "-c", "256", "--device-gbps", "500", "--cpu-gbps", "50");
    expect(measured.code, measured.stderr).toBe(0);
    expect(measured.stdout).toMatch(/\(device 500.0 GB\/s, CPU 50.0 GB\/s: measured;/);
    const half = plan("--vram-budget", String(4 / 1024), "--cpu-gbps", "50");
    expect(half.code).not.toBe(0);
    expect(half.stderr).toMatch(/give both --device-gbps and --cpu-gbps/);
  });
});

describe.skipIf(!probe.usable)("GPU indexes the user gave, and budgets that fit nothing", () => {
  const dir = mkdtempSync(join(tmpdir(), "powerinfer-gpuidx-"));
  const tiny = join(dir, "tiny-f16.powerinfer.gguf");
  copyFileSync(join(models, "powerinfer", "tiny-f16.powerinfer.gguf"), tiny);
  const foreign = join(models, "powerinfer", "tiny.generated.gpuidx"); // written by PowerInfer's solver
  const run = ["run", "-m", tiny, "-p", "Once upon a time", "-n", "12", "--temp", "0", "-c", "64", "--kv-type", "f32"];

  it("uses PowerInfer's own GPU index as it is (no statistics needed) and gives the CPU's greedy text", () => {
    const p = cli(
      "plan",
      "-m",
      tiny,
      "--gpu-index",
      foreign,
      "--device-backend",
      "cpu",
      "--vram-budget",
      "1",
      "--json",
    );
    expect(p.code, p.stderr).toBe(0);
    const r = JSON.parse(p.stdout);
    expect(r.reused).toBe(true);
    expect(r.notes.join("\n")).toMatch(/as it is: a GPU index without powerinfer-ts's provenance keys/);
    expect(r.plan.layers.map((L: { hot: number }) => L.hot)).toEqual([512, 256]);
    // PowerInfer's index says nothing of attention: placed by the rule, here both layers (1 GiB holds them)
    expect(r.plan.layers.map((L: { attention: boolean }) => L.attention)).toEqual([true, true]);
    expect(r.notes.join("\n")).toMatch(/attention of 2 layers placed by the rule/);
    const cpu = cli(...run, "--disable-gpu-index");
    const hybrid = cli(...run, "--gpu-index", foreign, "--device-backend", "cpu", "--vram-budget", "1");
    expect(hybrid.code, hybrid.stderr).toBe(0);
    expect(hybrid.stderr).toMatch(/hybrid: 768 hot neurons .* on cpu/);
    expect(hybrid.stdout).toBe(cpu.stdout);
  });

  it("never replaces a GPU index the user named unless --reset-gpu-index says so", () => {
    const mine = join(dir, "mine.gpuidx");
    copyFileSync(foreign, mine);
    const before = readFileSync(mine);
    // a budget the PowerInfer index does not fit: solving again needs statistics
    const stats = join(dir, "tiny.activations.gguf");
    const text = join(models, "relu", "tinystories-relu-llama-7m.eval.txt");
    expect(cli("profile", "-m", tiny, "-f", text, "--tokens", "200", "-o", stats).code).toBe(0);
    const common = ["-m", tiny, "--stats", stats, "--gpu-index", mine, "--device-backend", "cpu"];
    const p = cli("plan", ...common, "--vram-budget", "0.0002", "--bucket-size", "64", "--json");
    expect(p.code, p.stderr).toBe(0);
    const r = JSON.parse(p.stdout);
    expect(r.reused).toBe(false);
    expect(r.notes.join("\n")).toMatch(
      /mine\.gpuidx is kept as it is .* the new plan goes to .*tiny-f16\.powerinfer\.generated\.gpuidx/,
    );
    expect(r.gpuIndexPath).toBe(join(dir, "tiny-f16.powerinfer.generated.gpuidx"));
    expect(readFileSync(mine).equals(before)).toBe(true);
    expect(readGpuIndex(r.gpuIndexPath).layers.map((L) => L.gpuBucket.length)).toEqual(
      r.plan.layers.map((L: { hot: number }) => L.hot),
    );
    const reset = cli(
      "plan",
      ...common,
      "--vram-budget",
      "0.0002",
      "--bucket-size",
      "64",
      "--reset-gpu-index",
      "--json",
    );
    expect(reset.code, reset.stderr).toBe(0);
    expect(JSON.parse(reset.stdout).gpuIndexPath).toBe(mine);
    expect(readFileSync(mine).equals(before)).toBe(false);
  });

  it("a budget that holds no hot neuron runs everything on the CPU, with one note and nothing on the device", () => {
    const stats = join(dir, "zero.activations.gguf");
    const text = join(models, "relu", "tinystories-relu-llama-7m.eval.txt");
    expect(cli("profile", "-m", tiny, "-f", text, "--tokens", "100", "-o", stats).code).toBe(0);
    const cpu = cli(...run, "--disable-gpu-index");
    const zero = cli(
      ...run,
      "--stats",
      stats,
      "--gpu-index",
      join(dir, "zero.gpuidx"),
      "--device-backend",
      "cpu",
      "--vram-budget",
      "0",
    );
    expect(zero.code, zero.stderr).toBe(0);
    expect(zero.stderr).toMatch(/note: the device budget holds no hot neuron: every FFN neuron stays on cpu/);
    expect(zero.stderr).not.toMatch(/hybrid:/);
    expect(zero.stdout).toBe(cpu.stdout);
  });
});
