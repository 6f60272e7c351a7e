/**
 * Every decoding command with a device: `--device-backend cpu` (a second CPU backend standing in for the
 * device, within `--vram-budget`) against `--disable-gpu-index` (the main backend alone), on copies of the
 * shared ReLU model (profiled here) and the PowerInfer F32 fixture (with its foreign GPU index). run, piped
 * chat, batched -np 1 and -np 4 and the server with 1 and 4 concurrent requests give the same greedy text;
 * perplexity agrees within 1e-5 relative; profile counts are identical.
 */
import { spawn, spawnSync } from "node:child_process";
import { copyFileSync, mkdtempSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { basename, dirname, join } from "node:path";
import { fileURLToPath } from "node:url";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import { readActivationStats, readGpuIndex } from "@powerinfer/gguf";
import { generateSyntheticMoeModel } from "@powerinfer/synthetic";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { TINY_MOE_SHAPE } from "./moe-shape.js";

const models = process.env.POWERINFER_TEST_MODELS!;
const bin = join(dirname(fileURLToPath(import.meta.url)), "..", "dist", "bin.js");
const probe = await cpuBackend.probe();
const dir = mkdtempSync(join(tmpdir(), "powerinfer-hybrid-cli-"));
afterAll(() => rmSync(dir, { recursive: true, force: true }));

function cli(input: string | undefined, ...args: string[]) {
  const r = spawnSync(process.execPath, [bin, ...args], { input, encoding: "utf8", timeout: 300_000 });
  return { code: r.status, stdout: r.stdout, stderr: r.stderr };
}

/** Starts `serve`, sends the prompts at once (temperature 0), returns the texts and the server's stderr. */
async function serve(args: string[], prompts: string[]): Promise<{ texts: string[]; stderr: string }> {
  const child = spawn(process.execPath, [bin, "serve", "--port", "0", "-t", "1", ...args], {
    stdio: ["ignore", "pipe", "pipe"],
  });
  let stderr = "";
  child.stderr.on("data", (d: Buffer) => {
    stderr += d.toString();
  });
  const exited = new Promise<void>((r) => child.on("exit", () => r()));
  try {
    const end = Date.now() + 60_000;
    while (!/ready|error/.test(stderr) && Date.now() < end) await new Promise((r) => setTimeout(r, 20));
    const url = /listening on (http:\/\/127\.0\.0\.1:\d+)/.exec(stderr)?.[1];
    if (!url || !/ready/.test(stderr)) throw new Error(`server did not start: ${stderr}`);
    const texts = await Promise.all(
      prompts.map(async (prompt) => {
        const r = await fetch(`${url}/v1/completions`, {
          method: "POST",
          body: JSON.stringify({ prompt, max_tokens: 12, temperature: 0 }),
        });
        const body = (await r.json()) as { choices?: { text: string }[] };
        if (!body.choices) throw new Error(`${r.status}: ${JSON.stringify(body)}`);
        return body.choices[0]!.text;
      }),
    );
    return { texts, stderr };
  } finally {
    child.kill("SIGTERM");
    await exited;
  }
}

describe.skipIf(!probe.usable)(`every command with a stand-in device (${probe.reason})`, () => {
  const relu = join(dir, "relu.gguf");
  const stats = join(dir, "relu.activations.gguf");
  const fixture = join(dir, "tiny.powerinfer.gguf");
  const text = join(models, "relu", "tinystories-relu-llama-7m.eval.txt");
  const small = join(dir, "small.txt");
  beforeAll(() => {
    writeFileSync(small, readFileSync(text, "utf8").slice(0, 1500));
    copyFileSync(join(models, "relu", "tinystories-relu-llama-7m.f32.gguf"), relu);
    copyFileSync(join(models, "powerinfer", "tiny-f32.powerinfer.gguf"), fixture);
    // PowerInfer's own GPU index of the fixture (no provenance keys of ours): used as it is
    copyFileSync(join(models, "powerinfer", "tiny.generated.gpuidx"), join(dir, "tiny.powerinfer.generated.gpuidx"));
    const p = cli(undefined, "profile", "-m", relu, "-f", text, "--tokens", "600", "-o", stats, "-c", "256");
    expect(p.code, p.stderr).toBe(0);
  }, 300_000);

  // [what, model args, device args]: a budget of 4 MiB holds about a sixth of the ReLU model's FFN
  const setups: [string, () => string[], string[]][] = [
    ["ReLU model, dense", () => ["-m", relu, "--sparse", "off"], ["--vram-budget", String(4 / 1024)]],
    ["ReLU model, oracle", () => ["-m", relu, "--sparse", "oracle"], ["--vram-budget", String(4 / 1024)]],
    [
      "ReLU model, oracle, attention of the last 2 layers (-ngl 2)",
      () => ["-m", relu, "--sparse", "oracle"],
      ["--vram-budget", String(8 / 1024), "-ngl", "2"],
    ],
    ["PowerInfer fixture, predictor, its own GPU index", () => ["-m", fixture], ["--vram-budget", "1"]],
  ];
  for (const [what, model, deviceArgs] of setups) {
    describe(what, () => {
      const dev = () => [...model(), "-t", "1", "--device-backend", "cpu", ...deviceArgs];
      const cpu = () => [...model(), "-t", "1", "--disable-gpu-index"];

      it("run: the same greedy text, and the run says it is hybrid", () => {
        const args = ["-p", "Once upon a time", "-n", "24", "--temp", "0", "-c", "128"];
        const a = cli(undefined, "run", ...cpu(), ...args);
        const b = cli(undefined, "run", ...dev(), ...args);
        expect(a.code, a.stderr).toBe(0);
        expect(b.code, b.stderr).toBe(0);
        expect(b.stderr).toMatch(
          /hybrid: \d+ hot neurons and \d+ attention layers? on cpu \(.* MiB of weights.*\), the rest on cpu/,
        );
        expect(b.stderr).toMatch(/backend calls per step/);
        expect(b.stdout).toBe(a.stdout);
      });

      it("piped chat: the same replies", () => {
        const input = "Tell me a story\nAnd then?\n";
        const args = ["-n", "16", "--temp", "0", "-c", "256"];
        const a = cli(input, "chat", ...cpu(), ...args);
        const b = cli(input, "chat", ...dev(), ...args);
        expect(a.code, a.stderr).toBe(0);
        expect(b.code, b.stderr).toBe(0);
        expect(b.stdout).toBe(a.stdout);
      });

      for (const np of ["1", "4"]) {
        it(`batched -np ${np}: the same sequences`, () => {
          const args = ["-p", "Once upon a time", "-n", "16", "--temp", "0", "-np", np, "-c", "128", "--json"];
          const a = cli(undefined, "batched", ...cpu(), ...args);
          const b = cli(undefined, "batched", ...dev(), ...args);
          expect(a.code, a.stderr).toBe(0);
          expect(b.code, b.stderr).toBe(0);
          const seqs = (s: string) => (JSON.parse(s) as { sequences: { text: string }[] }).sequences.map((q) => q.text);
          expect(seqs(b.stdout)).toEqual(seqs(a.stdout));
        });
      }

      it("perplexity within 1e-5 relative (F32 KV cache); profile counts identical", () => {
        // y_hot + y_cold summed apart differs from one sum by ~1e-7; an F16 KV cache rounds that into whole F16
        // steps of K and V (measured: up to 3.5e-5 relative in perplexity, against 1e-7 with an F32 cache)
        const args = ["-f", small, "-c", "64", "--kv-type", "f32", "--json"];
        const a = cli(undefined, "perplexity", ...cpu(), ...args);
        const b = cli(undefined, "perplexity", ...dev(), ...args);
        expect(a.code, a.stderr).toBe(0);
        expect(b.code, b.stderr).toBe(0);
        const pa = JSON.parse(a.stdout).perplexity as number;
        const pb = JSON.parse(b.stdout).perplexity as number;
        expect(Math.abs(pb - pa) / pa).toBeLessThan(1e-5);
        // per model: statistics of another model file at the same path are not replaced without --force
        const tag = basename(model()[1]!).replace(/\W+/g, "-");
        const oa = join(dir, `a-${tag}.activations.gguf`);
        const ob = join(dir, `b-${tag}.activations.gguf`);
        // profile reads the statistics the device plan was made from, and writes its own elsewhere
        expect(cli(undefined, "profile", ...cpu(), "-f", text, "--tokens", "100", "-c", "64", "-o", oa).code).toBe(0);
        const pr = cli(undefined, "profile", ...dev(), "-f", text, "--tokens", "100", "-c", "64", "-o", ob);
        expect(pr.code, pr.stderr).toBe(0);
        expect(readActivationStats(ob).counts).toEqual(readActivationStats(oa).counts);
      });

      it("serve with 1 and 4 concurrent requests: the same completions", async () => {
        // prompts of 20–40 tokens decoded together: the device gathers their attention outputs in a scratch
        // that the plan sets aside
        const prompts = [
          "Once upon a time, there was a little girl named Lily. She loved to play outside in the sun with her dog.",
          "The cat sat on the mat and looked at the bird in the tree. The bird sang a song.",
          "One day, a little boy went to the park with his mom. They saw a big red ball",
          "Lily and Tom were best friends. They liked to play with blocks and build tall towers together every day.",
        ];
        for (const [np, ps] of [
          ["1", prompts.slice(0, 1)],
          ["4", prompts],
        ] as const) {
          const a = await serve([...cpu(), "-np", np, "-c", String(256 * Number(np))], [...ps]);
          const b = await serve([...dev(), "-np", np, "-c", String(256 * Number(np))], [...ps]);
          expect(b.stderr).toMatch(/hot neurons and \d+ attention layers? on cpu/);
          expect(b.texts).toEqual(a.texts);
        }
      }, 120_000);
    });
  }

  it("bench has hybrid rows beside the CPU rows", () => {
    const r = cli(
      undefined,
      "bench",
      "-m",
      relu,
      "--no-llama-cpp",
      "-p",
      "8",
      "-n",
      "4",
      "-r",
      "1",
      "-t",
      "1",
      "--bandwidth-mib",
      "0",
      "--sparse",
      "oracle",
      "--device-backend",
      "cpu",
      "--vram-budget",
      String(4 / 1024),
      "--json",
      "-q",
    );
    expect(r.code, r.stderr).toBe(0);
    const rows = JSON.parse(r.stdout) as { backend: string; test: string; sparse: string; avg_ts: number }[];
    expect(rows.map((x) => `${x.backend} ${x.sparse} ${x.test}`)).toEqual([
      "CPU oracle pp8",
      "CPU oracle tg4",
      "CPU+cpu oracle pp8",
      "CPU+cpu oracle tg4",
    ]);
    for (const x of rows) expect(x.avg_ts).toBeGreaterThan(0);
  });

  it("never replaces the model, its statistics, a file that is not a GPU index, or PowerInfer's own index", () => {
    const model = join(dir, "guard.gguf");
    const stats = join(dir, "guard.activations.gguf");
    const txt = join(dir, "notes.txt");
    copyFileSync(relu, model);
    copyFileSync(join(dir, "relu.activations.gguf"), stats);
    writeFileSync(txt, "mine\n");
    const before = [model, stats, txt].map((f) => readFileSync(f));
    for (const target of [model, stats, txt]) {
      const r = cli(
        undefined,
        "plan",
        "-m",
        model,
        "--device-backend",
        "cpu",
        "--vram-budget",
        "0.004",
        "--gpu-index",
        target,
        "--reset-gpu-index",
      );
      expect(r.code, r.stderr).toBe(1);
      expect(r.stderr.trim().split("\n")).toHaveLength(1);
      expect(r.stderr).toMatch(
        /is the model file|is the activation statistics file|is not a GPU index \(.*\): neither read nor replaced/,
      );
    }
    [model, stats, txt].forEach((f, i) => {
      expect(readFileSync(f).equals(before[i]!), f).toBe(true);
    });
    // PowerInfer's index beside the model, too large for the budget: kept, the new plan not saved over it
    const pidx = join(dir, "tiny.powerinfer.generated.gpuidx");
    const keep = readFileSync(pidx);
    const fstats = join(dir, "tiny.stats.gguf");
    expect(cli(undefined, "profile", "-m", fixture, "-f", small, "--tokens", "64", "-o", fstats).code).toBe(0);
    const r = cli(
      undefined,
      "run",
      "-m",
      fixture,
      "-t",
      "1",
      "--device-backend",
      "cpu",
      "--vram-budget",
      "0.0002",
      "--stats",
      fstats,
      "-p",
      "Hi",
      "-n",
      "2",
    );
    expect(r.code, r.stderr).toBe(0);
    expect(r.stderr).toMatch(/is kept as it is \(written by PowerInfer\?\)/);
    expect(readFileSync(pidx).equals(keep)).toBe(true);
  });

  it("a budget too small for PowerInfer's index and no statistics: a note and the CPU's text", () => {
    const args = ["-m", fixture, "-t", "1", "-p", "Once upon a time", "-n", "12", "--temp", "0"];
    const cpu = cli(undefined, "run", ...args, "--disable-gpu-index");
    const r = cli(undefined, "run", ...args, "--device-backend", "cpu", "--vram-budget", "0");
    expect(r.code, r.stderr).toBe(0);
    expect(r.stderr).toMatch(/note: no activation statistics .*every FFN neuron stays on cpu/);
    expect(r.stdout).toBe(cpu.stdout);
  });

  it("--n-gpu-layers is exact and capped at the model's layers, as llama.cpp's -ngl", () => {
    const args = ["-m", relu, "-t", "1", "-p", "Once upon a time", "-n", "8", "--temp", "0", "--device-backend", "cpu"];
    const all = cli(undefined, "run", ...args, "-ngl", "99", "--vram-budget", "0.05");
    expect(all.code, all.stderr).toBe(0);
    expect(all.stderr).toMatch(/hot neurons and 6 attention layers on cpu/);
    const none = cli(undefined, "run", ...args, "-ngl", "0", "--vram-budget", "0.004");
    expect(none.code, none.stderr).toBe(0);
    expect(none.stderr).toMatch(/hybrid: \d+ hot neurons and 0 attention layers on cpu/);
    const tight = cli(undefined, "run", ...args, "-ngl", "6", "--vram-budget", "0.001");
    expect(tight.code).toBe(1);
    expect(tight.stderr).toMatch(
      /^powerinfer: --n-gpu-layers 6 needs [\d.]+ MiB on cpu .*more than the [\d.]+ MiB budget \(--vram-budget\)\n/,
    );
  });

  it("serve -np 4 under a tight budget: concurrent requests fit (the device's batch scratch is set aside in the plan)", async () => {
    // before the scratch was set aside, this plan filled the budget and every concurrent request failed with
    // OUT_OF_MEMORY on the device
    const args = ["-m", relu, "-np", "4", "-c", "512", "--device-backend", "cpu", "--vram-budget", "0.004"];
    const prompts = Array.from({ length: 4 }, () => "Hello there, tell me a story about a cat and a dog please");
    const r = await serve(args, prompts);
    expect(r.stderr).toMatch(/ready — 4 slots × 128 tokens, .*attention layers? on cpu/);
    expect(r.texts.every((t) => t.length > 0)).toBe(true);
    expect(new Set(r.texts).size).toBe(1);
  }, 60_000);

  it("plan on a dense model, and an empty --device-backend, are one clear line each", () => {
    const d = cli(undefined, "plan", "-m", join(models, "stories260K.gguf"), "--device-backend", "cpu", "-ngl", "2");
    expect(d.code).toBe(1);
    expect(d.stderr).toMatch(/^powerinfer: this model's FFN is dense \(silu\): there is no hot\/cold neuron plan/);
    const e = cli(undefined, "run", "-m", relu, "--device-backend", "", "-p", "x");
    expect(e.code).toBe(1);
    expect(e.stderr).toMatch(/^powerinfer: --device-backend is empty/);
  });

  it("plan and run on a routed-expert model: (expert, neuron) pairs hottest first, whole experts when dense; the CPU-only text", () => {
    const st = join(dir, "st.gguf");
    const gen = ["gen-model", "--preset", "smallthinker-4b-a0.6b", "--layers", "1", "--vocab-size", "1024"];
    expect(cli(undefined, ...gen, "--predictors", "-o", st).code).toBe(0);
    const text = join(models, "relu", "tinystories-relu-llama-7m.eval.txt");
    expect(cli(undefined, "profile", "-m", st, "-f", text, "--tokens", "128", "-t", "2").code).toBe(0);
    const stats = readActivationStats(join(dir, "st.activations.gguf"));
    const counts = stats.counts[0]!;
    const sel = stats.selections![0]!;
    const nFfExp = stats.nFf;
    const plan = (...extra: string[]) => {
      const r = cli(
        undefined,
        "plan",
        "-m",
        st,
        "--device-backend",
        "cpu",
        "--vram-budget",
        "0.03",
        "--json",
        ...extra,
      );
      expect(r.code, r.stderr).toBe(0);
      return JSON.parse(r.stdout) as {
        gpuIndexPath: string;
        plan: {
          totalBytes: number;
          budgetBytes: number;
          layers: { hot: number; experts: { hotPerExpert: number[]; experts: number; whole: number } }[];
        };
      };
    };
    const hotOf = (path: string) => readGpuIndex(path).layers[0]!.gpuBucket;
    // sparse experts (predictors): the pairs that fire most, wherever their expert
    const sparse = plan();
    const L = sparse.plan.layers[0]!;
    expect(L.hot).toBeGreaterThan(0);
    expect(sparse.plan.totalBytes).toBeLessThanOrEqual(sparse.plan.budgetBytes);
    expect(L.experts.hotPerExpert.reduce((a, b) => a + b, 0)).toBe(L.hot);
    const idx = readGpuIndex(sparse.gpuIndexPath);
    expect(idx.layers[0]!.gpuIdx.length).toBe(nFfExp * sel.length);
    expect(idx.extra?.find((e) => e.key === "powerinfer.plan.expert_count")?.value).toBe(sel.length);
    // inspect names it, with no model lines (FFN layout, hyper-parameters) for a file that is not a model
    const ins = cli(undefined, "inspect", sparse.gpuIndexPath);
    expect(ins.stdout).toMatch(/kind: +PowerInfer GPU index \(neuron placement plan\), for routed experts: 32 experts/);
    expect(ins.stdout).not.toMatch(/FFN layout|hyper-parameters/);
    const hot = new Set(hotOf(sparse.gpuIndexPath));
    const hotMin = Math.min(...[...hot].map((n) => counts[n]!));
    const coldMax = Math.max(...Array.from(counts).filter((_, n) => !hot.has(n)));
    expect(hotMin).toBeGreaterThanOrEqual(coldMax);
    // dense experts (--sparse off read every neuron of a chosen expert): whole experts, most selected first (the
    // budget may cut the last one's buckets)
    const dense = plan("--sparse", "off");
    const D = dense.plan.layers[0]!;
    expect(D.experts.whole).toBeGreaterThan(0);
    expect(D.experts.experts - D.experts.whole).toBeLessThanOrEqual(1);
    const onDevice = D.experts.hotPerExpert.flatMap((h, e) => (h > 0 ? [sel[e]!] : []));
    const offDevice = D.experts.hotPerExpert.flatMap((h, e) => (h === 0 ? [sel[e]!] : []));
    expect(Math.min(...onDevice)).toBeGreaterThanOrEqual(Math.max(...offDevice));
    const t = cli(undefined, "plan", "-m", st, "--device-backend", "cpu", "--vram-budget", "0.03", "--sparse", "off");
    expect(t.stdout).toMatch(/ranked by its expert's selection count/);
    expect(t.stdout).toMatch(
      /experts on device \(whole\) \| routed to them\n +0 \| .* \| +\d+ \/ 32 \(\d+\) \| +[\d.]+ %\n/,
    );
    // run with the plan: hot pairs on the device, the CPU-only run's text, in every sparse mode
    const runArgs = ["run", "-m", st, "-p", "Once upon a time", "-n", "12", "-t", "2", "--temp", "0"];
    for (const sparse of ["predictor", "oracle", "off"]) {
      const alone = cli(undefined, ...runArgs, "--sparse", sparse, "--disable-gpu-index");
      expect(alone.code, alone.stderr).toBe(0);
      const dev = cli(undefined, ...runArgs, "--sparse", sparse, "--device-backend", "cpu", "--vram-budget", "0.03");
      expect(dev.code, dev.stderr).toBe(0);
      expect(dev.stderr).toMatch(/hybrid: \d+ hot \(expert, neuron\) pairs and \d attention layers? on cpu/);
      expect(dev.stdout).toBe(alone.stdout);
    }
    // run -ngl without statistics: the layer's attention moves, its experts stay (said so)
    rmSync(join(dir, "st.activations.gguf"));
    rmSync(join(dir, "st.generated.gpuidx"));
    const g = cli(undefined, "run", "-m", st, "--device-backend", "cpu", "-ngl", "1", "-p", "x", "-n", "1", "-t", "2");
    expect(g.code, g.stderr).toBe(0);
    expect(g.stderr).toMatch(/hybrid: 1 layer's attention \(experts stay on cpu\) on cpu \(.* MiB of weights/);
  }, 180_000);

  it("dense experts (SiLU): profile counts selections, plan puts the most chosen experts whole on the device, run gives the CPU-only text", () => {
    const q = join(dir, "dense-moe.gguf");
    generateSyntheticMoeModel(q, {
      arch: "llama-moe",
      shape: { ...TINY_MOE_SHAPE, n_expert: 16, n_expert_used: 4 },
      design: {},
      vocabSize: 512,
    });
    const text = join(models, "relu", "tinystories-relu-llama-7m.eval.txt");
    const p = cli(undefined, "profile", "-m", q, "-f", text, "--tokens", "256", "-t", "2");
    expect(p.code, p.stderr).toBe(0);
    expect(p.stdout).toMatch(/the experts are dense \(silu\): every neuron of a chosen expert is read/);
    const stats = readActivationStats(join(dir, "dense-moe.activations.gguf"));
    // every pair of an expert counts its expert's selections
    stats.counts.forEach((c, l) => {
      const sel = stats.selections![l]!;
      for (let i = 0; i < c.length; i++) expect(c[i]).toBe(sel[Math.floor(i / stats.nFf)]);
    });
    const plan = cli(undefined, "plan", "-m", q, "--device-backend", "cpu", "--vram-budget", "0.0015", "--json");
    expect(plan.code, plan.stderr).toBe(0);
    const layers = (JSON.parse(plan.stdout) as { plan: { layers: { experts: { hotPerExpert: number[] } }[] } }).plan
      .layers;
    layers.forEach((L, l) => {
      const sel = stats.selections![l]!;
      const on = L.experts.hotPerExpert.flatMap((h, e) => (h > 0 ? [sel[e]!] : []));
      const off = L.experts.hotPerExpert.flatMap((h, e) => (h === 0 ? [sel[e]!] : []));
      expect(on.length).toBeGreaterThan(0);
      expect(Math.min(...on)).toBeGreaterThanOrEqual(Math.max(...off));
    });
    const args = ["run", "-m", q, "-p", "Once upon a time", "-n", "10", "-t", "2", "--temp", "0"];
    const alone = cli(undefined, ...args, "--disable-gpu-index");
    const dev = cli(undefined, ...args, "--device-backend", "cpu", "--vram-budget", "0.0015");
    expect(dev.code, dev.stderr).toBe(0);
    expect(dev.stderr).toMatch(/hybrid: \d+ hot \(expert, neuron\) pairs/);
    expect(dev.stdout).toBe(alone.stdout);
  }, 120_000);

  it("a foreign GPU index is used as it is and never rewritten", () => {
    const idx = join(dir, "tiny.powerinfer.generated.gpuidx");
    const before = readFileSync(idx);
    const r = cli(
      undefined,
      "run",
      "-m",
      fixture,
      "-t",
      "1",
      "--device-backend",
      "cpu",
      "--vram-budget",
      "1",
      "-p",
      "Hi",
      "-n",
      "2",
    );
    expect(r.code, r.stderr).toBe(0);
    expect(r.stderr).toMatch(/as it is: a GPU index without powerinfer-ts's provenance keys/);
    expect(readFileSync(idx).equals(before)).toBe(true);
  });
});
