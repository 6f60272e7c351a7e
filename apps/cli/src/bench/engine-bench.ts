/**
 * `pnpm bench` (apps/cli): the benchmark suite recorded in BENCHMARKS.md.
 *
 * 1. stories260K (pp64/tg64: its context is 128) — per-token host overhead against llama.cpp;
 * 2. generated 7B-shaped slices (`gen-model`: relu-llama, 10 % active neurons, 25 % of neurons giving
 *    80 % of activations), for each weight type a GGUF (llama.cpp and our dense mode run it) and the PWRI
 *    file with the same weights plus predictors (our sparse mode), pp512/tg128. The files are written to
 *    a temporary directory and deleted afterwards;
 * 3. generated slices with routed experts (`--moe`, default smallthinker-4b-a0.6b: 4 layers of the
 *    published shape, a 1024-token vocabulary, gen-model's designed statistics — expert popularity
 *    Zipf-like with exponent 1, 40 % of a chosen ReLU expert's neurons firing per token), one GGUF per
 *    weight type that llama.cpp and our dense experts (`--sparse off`) run, and for ReLU experts a PWRI
 *    file of the same weights with per-expert predictors and neuron-major down stacks that our oracle-
 *    (`--sparse oracle`: the gate decides, up and down read only the firing neurons) and predictor-sparse
 *    experts run, tg128.
 *
 * The llama.cpp peer is the native llama-bench build when there is one (`llama-cpp:build`), else
 * node-llama-cpp's prebuilt binary (slower; rows say which ran).
 *
 * Usage: node dist/bench/engine-bench.js [--layers 2] [--dtypes F16,Q4_0] [-t 2] [-r 5] [--dir DIR]
 *   [--keep] [--no-stories] [--no-synthetic] [--moe PRESETS | --no-moe] [--quick] [--json]
 *   [--llama-cpp-peer auto|native|prebuilt]
 *   [--llama-cpp-dir DIR]
 */
import { mkdtempSync, rmSync } from "node:fs";
import { availableParallelism, tmpdir } from "node:os";
import { join, resolve } from "node:path";
import {
  generateSyntheticModel,
  generateSyntheticMoeModel,
  MOE_SHAPE_PRESETS,
  type MoeShapePreset,
  type SyntheticDType,
  type SyntheticModelReport,
} from "@powerinfer/synthetic";
import { Command } from "commander";
import { intList, peerChoice } from "../commands/bench.js";
import { formatHeader, formatJson, formatMarkdown } from "./format.js";
import { type BenchOptions, type BenchResult, type LlamaCppPeerChoice, runBench } from "./harness.js";

interface SuiteOptions {
  layers: number;
  dtypes: string;
  active: string;
  threads: number[];
  repetitions: number;
  dir: string;
  keep?: boolean;
  stories: boolean;
  synthetic: boolean;
  /** Expert presets to bench ("" or --no-moe: none). */
  moe: string | false;
  quick?: boolean;
  json?: boolean;
  models: string;
  llamaCppPeer: LlamaCppPeerChoice;
  llamaCppDir?: string;
}

async function main(): Promise<void> {
  const repoRoot = resolve(import.meta.dirname, "../../../..");
  const o = new Command("bench")
    .option("--layers <n>", "layers of the generated 7B slices", (v) => Number(v), 2)
    .option("--dtypes <list>", "weight types of the generated slices", "F16,Q4_0")
    .option("--active <list>", "designed fractions of neurons firing per token (e.g. 0.05,0.1,0.25)", "0.1")
    .option("-t, --threads <n,…>", "thread counts", intList("--threads", 1, false), [
      Math.min(2, availableParallelism()),
    ])
    .option("-r, --repetitions <n>", "measured repetitions after one warm-up", (v) => Number(v), 5)
    .option("--dir <dir>", "where to write the generated models (deleted afterwards)", tmpdir())
    .option("--keep", "keep the generated models")
    .option("--no-stories", "skip stories260K")
    .option("--no-synthetic", "skip the generated slices")
    .option("--moe <presets>", "expert presets to bench as 4-layer slices", "smallthinker-4b-a0.6b")
    .option("--no-moe", "skip the expert slices")
    .option("--quick", "1 repetition, pp64/tg16, 1-layer slices (a check, not a measurement)")
    .option("--json", "JSON rows instead of markdown")
    .option("--llama-cpp-peer <which>", "auto, native or prebuilt (see powerinfer bench)", peerChoice, "auto")
    .option("--llama-cpp-dir <dir>", "native llama.cpp build folder")
    .option(
      "--models <dir>",
      "shared test models",
      process.env.POWERINFER_TEST_MODELS ?? join(repoRoot, "../shared/models"),
    )
    // `pnpm --filter @powerinfer/cli bench -- …` hands the script a literal "--" first
    .parse(process.argv.filter((a, i) => !(i === 2 && a === "--")))
    .opts<SuiteOptions>();
  const log = (line: string) => process.stderr.write(`bench: ${line}\n`);
  const reps = o.quick ? 1 : o.repetitions;
  const results: BenchResult[] = [];
  let bandwidth: Record<number, number> | undefined;
  const run = async (opts: Omit<BenchOptions, "log" | "threads" | "repetitions" | "bandwidth">) => {
    const r = await runBench({
      ...opts,
      threads: o.threads,
      repetitions: reps,
      bandwidth,
      log,
      llamaCppPeer: o.llamaCppPeer,
      llamaCppDir: o.llamaCppDir,
    });
    bandwidth = r.bandwidth;
    results.push(r);
  };
  if (o.stories) {
    await run({
      models: [{ path: join(o.models, "stories260K.gguf") }],
      nPrompt: [64],
      nGen: [o.quick ? 16 : 64],
      sparse: "auto",
    });
  }
  const generated: SyntheticModelReport[] = [];
  if (o.synthetic) {
    const dir = mkdtempSync(join(o.dir, "powerinfer-bench-"));
    try {
      const actives = o.active.split(",").map(Number);
      if (actives.some((a) => !(a > 0 && a < 1))) throw new Error(`--active: fractions in (0, 1), got ${o.active}`);
      for (const [dtype, activeFraction] of (o.dtypes.split(",") as SyntheticDType[]).flatMap((d) =>
        actives.map((a) => [d, a] as const),
      )) {
        const base = {
          preset: "7b" as const,
          arch: "relu-llama" as const,
          layers: o.quick ? 1 : o.layers,
          dtype,
          activeFraction,
        };
        const tag = `${base.layers}L-${dtype}-${Math.round(activeFraction * 100)}pct`;
        const gguf = join(dir, `relu-llama-7b-${tag}.gguf`);
        const pwri = join(dir, `relu-llama-7b-${tag}.powerinfer.gguf`);
        for (const [path, format] of [
          [gguf, "GGUF"],
          [pwri, "PWRI"],
        ] as const) {
          log(`generating ${path}`);
          const rep = await generateSyntheticModel(path, { ...base, format }, {});
          log(`generated ${(rep.bytes / 2 ** 30).toFixed(2)} GiB in ${rep.seconds?.toFixed(1)} s`);
          generated.push(rep);
        }
        await run({
          models: [{ path: pwri, twin: gguf }],
          nPrompt: [o.quick ? 64 : 512],
          nGen: [o.quick ? 16 : 128],
          sparse: "auto",
        });
        if (!o.keep) {
          rmSync(gguf, { force: true });
          rmSync(pwri, { force: true });
        }
      }
    } finally {
      if (!o.keep) rmSync(dir, { recursive: true, force: true });
    }
  }
  const moeNotes: string[] = [];
  const moePresets = o.moe ? o.moe.split(",").filter((x) => x) : [];
  for (const name of moePresets) {
    if (!(name in MOE_SHAPE_PRESETS)) throw new Error(`--moe: unknown preset ${name}`);
    const p = MOE_SHAPE_PRESETS[name as MoeShapePreset];
    const dir = mkdtempSync(join(o.dir, "powerinfer-bench-moe-"));
    try {
      for (const dtype of o.dtypes.split(",") as SyntheticDType[]) {
        const layers = 4; // also with --quick: llama-bench crashed here on a 1-layer smallthinker slice
        const path = join(dir, `${name}-${layers}L-${dtype}.gguf`);
        // ReLU experts: the same weights again with per-expert predictors, as a PWRI file whose experts' down
        // projections are stored neuron-major (llama.cpp and our dense rows run `path`)
        const relu = p.arch === "smallthinker";
        const withPred = join(dir, `${name}-${layers}L-${dtype}-predictors.pwri.gguf`);
        log(`generating ${path}${relu ? ` and ${withPred}` : ""}`);
        const t0 = performance.now();
        const gen = (out: string, predictors: boolean) =>
          generateSyntheticMoeModel(out, {
            arch: p.arch,
            shape: p.shape,
            layers,
            dtype,
            vocabSize: 1024,
            seed: 1,
            ...(relu ? { untiedOutput: false, slidingWindow: 4096 } : {}),
            design: {},
            // the sparse rows' file: PowerInfer layout (down stacks neuron-major, read row by row in any type)
            ...(predictors ? { predictors: {}, format: "PWRI" as const } : {}),
          });
        const rep = gen(path, false);
        const pred = relu ? gen(withPred, true).predictors : undefined;
        const secs = (performance.now() - t0) / 1000;
        log(`generated ${(rep.bytes / 2 ** 30).toFixed(2)} GiB in ${secs.toFixed(1)} s`);
        moeNotes.push(
          `- generated: ${name} (${rep.ggufArch}) ${layers}/${p.shape.n_layer} layers ${dtype}, vocabulary 1024, design: expert popularity Zipf-like (exponent 1, an assumption), ${p.arch === "smallthinker" ? "40 % of a chosen expert's neurons fire per token (SmallThinker's report: over 60 % idle), 50 % of them give 80 % of firings" : "SiLU experts"}; ${(rep.bytes / 2 ** 30).toFixed(2)} GiB written in ${secs.toFixed(1)} s`,
        );
        if (pred)
          moeNotes.push(
            `- predictors: per expert (blk.N.fc1_exps/fc2_exps), rank ${pred.rank} ${pred.dtype}, threshold ${pred.threshold.toPrecision(4)} calibrated on the design for recall 0.95 (β² = ${pred.noise} of each gate's variance unseen), in a PWRI file with the experts' down projections neuron-major (ffn_down_exps_t); llama.cpp and our dense rows run the GGUF of the same weights without predictors (equal before quantization: the PWRI file quantizes a down stack along n_embd)`,
          );
        await run({
          models: [relu ? { path: withPred, twin: path } : { path }],
          nPrompt: [],
          nGen: [o.quick ? 16 : 128],
          sparse: relu ? ["off", "oracle", "predictor"] : ["off"],
        });
        if (!o.keep) {
          rmSync(path, { force: true });
          rmSync(withPred, { force: true });
        }
      }
    } finally {
      if (!o.keep) rmSync(dir, { recursive: true, force: true });
    }
  }
  const merged: BenchResult = {
    ...results[0]!,
    machine: {
      ...results[0]!.machine,
      loadAverage: [results[0]!.machine.loadAverage[0], results.at(-1)!.machine.loadAverage[1]],
    },
    rows: results.flatMap((r) => r.rows),
    sparseSummary: results.flatMap((r) => r.sparseSummary),
    notes: [...new Set(results.flatMap((r) => r.notes))],
  };
  if (o.json) {
    process.stdout.write(`${formatJson(merged)}\n`);
    return;
  }
  const args = process.argv.slice(2).filter((a, i) => !(i === 0 && a === "--"));
  const cmd = args.length ? `pnpm --filter @powerinfer/cli bench ${args.join(" ")}` : "pnpm bench";
  process.stdout.write(`${formatHeader(merged, cmd)}\n`);
  for (const g of generated) {
    if (g.format !== "PWRI") continue;
    process.stdout.write(
      `- generated: ${g.arch} ${g.preset} ${g.layers}/${g.shape.n_layer} layers ${g.dtype}, design ${(100 * g.design.activeFraction).toFixed(0)} % active / ${(100 * g.design.hotShare).toFixed(0)} % hot share, predictor rank ${g.predictorRank} ${g.predictorDType}, threshold ${g.threshold?.toFixed(3)} (sampled recall ${g.stats?.recall?.toFixed(3)}, predicted ${(100 * (g.stats?.predictedFraction ?? 0)).toFixed(1)} %); ${(g.bytes / 2 ** 30).toFixed(2)} GiB written in ${g.seconds?.toFixed(1)} s\n`,
    );
  }
  for (const n of moeNotes) process.stdout.write(`${n}\n`);
  process.stdout.write(`\n${formatMarkdown(merged)}\n`);
}

main().catch((e) => {
  process.stderr.write(`bench: ${(e as Error).message}\n`);
  process.exitCode = 1;
});
