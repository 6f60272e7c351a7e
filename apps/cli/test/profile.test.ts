/** `powerinfer profile` on the shared ReLU model against the statistics its README publishes. */
import { spawnSync } from "node:child_process";
import { existsSync, mkdtempSync, readFileSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import { checkStatsForModel, EngineError } from "@powerinfer/engine";
import { openGguf, parseModelConfig, readActivationStats } from "@powerinfer/gguf";
import { describe, expect, it } from "vitest";

const models = process.env.POWERINFER_TEST_MODELS!;
const bin = join(dirname(fileURLToPath(import.meta.url)), "..", "dist", "bin.js");
const relu = join(models, "relu", "tinystories-relu-llama-7m.f32.gguf");
const text = join(models, "relu", "tinystories-relu-llama-7m.eval.txt");
const probe = await cpuBackend.probe();

function cli(...args: string[]) {
  const r = spawnSync(process.execPath, [bin, ...args], { encoding: "utf8", timeout: 600_000 });
  return { code: r.status, stdout: r.stdout, stderr: r.stderr };
}

describe.skipIf(!probe.usable)("powerinfer profile", () => {
  const dir = mkdtempSync(join(tmpdir(), "powerinfer-profile-"));
  const out = join(dir, "relu.activations.gguf");

  it("measures the README's per-layer active fractions on the whole eval text, and writes readable stats", () => {
    const r = cli("profile", "-m", relu, "-f", text, "-c", "256", "-o", out, "--json");
    expect(r.code, r.stderr).toBe(0);
    const report = JSON.parse(r.stdout);
    const ref = JSON.parse(readFileSync(join(models, "relu", "tinystories-relu-llama-7m.sparsity.json"), "utf8"));
    expect(report.tokens).toBe(ref.tokens); // 422 chunks × 256 positions, BOS included
    ref.layers.forEach((L: { active_fraction_per_token: { mean: number } }, l: number) => {
      const want = L.active_fraction_per_token.mean;
      expect(Math.abs(report.layers[l].mean - want) / want, `layer ${l}`).toBeLessThan(0.1);
    });
    expect(report.expectedSpeedup).toBeGreaterThan(1.5);
    // counts agree with the published per-neuron counts (.npy, int64 [6, 1024]) within 10 % in total per layer
    const stats = readActivationStats(out);
    expect(stats.tokenCount).toBe(ref.tokens);
    expect(stats.corpusName).toBe("tinystories-relu-llama-7m.eval.txt");
    const npy = readFileSync(join(models, "relu", "tinystories-relu-llama-7m.sparsity.neuron_counts.npy"));
    const header = npy.readUInt16LE(8);
    const counts = new BigInt64Array(npy.buffer.slice(npy.byteOffset + 10 + header, npy.byteOffset + npy.length));
    for (let l = 0; l < 6; l++) {
      let ours = 0;
      let theirs = 0;
      for (let i = 0; i < 1024; i++) {
        ours += stats.counts[l]![i]!;
        theirs += Number(counts[l * 1024 + i]!);
      }
      expect(Math.abs(ours - theirs) / theirs).toBeLessThan(0.1);
    }
    const cfg = parseModelConfig(openGguf(relu));
    expect(() => checkStatsForModel(stats, cfg)).not.toThrow();
    // stats from another model are refused, naming the mismatch
    expect(() => checkStatsForModel(stats, { ...cfg, n_ff: 172 })).toThrow(/n_ff 1024, this model has n_ff 172/);
    expect(() => checkStatsForModel(stats, { ...cfg, n_layer: 5 })).toThrow(EngineError);
  }, 600_000);

  it("stops at --tokens positions even below the context size (one short chunk, BOS included)", () => {
    const r = cli("profile", "-m", relu, "-f", text, "--tokens", "100", "-o", join(dir, "short.gguf"), "--json");
    expect(r.code, r.stderr).toBe(0);
    expect(JSON.parse(r.stdout).tokens).toBe(100);
    expect(readActivationStats(join(dir, "short.gguf")).tokenCount).toBe(100);
  });

  it("warns when too few positions were profiled for a placement plan, naming why there were so few", () => {
    expect(cli("profile", "-m", relu, "-f", text, "--tokens", "100", "-o", join(dir, "w100.gguf")).stderr).not.toMatch(
      /warning: only/,
    );
    const limited = cli("profile", "-m", relu, "-f", text, "--tokens", "20", "-o", join(dir, "w20.gguf"));
    expect(limited.code, limited.stderr).toBe(0);
    expect(limited.stderr).toMatch(/^warning: only 20 positions profiled \(--tokens 20\): .* at least 32/m);
    const tiny = join(dir, "tiny.txt");
    writeFileSync(tiny, "Once upon a");
    const short = cli("profile", "-m", relu, "-f", tiny, "-o", join(dir, "w-tiny.gguf"));
    expect(short.code, short.stderr).toBe(0);
    expect(short.stderr).toMatch(/^warning: only \d+ positions profiled \(all that tiny\.txt holds\)/m);
  });

  it("says a sparse mode is ignored (profile runs the FFN dense) and refuses a bundled model, naming what to do instead", () => {
    const sparse = cli(
      "profile",
      "-m",
      relu,
      "-f",
      text,
      "--tokens",
      "8",
      "-o",
      join(dir, "s.gguf"),
      "--sparse",
      "oracle",
    );
    expect(sparse.code, sparse.stderr).toBe(0);
    expect(sparse.stderr).toMatch(/^note: profile runs the FFN densely .*; --sparse oracle is ignored$/m);
    const bundled = join(dir, "tiny.bundle.gguf");
    const fixture = join(models, "powerinfer", "tiny-q4_0.powerinfer.gguf");
    expect(cli("convert", fixture, bundled, "--bundle").code).toBe(0);
    const b = cli("profile", "-m", bundled, "-f", text, "--tokens", "8", "-o", join(dir, "b.gguf"));
    expect(b.code).not.toBe(0);
    expect(b.stderr).toMatch(
      /is a bundled model .*--to pwri` makes one\) and give its statistics to the bundled model with --stats/,
    );
    expect(existsSync(join(dir, "b.gguf"))).toBe(false);
  });

  it("tells a user of a dense SiLU model plainly that sparse inference gains nothing", () => {
    const r = cli(
      "profile",
      "-m",
      join(models, "stories260K.gguf"),
      "-f",
      text,
      "--tokens",
      "100",
      "-o",
      join(dir, "x.gguf"),
    );
    expect(r.code).not.toBe(0);
    expect(r.stderr).toMatch(/uses silu.*a dense model gains nothing from sparse inference/);
  });
});
