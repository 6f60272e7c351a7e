/**
 * `powerinfer gen-model -o FILE [--arch A] [--preset P] [--layers N] [--dtype T] [--format gguf|pwri] …`:
 * writes a synthetic model with the tensor shapes of a real one (7B/13B/40B/70B, or a slice of its
 * layers) and realistic ReLU activation statistics (a power law of per-neuron firing frequencies,
 * predictors that predict firing), and reports those statistics; `--verify N` runs the written model on
 * N random tokens with the CPU backend and measures them again from the engine's activations.
 */
import { existsSync } from "node:fs";
import { Model } from "@powerinfer/engine";
import {
  activeParametersPerToken,
  generateSyntheticModel,
  generateSyntheticMoeModel,
  MIN_SYNTHETIC_VOCAB,
  MOE_SHAPE_PRESETS,
  type MoeShapePreset,
  SHAPE_PRESET_NAMES,
  SHAPE_PRESETS,
  SYNTHETIC_ARCHS,
  SYNTHETIC_DTYPES,
  type ShapePreset,
  type SyntheticArch,
  type SyntheticDType,
  type SyntheticModelOptions,
  type SyntheticModelReport,
} from "@powerinfer/synthetic";
import { dequantize, type GgufFile, getTensor, readTensorBytes } from "@powerinfer/gguf";
import cliProgress from "cli-progress";
import { type Command, InvalidArgumentError } from "commander";
import { loadBackend } from "../backends.js";
import { action } from "../errors.js";
import { checkInputFile, checkOutputPath, float, int, threadsArg } from "./common.js";

export interface GenModelCliOptions {
  output: string;
  arch?: string;
  preset: string;
  layers?: number;
  dtype: string;
  format: string;
  vocabSize: number;
  vocabFrom?: string;
  seed: number;
  /** Default 0.1 (dense presets) or 0.4 (expert presets). */
  active?: number;
  /** Default 0.25 (dense presets) or 0.5 (expert presets). */
  hotShare?: number;
  /** Expert presets: Zipf exponent of expert popularity (default 1). */
  zipf: number;
  /** llama-moe presets: dReLU experts (TurboSparse-Mixtral). */
  drelu?: boolean;
  /** Expert presets with ReLU experts: write per-expert predictors (blk.N.fc1_exps/fc2_exps). */
  predictors?: boolean;
  /** Default 128 (dense presets) or 64 (expert presets). */
  predictorRank?: number;
  predictorDtype?: string;
  predictorNoise: number;
  targetRecall: number;
  threshold?: number;
  statsTokens: number;
  verify?: number;
  threads?: number;
  force?: boolean;
  json?: boolean;
}

function oneOf<T extends string>(name: string, value: string, allowed: readonly T[], map = (s: string) => s): T {
  const v = map(value);
  if (!(allowed as readonly string[]).includes(v)) {
    // shown as typed on the command line (the values are matched without regard to case)
    const shown = name === "format" ? allowed.map((a) => a.toLowerCase()) : allowed;
    throw new InvalidArgumentError(`--${name} must be one of ${shown.join(", ")}, got "${value}"`);
  }
  return v as T;
}

/** CLI options → generator options (validated; the generator checks the combinations). */
export function generatorOptions(o: GenModelCliOptions): SyntheticModelOptions {
  const dtype = oneOf<SyntheticDType>("dtype", o.dtype, SYNTHETIC_DTYPES, (s) =>
    s.toUpperCase().replace("Q4_K_M", "Q4_K"),
  );
  return {
    arch:
      o.arch === undefined ? undefined : oneOf<SyntheticArch>("arch", o.arch, SYNTHETIC_ARCHS, (s) => s.toLowerCase()),
    preset: oneOf<ShapePreset>("preset", o.preset, SHAPE_PRESET_NAMES, (s) => s.toLowerCase()),
    layers: o.layers,
    dtype,
    format: oneOf("format", o.format, ["GGUF", "PWRI"] as const, (s) => s.toUpperCase()),
    vocabSize: o.vocabSize,
    vocabFrom: o.vocabFrom,
    seed: o.seed,
    activeFraction: o.active ?? 0.1,
    hotShare: o.hotShare ?? 0.25,
    predictorRank: o.predictorRank,
    predictorDType:
      o.predictorDtype === undefined
        ? undefined
        : oneOf<SyntheticDType>("predictor-dtype", o.predictorDtype, SYNTHETIC_DTYPES, (s) => s.toUpperCase()),
    predictorNoise: o.predictorNoise,
    targetRecall: o.targetRecall,
    threshold: o.threshold,
    statsTokens: o.statsTokens,
  };
}

/** Activation statistics measured by running the model in the engine. */
export interface VerifyReport {
  tokens: number;
  perLayer: Array<{
    layer: number;
    activeFraction: number;
    /** Share of neurons covering 80 % of the activations counted over the run (a finite-sample estimate). */
    hotShare: number;
    predictedFraction?: number;
    recall?: number;
    precision?: number;
  }>;
  skipped?: string;
}

function layerPredictor(file: GgufFile, l: number) {
  const t1 = getTensor(file, `blk.${l}.fc1.weight`);
  const t2 = getTensor(file, `blk.${l}.fc2.weight`);
  return {
    rank: t1.shape[1]!,
    fc1: dequantize(t1.type, readTensorBytes(file, t1), t1.nElements),
    fc2: dequantize(t2.type, readTensorBytes(file, t2), t2.nElements),
  };
}

function hotShareOf(counts: Float64Array): number {
  const s = Array.from(counts).sort((a, b) => b - a);
  const total = s.reduce((a, b) => a + b, 0);
  let acc = 0;
  for (let k = 0; k < s.length; k++) {
    acc += s[k]!;
    if (acc >= 0.8 * total) return (k + 1) / s.length;
  }
  return 1;
}

/**
 * Runs `path` on `tokens` random token ids (dense FFN, activations captured) and measures, per layer,
 * the active fraction, the hot share and — when the file has predictors — their recall and precision at
 * the file's threshold (logits computed here from the captured FFN inputs and the file's fc1/fc2).
 */
export async function verifyModel(path: string, tokens: number, threads?: number): Promise<VerifyReport> {
  const backend = await loadBackend("auto", { threads }, () => {});
  let model: Model;
  try {
    model = await Model.load(path, { backend, sparse: "off" });
  } catch (e) {
    backend.dispose();
    return { tokens: 0, perLayer: [], skipped: (e as Error).message };
  }
  try {
    const cfg = model.config;
    const E = cfg.n_embd;
    const F = cfg.n_ff;
    const preds = cfg.has_predictors ? cfg.predictor_ranks.map((_, l) => layerPredictor(model.file, l)) : undefined;
    const acc = Array.from({ length: cfg.n_layer }, () => ({
      active: 0,
      predicted: 0,
      tp: 0,
      counts: new Float64Array(F),
    }));
    const session = model.createSession({ nCtx: Math.min(tokens + 1, cfg.n_ctx_train) });
    const n = Math.min(tokens, session.nCtx);
    let seed = 0x9e3779b9;
    for (let t = 0; t < n; t++) {
      seed = (Math.imul(seed ^ (seed >>> 15), 0x2c1b3c6d) + 0x297a2d39) >>> 0;
      const id = 3 + (seed % (cfg.n_vocab - 3));
      session.evaluate([id], {
        onCapture: (layers) => {
          layers.forEach((c, l) => {
            const a = acc[l]!;
            const p = preds?.[l];
            let y: Float64Array | undefined;
            if (p) {
              y = new Float64Array(p.rank);
              for (let k = 0; k < p.rank; k++) {
                let s = 0;
                for (let e = 0; e < E; e++) s += p.fc1[k * E + e]! * c.ffnInput[e]!;
                y[k] = Math.max(0, s);
              }
            }
            for (let i = 0; i < F; i++) {
              const on = c.gate[i]! > 0;
              if (on) {
                a.active++;
                a.counts[i]!++;
              }
              if (p && y) {
                let z = 0;
                for (let k = 0; k < p.rank; k++) z += p.fc2[i * p.rank + k]! * y[k]!;
                if (z >= cfg.sparse_threshold) {
                  a.predicted++;
                  if (on) a.tp++;
                }
              }
            }
          });
        },
      });
    }
    session.dispose();
    return {
      tokens: n,
      perLayer: acc.map((a, l) => ({
        layer: l,
        activeFraction: a.active / (n * F),
        hotShare: hotShareOf(a.counts),
        ...(preds
          ? {
              predictedFraction: a.predicted / (n * F),
              recall: a.active ? a.tp / a.active : 1,
              precision: a.predicted ? a.tp / a.predicted : 1,
            }
          : {}),
      })),
    };
  } finally {
    model.dispose();
    backend.dispose();
  }
}

const pct = (x: number | undefined) => (x === undefined ? "–" : `${(100 * x).toFixed(1)} %`);
const gib = (b: number) => (b >= 2 ** 30 ? `${(b / 2 ** 30).toFixed(2)} GiB` : `${(b / 2 ** 20).toFixed(1)} MiB`);

/** The report as text. */
export function formatGenReport(r: SyntheticModelReport, verify?: VerifyReport): string {
  const lines: string[] = [];
  const slice = r.layers < r.shape.n_layer ? ` (${r.layers} of ${r.shape.n_layer} layers)` : "";
  const rate = r.seconds ? `, ${r.seconds.toFixed(1)} s (${(r.bytes / 2 ** 20 / r.seconds).toFixed(0)} MiB/s)` : "";
  lines.push(
    `wrote ${r.path}: ${gib(r.bytes)}, ${(r.params / 1e6).toFixed(1)} M parameters, ${r.arch} ${r.preset}${slice}, ${r.dtype}, ${r.format}${rate}`,
  );
  lines.push(
    `shape: n_embd ${r.shape.n_embd}, n_ff ${r.shape.n_ff}, n_head ${r.shape.n_head}, n_head_kv ${r.shape.n_head_kv}, n_vocab ${r.n_vocab}; seed ${r.seed}`,
  );
  lines.push(
    `design: ${pct(r.design.activeFraction)} of neurons fire per token, ${pct(r.design.hotShare)} of neurons give 80 % of activations, massive channel ${r.design.massiveChannel} (×${r.design.massive}), predictor noise ${r.design.predictorNoise}`,
  );
  if (r.format === "PWRI") {
    lines.push(`predictors: rank ${r.predictorRank} ${r.predictorDType}, threshold ${r.threshold?.toPrecision(4)}`);
  }
  if (r.stats) {
    lines.push(
      `sampled (${r.statsTokens} token embeddings × ${r.statsNeurons} neurons per layer): active ${pct(r.stats.activeFraction)}` +
        (r.stats.recall !== undefined
          ? `, predicted ${pct(r.stats.predictedFraction)}, recall ${r.stats.recall.toFixed(3)}, precision ${r.stats.precision!.toFixed(3)}`
          : ""),
    );
  }
  if (verify) {
    if (verify.skipped) lines.push(`verify: skipped (${verify.skipped})`);
    else {
      lines.push(`\nmeasured in the engine (${verify.tokens} random tokens, dense FFN, activations captured):\n`);
      lines.push("| layer | active | hot share | predicted | recall | precision |");
      lines.push("| ---: | ---: | ---: | ---: | ---: | ---: |");
      for (const l of verify.perLayer) {
        lines.push(
          `| ${l.layer} | ${pct(l.activeFraction)} | ${pct(l.hotShare)} | ${pct(l.predictedFraction)} | ${l.recall?.toFixed(3) ?? "–"} | ${l.precision?.toFixed(3) ?? "–"} |`,
        );
      }
      lines.push("\n(hot share over a short run underestimates the law's: rare neurons have few or no counts)");
    }
  }
  for (const n of r.notes) lines.push(`note: ${n}`);
  return lines.join("\n");
}

/**
 * A preset with routed experts: the published shape (MOE_SHAPE_PRESETS), seeded weights with designed
 * statistics (generateSyntheticMoeModel's `design`: Zipf-like expert popularity with exponent `--zipf`,
 * default 1; ReLU experts fire `--active` of their neurons per token, default 0.4, with `--hot-share`
 * of them, default 0.5, covering 80 % of firings), a slice of `--layers` layers (default 4).
 */
function genMoe(o: GenModelCliOptions): void {
  const p = MOE_SHAPE_PRESETS[o.preset as MoeShapePreset];
  if (o.arch !== undefined && o.arch !== p.arch) {
    throw new InvalidArgumentError(`--preset ${o.preset} is a ${p.arch} model; --arch ${o.arch} does not fit it`);
  }
  const dtype = oneOf("dtype", o.dtype, SYNTHETIC_DTYPES, (x) => x.toUpperCase());
  const format = oneOf("format", o.format, ["GGUF", "PWRI"] as const, (x) => x.toUpperCase());
  const relu = p.arch === "smallthinker" || !!o.drelu;
  if (format === "PWRI" && !relu) {
    throw new InvalidArgumentError(
      `--format pwri: ${o.preset}'s experts are SiLU, and a PowerInfer (PWRI) file is read as ReLU; write it as GGUF (or with --drelu for mixtral-8x7b)`,
    );
  }
  // a PowerInfer file carries its predictors (as the dense presets' PWRI files do)
  const predictors = o.predictors || format === "PWRI";
  if (existsSync(o.output) && !o.force) throw new InvalidArgumentError(`${o.output} exists (use --force to overwrite)`);
  if (o.predictors && !relu) {
    throw new InvalidArgumentError(
      `--predictors: ${o.preset}'s experts are SiLU (they do not fire sparsely); predictors are written for ReLU experts (smallthinker presets, or mixtral-8x7b with --drelu)`,
    );
  }
  if (o.drelu && p.arch !== "llama-moe") {
    throw new InvalidArgumentError(
      `--drelu: ${o.preset} is a ${p.arch} model; dReLU experts are written for llama-moe presets (mixtral-8x7b)`,
    );
  }
  const layers = o.layers ?? 4;
  const r = generateSyntheticMoeModel(o.output, {
    arch: p.arch,
    shape: p.shape,
    layers,
    dtype,
    vocabSize: o.vocabFrom ? undefined : o.vocabSize,
    vocabFrom: o.vocabFrom,
    seed: o.seed,
    ...(p.arch === "smallthinker" ? { untiedOutput: false, slidingWindow: 4096 } : {}),
    design: {
      zipf: o.zipf,
      active: o.active ?? 0.4,
      hot: o.hotShare ?? 0.5,
      predictorRank: o.predictorRank ?? 64,
      predictorNoise: o.predictorNoise,
    },
    ...(o.drelu ? { upActivation: "relu" as const } : {}),
    format,
    ...(predictors
      ? {
          predictors: {
            dtype:
              o.predictorDtype === undefined
                ? undefined
                : oneOf<SyntheticDType>("predictor-dtype", o.predictorDtype, SYNTHETIC_DTYPES, (x) => x.toUpperCase()),
            targetRecall: o.targetRecall,
            threshold: o.threshold,
          },
        }
      : {}),
  });
  const active = activeParametersPerToken(p.arch, { ...p.shape, n_layer: layers }, r.n_vocab);
  const design = {
    zipf: o.zipf,
    expertActive: p.arch === "smallthinker" || o.drelu ? (o.active ?? 0.4) : null,
    hotShare: o.hotShare ?? 0.5,
  };
  const report = {
    ...r,
    preset: o.preset,
    arch: p.arch,
    shape: p.shape,
    dtype,
    format,
    activeParametersPerToken: active,
    design,
  };
  if (o.json) {
    process.stdout.write(`${JSON.stringify(report, null, 2)}\n`);
    return;
  }
  const s = p.shape;
  process.stdout.write(
    `wrote ${o.output}: ${o.preset} (${r.ggufArch}), ${layers} of ${s.n_layer} layers, ${dtype}, ${format}${format === "PWRI" ? " (experts' down projections neuron-major: ffn_down_exps_t)" : ""}, ${(r.bytes / 2 ** 20).toFixed(1)} MiB of tensors\n` +
      `experts: ${s.n_expert}, ${s.n_expert_used} per token, ${s.n_ff_exp} neurons each; ${active.toLocaleString("en-US")} parameters read per token in this slice\n` +
      (r.predictors
        ? `predictors: per expert, rank ${r.predictors.rank} ${r.predictors.dtype}, threshold ${r.predictors.threshold.toPrecision(4)} (${o.threshold !== undefined ? "given" : `calibrated on the design for recall ${o.targetRecall ?? 0.95}`}), noise ${r.predictors.noise}; llama.cpp cannot read this file\n`
        : "") +
      `design: expert popularity Zipf-like, exponent ${o.zipf}; ${design.expertActive === null ? "SiLU experts (no designed firing)" : `${(design.expertActive * 100).toFixed(0)} % of a chosen expert's ${o.drelu ? "gates fire" : "neurons fire"} per token (power law, hot share ${design.hotShare})${o.drelu ? "; dReLU experts, ReLU(gate)·ReLU(up): about half of those pass ReLU(up) (llama.cpp cannot run this file)" : ""}`}\n`,
  );
}

export function register(program: Command): void {
  program
    .command("gen-model")
    .description(
      "write a synthetic model with the shapes of a real one (7b/13b/40b/70b or a slice of its layers) and realistic ReLU sparsity",
    )
    .requiredOption("-o, --output <file>", "file to write")
    .option("--arch <arch>", `${SYNTHETIC_ARCHS.join(" | ")} (default: falcon for 40b, relu-llama otherwise)`)
    .option(
      "--preset <shape>",
      `${SHAPE_PRESET_NAMES.join(" | ")} | routed experts (shapes from the published configs): ${Object.keys(MOE_SHAPE_PRESETS).join(" | ")}`,
      "7b",
    )
    .option("--layers <n>", "layers to generate (a slice; default: all of the preset's)", int("layers", { min: 1 }))
    .option("--dtype <type>", SYNTHETIC_DTYPES.join(" | "), "F16")
    .option(
      "--format <format>",
      "gguf (llama.cpp) or pwri (PowerInfer: ffn_down_t — expert presets: ffn_down_exps_t —, predictors, threshold)",
      "gguf",
    )
    .option(
      "--vocab-size <n>",
      `size of the synthetic SPM vocabulary (≥ ${MIN_SYNTHETIC_VOCAB})`,
      int("vocab-size", { min: MIN_SYNTHETIC_VOCAB }),
      1024,
    )
    .option("--vocab-from <file>", "copy the vocabulary from this GGUF instead")
    .option("--seed <n>", "seed", int("seed", { min: 0, max: 2 ** 32 - 1 }), 1)
    .option(
      "--active <fraction>",
      "mean fraction of FFN neurons firing per token (default 0.1; expert presets: of a chosen ReLU expert's, 0.4)",
      float("active", { above: 0, below: 1 }),
    )
    .option(
      "--zipf <s>",
      "expert presets: Zipf exponent of expert popularity (router bias −s·ln(rank); an assumption, not measured)",
      float("zipf", { min: 0 }),
      1,
    )
    .option(
      "--drelu",
      "llama-moe presets (mixtral-8x7b): dReLU experts, ReLU(gate)·ReLU(up) as TurboSparse-Mixtral (powerinfer.ffn_up_activation; llama.cpp cannot run it)",
    )
    .option(
      "--hot-share <fraction>",
      "share of neurons that give 80 % of activations (default 0.25; expert presets: 0.5)",
      float("hot-share", { above: 0, below: 1 }),
    )
    .option(
      "--predictor-rank <n>",
      "predictor rank (fc1 {n_embd, r}, fc2 {r, n_ff}; default 128, expert presets 64 — it also sets the rank of the gates' low-rank part)",
      int("predictor-rank", { min: 2 }),
    )
    .option(
      "--predictors",
      "expert presets with ReLU experts: write per-expert predictors (blk.N.fc1_exps {n_embd, r, n_expert}, fc2_exps {r, n_ff_exp, n_expert}) and a threshold calibrated to --target-recall; llama.cpp cannot read such a file (generate it again without --predictors: the weights are the same)",
    )
    .option("--predictor-dtype <type>", "predictor weight type (default: F16, or Q8_0 for quantized weights)")
    .option(
      "--predictor-noise <share>",
      "share of each gate's input-dependent variance the predictor cannot see",
      float("predictor-noise", { min: 0, max: 1 }),
      0.1,
    )
    .option(
      "--target-recall <r>",
      "calibrate the PWRI threshold to this recall",
      float("target-recall", { above: 0, max: 1 }),
      0.95,
    )
    .option("--threshold <x>", "PWRI threshold (instead of calibrating)", float("threshold"))
    .option(
      "--stats-tokens <n>",
      "sampled tokens for the statistics and calibration (0: none)",
      int("stats-tokens", { min: 0 }),
      64,
    )
    .option(
      "--verify <n>",
      "run the written model on N random tokens and measure its activations",
      int("verify", { min: 1 }),
    )
    .option("-t, --threads <n>", "CPU threads for --verify (default, or -1: number of cores)", threadsArg())
    .option("-f, --force", "overwrite the output file")
    .option("--json", "print the report as JSON")
    .action(
      action(async (o: GenModelCliOptions) => {
        checkPresetLayers(o);
        // the vocabulary's source is an input like any other: never the file written, even with --force
        checkOutputPath(o.output, o.vocabFrom);
        if (o.vocabFrom !== undefined) checkInputFile(o.vocabFrom, "vocabulary file (--vocab-from)");
        if (o.preset in MOE_SHAPE_PRESETS) {
          // the predictor and verification options belong to the dense presets' PWRI files
          if (o.verify !== undefined)
            throw new InvalidArgumentError(
              `--verify is for the dense presets (designed statistics checked in the engine); for ${o.preset} run \`powerinfer profile\` on the written model to measure its firing`,
            );
          if (o.threshold !== undefined && !o.predictors && o.format.toLowerCase() !== "pwri")
            throw new InvalidArgumentError(
              `--threshold sets the threshold of the per-expert predictors: give --predictors (or --format pwri) with it`,
            );
          genMoe(o);
          return;
        }
        if (o.predictors)
          throw new InvalidArgumentError(
            `--predictors is for the expert presets; ${o.preset} writes its predictors with --format pwri`,
          );
        if (o.drelu)
          throw new InvalidArgumentError(
            `--drelu: ${o.preset} is a dense preset; dReLU experts are written for llama-moe presets (mixtral-8x7b)`,
          );
        const opts = generatorOptions(o);
        if (existsSync(o.output) && !o.force)
          throw new InvalidArgumentError(`${o.output} exists (use --force to overwrite)`);
        const bar =
          process.stderr.isTTY && !o.json
            ? new cliProgress.SingleBar(
                {
                  format: "writing [{bar}] {percentage}% {value}/{total} MiB",
                  stream: process.stderr,
                  hideCursor: true,
                },
                cliProgress.Presets.shades_classic,
              )
            : undefined;
        const ac = new AbortController();
        const onSig = () => ac.abort();
        process.once("SIGINT", onSig);
        let report: SyntheticModelReport;
        try {
          report = await generateSyntheticModel(o.output, opts, {
            signal: ac.signal,
            onProgress: (w, total) => {
              if (!bar) return;
              if (!bar.getTotal()) bar.start(Math.ceil(total / 2 ** 20), 0);
              bar.update(Math.floor(w / 2 ** 20));
            },
          });
        } finally {
          bar?.stop();
          process.off("SIGINT", onSig);
        }
        let verify: VerifyReport | undefined;
        if (o.verify) verify = await verifyModel(o.output, o.verify, o.threads);
        if (o.json) process.stdout.write(`${JSON.stringify({ ...report, verify }, null, 2)}\n`);
        else process.stdout.write(`${formatGenReport(report, verify)}\n`);
      }),
    );
}

/**
 * The preset is one of all of them (dense and routed-expert), and `--layers` a slice of it: a run past the
 * preset's layers would write a model it does not describe (gigabytes of it). Checked before any work.
 * @throws InvalidArgumentError naming the option, the rule and the value
 */
function checkPresetLayers(o: GenModelCliOptions): void {
  const moe = MOE_SHAPE_PRESETS[o.preset as MoeShapePreset];
  const dense = SHAPE_PRESETS[o.preset.toLowerCase() as ShapePreset];
  if (!moe && !dense) {
    const all = [...SHAPE_PRESET_NAMES, ...Object.keys(MOE_SHAPE_PRESETS)];
    throw new InvalidArgumentError(`--preset must be one of ${all.join(", ")}, got ${o.preset}`);
  }
  const nLayer = moe ? moe.shape.n_layer : dense!.n_layer;
  if (o.layers !== undefined && o.layers > nLayer)
    throw new InvalidArgumentError(
      `--layers must be at most ${nLayer} (the ${o.preset} preset's layers), got ${o.layers}`,
    );
}
