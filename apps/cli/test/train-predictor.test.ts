/**
 * `powerinfer train-predictor` end to end on the shared ReLU model: predictors trained on part of
 * eval.txt, judged on the held-out rest (recall, active fraction, the fixed hot-list baseline,
 * perplexity), the PWRI output run in predictor mode, interrupt/resume, and bad input.
 */
import { spawn, spawnSync } from "node:child_process";
import { copyFileSync, existsSync, mkdtempSync, readFileSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import {
  GGMLType,
  type GgufTensorSpec,
  GgufTypes,
  metadataEntries,
  openGguf,
  readTensorBytes,
  writeGguf,
} from "@powerinfer/gguf";
import { gpuEmulatorBackend } from "@powerinfer/backend-cuda";
import { backendMatMul, gateSubspace, jsMatMul, Rng, rewriteModel } from "@powerinfer/predictor";
import { beforeAll, describe, expect, it } from "vitest";

const models = process.env.POWERINFER_TEST_MODELS!;
const bin = join(dirname(fileURLToPath(import.meta.url)), "..", "dist", "bin.js");
const relu = join(models, "relu", "tinystories-relu-llama-7m.f32.gguf");
const evalText = readFileSync(join(models, "relu", "tinystories-relu-llama-7m.eval.txt"), "utf8");
const reference = JSON.parse(readFileSync(join(models, "relu", "tinystories-relu-llama-7m.reference.json"), "utf8"));

function cli(...args: string[]) {
  const r = spawnSync(process.execPath, [bin, ...args], { encoding: "utf8", timeout: 300_000 });
  return { code: r.status, stdout: r.stdout, stderr: r.stderr };
}

function oneLineError(r: { code: number | null; stderr: string }, pattern: RegExp): void {
  expect(r.code).not.toBe(0);
  expect(r.stderr).toMatch(pattern);
  expect(
    r.stderr
      .trim()
      .split("\n")
      .filter((l) => !l.startsWith("(run with --help")),
    r.stderr,
  ).toHaveLength(1);
}

const probe = await cpuBackend.probe();

interface LayerReport {
  layer: number;
  rank: number;
  recall: number;
  precision: number;
  predictedFraction: number;
  trueFraction: number;
  hot: { recall: number; precision: number };
}

describe.skipIf(!probe.usable)("powerinfer train-predictor on the ReLU model", () => {
  const dir = mkdtempSync(join(tmpdir(), "powerinfer-train-"));
  const text = join(dir, "text.txt");
  const heldOut = join(dir, "heldout.txt");
  const out = join(dir, "relu.pwri.gguf");
  let report: { threshold: number; trainingTokens: number; heldOutTokens: number; layers: LayerReport[] };

  beforeAll(() => {
    // 100k characters of the only shipped text: the first 80 % to train on, the last 20 % held out
    writeFileSync(text, evalText.slice(0, 100_000));
    // rank 256 = n_embd: the smallest rank that reaches the targets in every layer of this model ("auto" picks
    // 128–256 per layer; it is exercised in the predictor package's tests). One epoch: the warm start from the
    // gate already does most of the work.
    const r = cli(
      "train-predictor",
      ...["-m", relu, "-f", text, "--holdout", "0.2", "--tokens", "8000", "--rank", "256", "--epochs", "1"],
      ...["-o", out, "--save-holdout", heldOut, "-t", "2", "--json"],
    );
    expect(r.code, r.stderr).toBe(0);
    report = JSON.parse(r.stdout);
  }, 600_000);

  it("reaches mean held-out recall ≥ 0.95 at ≤ 1.5× the true active fraction, and beats the fixed hot list", () => {
    const L = report.layers;
    expect(L).toHaveLength(6);
    expect(report.trainingTokens).toBe(8000);
    expect(report.heldOutTokens).toBeGreaterThan(5000);
    const mean = (f: (l: LayerReport) => number) => L.reduce((s, l) => s + f(l), 0) / L.length;
    expect(mean((l) => l.recall)).toBeGreaterThanOrEqual(0.95);
    expect(mean((l) => l.predictedFraction)).toBeLessThanOrEqual(1.5 * mean((l) => l.trueFraction));
    for (const l of L) {
      expect(l.recall).toBeGreaterThan(0.93);
      expect(l.predictedFraction).toBeLessThanOrEqual(1.6 * l.trueFraction);
      // the same number of neurons as a fixed list of the most frequent ones covers far less
      expect(l.recall).toBeGreaterThan(l.hot.recall + 0.3);
      expect(l.precision).toBeGreaterThan(l.hot.precision);
    }
  });

  it("writes a PWRI file: ffn_down_t, F16 predictors, the threshold, everything else kept", () => {
    const a = openGguf(relu);
    const b = openGguf(out);
    expect(b.format).toBe("PWRI");
    expect(b.metadata.get("powerinfer.sparse_threshold")).toBe(report.threshold);
    for (const [k, v] of a.metadata) expect(b.metadata.get(k)).toEqual(v);
    for (let l = 0; l < 6; l++) {
      expect(b.tensorMap.get(`blk.${l}.ffn_down_t.weight`)?.shape).toEqual([256, 1024]);
      expect(b.tensorMap.get(`blk.${l}.fc1.weight`)?.shape).toEqual([256, 256]);
      expect(b.tensorMap.get(`blk.${l}.fc2.weight`)?.shape).toEqual([256, 1024]);
      expect(b.tensorMap.get(`blk.${l}.fc2.weight`)?.type).toBe(GGMLType.F16);
    }
  });

  it("held-out perplexity with predictors is within +2 % of dense", () => {
    const ppl = (model: string) => {
      const r = cli("perplexity", "-m", model, "-f", heldOut, "-c", "256", "--all-tokens", "--json", "-t", "2");
      expect(r.code, r.stderr).toBe(0);
      return JSON.parse(r.stdout).perplexity as number;
    };
    const dense = ppl(relu);
    const sparse = ppl(out);
    expect(sparse / dense).toBeLessThan(1.02);
    console.info(
      `held-out perplexity: dense ${dense.toFixed(4)}, with predictors ${sparse.toFixed(4)} (${((sparse / dense - 1) * 100).toFixed(2)} %)`,
    );
  }, 300_000);

  it("runs in predictor mode (PWRI, converted to GGUF, and merged into the dense GGUF) with the reference text", () => {
    const ref = reference.greedy[4]; // "once upon a time"
    const run = (model: string) => {
      const r = cli(
        "run",
        "-m",
        model,
        "-p",
        ref.prompt,
        "-n",
        "32",
        "--temp",
        "0",
        "-t",
        "2",
        "--sparse",
        "predictor",
      );
      expect(r.code, r.stderr).toBe(0);
      return r;
    };
    const pw = run(out);
    expect(pw.stdout).toBe(`${ref.prompt}${ref.generated_text}\n`); // PyTorch fp32 greedy, dense
    const m = /sparse: predictor mode, threshold -?1; neurons computed per token: ([\d.]+) %/.exec(pw.stderr);
    expect(m, pw.stderr).not.toBeNull();
    expect(Number(m![1])).toBeLessThan(15); // of n_ff; dense computes 100 %
    // the same predictors in a plain GGUF (ffn_down kept, transposed on load), and merged into the dense file
    const gg = join(dir, "relu.pred.gguf");
    expect(cli("convert", out, gg, "--to", "gguf", "--keep-predictors").code).toBe(0);
    expect(openGguf(gg).tensorMap.has("blk.0.ffn_down.weight")).toBe(true);
    // without --keep-predictors a plain GGUF is llama.cpp's: the predictors are left out, and it says so
    const plain = join(dir, "relu.plain.gguf");
    const conv = cli("convert", out, plain, "--to", "gguf");
    expect(conv.stderr).toMatch(/predictors \(blk\.N\.fc1\/fc2, or the experts. fc1_exps\/fc2_exps\) left out/);
    expect([...openGguf(plain).tensorMap.keys()].filter((n) => /\.fc[12]\./.test(n))).toEqual([]);
    expect(run(gg).stdout).toBe(pw.stdout);
    const merged = join(dir, "relu.merged.gguf");
    expect(cli("convert", relu, merged, "--predictors", out).code).toBe(0);
    expect(run(merged).stdout).toBe(pw.stdout);
  }, 300_000);

  describe("bad input: one line naming the problem", () => {
    it("predictor shapes that do not fit n_ff / n_embd (the engine refuses the file)", () => {
      const src = openGguf(out);
      const bad = join(dir, "bad-shape.gguf");
      const tensors: GgufTensorSpec[] = src.tensors.map((t) =>
        t.name === "blk.2.fc2.weight"
          ? { name: t.name, type: t.type, shape: [256, 992], data: readTensorBytes(src, t).subarray(0, 256 * 992 * 2) }
          : { name: t.name, type: t.type, shape: [...t.shape], data: () => readTensorBytes(src, t) },
      );
      writeGguf(bad, { format: "PWRI", metadata: src, tensors });
      oneLineError(
        cli("run", "-m", bad, "-p", "x", "-n", "1"),
        /blk\.2\.fc2\.weight.*predictor shapes .* do not fit n_embd 256, n_ff 1024/,
      );
      oneLineError(
        cli("convert", relu, join(dir, "x.gguf"), "--predictors", bad),
        /does not fit n_embd 256, n_ff 1024/,
      );
    });

    it("a threshold that is not a number, on the command line or in the file", () => {
      oneLineError(
        cli("run", "-m", out, "-p", "x", "--sparse-threshold", "abc"),
        /sparse-threshold must be a number in \[-3\.4e\+38, 3\.4e\+38\], got "abc"/,
      );
      const nan = join(dir, "nan.gguf");
      rewriteModel(out, nan, {
        metadata: [{ key: "powerinfer.sparse_threshold", type: GgufTypes.f32, value: Number.NaN }],
      });
      oneLineError(
        cli("run", "-m", nan, "-p", "x", "-n", "1"),
        /"powerinfer.sparse_threshold" must be a finite number, found NaN/,
      );
      oneLineError(
        cli("train-predictor", "-m", relu, "-f", text, "-o", join(dir, "y.gguf"), "--target-recall", "high"),
        /target-recall must be a number/,
      );
    });

    it("bad options and models without a ReLU FFN", () => {
      const t = ["-f", text, "-o", join(dir, "z.gguf")];
      oneLineError(cli("train-predictor", "-m", relu, ...t, "--rank", "7"), /--rank must be "auto", an even integer/);
      oneLineError(
        cli("train-predictor", "-m", relu, ...t, "--rank", "1024"),
        /--rank 1024 is larger than 2·min\(n_embd, n_ff\) = 512/,
      );
      oneLineError(
        cli("train-predictor", "-m", relu, ...t, "--target-recall", "1.5"),
        /--target-recall must be a number in \(0, 1\], got 1\.5/,
      );
      oneLineError(cli("train-predictor", "-m", relu, ...t, "--format", "onnx"), /--format must be pwri or gguf/);
      oneLineError(cli("train-predictor", "-m", join(models, "stories260K.gguf"), ...t), /FFN uses silu, not ReLU/);
      expect(existsSync(join(dir, "z.gguf"))).toBe(false);
    });

    it("a device backend that cannot load is refused before the model is read", () => {
      const t = ["-f", text, "-o", join(dir, "d.gguf")];
      oneLineError(cli("train-predictor", "-m", relu, ...t, "--device-backend", "nosuch"), /nosuch: not registered/);
      expect(existsSync(join(dir, "d.gguf"))).toBe(false);
    });

    it("an output in a missing folder, or a folder as the output, is refused before any work", () => {
      const base = ["-m", relu, "-f", text];
      oneLineError(
        cli("train-predictor", ...base, "-o", join(dir, "no-such-folder", "x.gguf")),
        /output .*x\.gguf: the folder .*no-such-folder does not exist/,
      );
      oneLineError(cli("train-predictor", ...base, "-o", dir), /output .* is a folder; give a file name/);
    });

    it("never overwrites an input or a foreign file with --save-holdout or the checkpoint (even with --restart)", () => {
      const precious = join(dir, "precious.txt");
      writeFileSync(precious, "keep me");
      const modelCopy = join(dir, "model-copy.gguf");
      copyFileSync(relu, modelCopy);
      const before = readFileSync(modelCopy);
      const base = ["-m", modelCopy, "-f", text, "-o", join(dir, "never.gguf")];
      oneLineError(
        cli("train-predictor", ...base, "--save-holdout", text),
        /output .* is also an input; choose another path/,
      );
      oneLineError(cli("train-predictor", ...base, "--save-holdout", modelCopy), /is also an input/);
      oneLineError(
        cli("train-predictor", ...base, "--save-holdout", precious),
        /precious\.txt exists \(use --force to overwrite\)/,
      );
      oneLineError(cli("train-predictor", ...base, "--checkpoint", modelCopy, "--restart"), /is also an input/);
      oneLineError(cli("train-predictor", ...base, "--checkpoint", text, "--restart"), /is also an input/);
      oneLineError(
        cli("train-predictor", ...base, "--checkpoint", precious, "--restart"),
        /checkpoint path .*precious\.txt exists and is not a training checkpoint: it is never replaced/,
      );
      expect(readFileSync(precious, "utf8")).toBe("keep me");
      expect(readFileSync(modelCopy).equals(before)).toBe(true);
      expect(readFileSync(text, "utf8").length).toBeGreaterThan(1000);
    });
  });

  it("says which backend computes the predictors' products (--device-backend names one)", () => {
    const r = cli(
      "train-predictor",
      ...["-m", relu, "-f", text, "--tokens", "300", "--eval-tokens", "100", "--rank", "32", "--epochs", "1"],
      ...["-o", join(dir, "dev.gguf"), "-t", "2", "--device-backend", "cpu"],
    );
    expect(r.code, r.stderr).toBe(0);
    expect(r.stderr).toMatch(/^predictor products on cpu \(/m);
  }, 300_000);
});

const emu = gpuEmulatorBackend.probe() as { usable: boolean; reason?: string };
// The trainer's products run on a GPU backend when there is one (--device-backend auto); the emulator runs
// the same GPU kernels on the CPU, so the GPU path of the trainer is checked here without a GPU.
describe.skipIf(!emu.usable)("trainer products on a GPU backend (kernels under the SIMT emulator)", () => {
  it("gemmNT on the GPU backend equals float64, and so does the gate warm start", async () => {
    const b = await gpuEmulatorBackend.load({ emuWarpSize: 32 });
    try {
      const mm = backendMatMul(b);
      const rng = new Rng(3);
      for (const [m, n, k] of [
        [5, 7, 33],
        [17, 9, 64],
      ] as const) {
        const a = Float32Array.from({ length: m * k }, () => rng.normal());
        const w = Float32Array.from({ length: n * k }, () => rng.normal());
        const c = mm.gemmNT(a, w, m, n, k);
        for (let i = 0; i < m; i++) {
          for (let j = 0; j < n; j++) {
            let r = 0;
            for (let p = 0; p < k; p++) r += a[i * k + p]! * w[j * k + p]!;
            expect(Math.abs(c[i * n + j]! - r)).toBeLessThan(1e-4 * Math.sqrt(k));
          }
        }
      }
      // the warm start's subspace on the GPU backend equals the one computed in JavaScript
      const e = 16;
      const f = 24;
      const n = 40;
      const gate = Float32Array.from({ length: f * e }, () => rng.normal());
      const x = Float32Array.from({ length: n * e }, () => rng.normal());
      const gpu = gateSubspace(gate, undefined, x, n, e, f, 4, mm, 1, 6);
      const js = gateSubspace(gate, undefined, x, n, e, f, 4, jsMatMul, 1, 6);
      expect(gpu.k).toBe(js.k);
      for (let i = 0; i < js.values.length; i++)
        expect(Math.abs(gpu.values[i]! - js.values[i]!)).toBeLessThan(1e-4 * js.values[i]!);
    } finally {
      b.dispose();
    }
  }, 120_000);
});

describe.skipIf(!probe.usable)("train-predictor: Ctrl-C saves a checkpoint, the same command resumes", () => {
  it("interrupt, refuse another run's checkpoint, resume to the end", async () => {
    const dir = mkdtempSync(join(tmpdir(), "powerinfer-resume-"));
    const text = join(dir, "t.txt");
    writeFileSync(text, evalText.slice(0, 8_000));
    const out = join(dir, "o.gguf");
    const args = [
      "train-predictor",
      "-m",
      relu,
      "-f",
      text,
      "--holdout",
      "0.3",
      "--rank",
      "32",
      "--epochs",
      "3",
      "-t",
      "2",
      "-o",
      out,
    ];
    const child = spawn(process.execPath, [bin, ...args], { stdio: ["ignore", "pipe", "pipe"] });
    let stderr = "";
    let sent = false;
    child.stderr.on("data", (d: Buffer) => {
      stderr += d.toString();
      if (!sent && /epoch 1:/.test(stderr)) {
        sent = true;
        child.kill("SIGINT");
      }
    });
    const code = await new Promise<number | null>((res) => child.on("close", res));
    expect(code, stderr).toBe(130);
    expect(stderr).toMatch(/progress saved to .*o\.gguf\.ckpt; run the same command again to resume/);
    expect(existsSync(`${out}.ckpt`)).toBe(true);
    expect(existsSync(out)).toBe(false);

    oneLineError(cli(...args, "--seed", "2"), /checkpoint .*o\.gguf\.ckpt is from another run .* --restart/);

    const r = cli(...args);
    expect(r.code, r.stderr).toBe(0);
    expect(r.stderr).toMatch(/resuming from .*o\.gguf\.ckpt: \d layers done/);
    expect(existsSync(`${out}.ckpt`)).toBe(false);
    expect(openGguf(out).tensorMap.get("blk.5.fc1.weight")?.shape).toEqual([256, 32]);
    expect(metadataEntries(openGguf(out)).some((e) => e.key === "powerinfer.predictor.training_tokens")).toBe(true);
  }, 300_000);
});
