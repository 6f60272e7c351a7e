/**
 * `powerinfer train-predictor`: trains per-layer activation predictors for a ReLU model on a text,
 * reports their quality on a held-out part of it beside a fixed hot-neuron list, and writes the model
 * with predictors (PowerInfer GGUF by default). Ctrl-C saves a checkpoint; the same command resumes.
 */
import { createHash } from "node:crypto";
import { availableParallelism } from "node:os";
import { existsSync, rmSync, writeFileSync } from "node:fs";
import { modelFingerprint, openGguf, parseModelConfig } from "@powerinfer/gguf";
import { GgufTypes } from "@powerinfer/gguf";
import {
  activationCounts,
  backendMatMul,
  bakeThresholds,
  CHECKPOINT_ARCH,
  checkpointKey,
  collectActivations,
  collectExpertActivations,
  evaluateExpertPredictors,
  evaluatePredictors,
  type ExpertActivationDataset,
  type ExpertPredictorResult,
  type ExpertLayerReport,
  type LayerReport,
  loadCheckpoint,
  loadExpertCheckpoint,
  type PipelineEvent,
  type PredictorTrainingOptions,
  pipelineDefaults,
  rewriteModelFile,
  saveCheckpoint,
  saveExpertCheckpoint,
  splitText,
  summarizeReport,
  trainExpertPredictors,
  trainPredictors,
} from "@powerinfer/predictor";
import type { Model } from "@powerinfer/engine";
import type { Backend } from "@powerinfer/core";
import cliProgress from "cli-progress";
import { type Command, InvalidArgumentError } from "commander";
import { loadDeviceBackend } from "../backends.js";
import { action } from "../errors.js";
import {
  checkInputFile,
  checkOutputPath,
  refuseOverwrite,
  choice,
  float,
  int,
  loadModelFromCli,
  MMAP_HELP,
  REPACK_HELP,
  readTextFile,
  threadsArg,
} from "./common.js";

interface TrainPredictorCliOptions {
  model: string;
  file: string;
  output: string;
  force?: boolean;
  holdout: number;
  rank: ReturnType<typeof parseRank>;
  targetRecall: number;
  maxActiveRatio: number;
  tokens?: number;
  evalTokens?: number;
  epochs: number;
  lr: number;
  posWeight: number;
  batch: number;
  seed: number;
  init: string;
  /** Default pwri, gguf for routed experts. */
  format?: string;
  predictorType: string;
  checkpoint?: string;
  restart?: boolean;
  saveHoldout?: string;
  ctxSize?: number;
  threads?: number;
  backend: string;
  deviceBackend: string;
  verbose?: boolean;
  json?: boolean;
}

function parseRank(v: string): number | number[] | "auto" {
  if (v === "auto") return "auto";
  const parts = v.split(",").map((s) => Number(s.trim()));
  if (parts.some((n) => !Number.isInteger(n) || n < 2 || n % 2 !== 0)) {
    throw new InvalidArgumentError(
      `--rank must be "auto", an even integer ≥ 2, or one per layer separated by commas; got "${v}"`,
    );
  }
  return parts.length === 1 ? parts[0]! : parts;
}

const pct = (v: number) => `${(v * 100).toFixed(1)}%`;

function reportTable(layers: LayerReport[]): string {
  const head =
    "layer  rank  recall  precision  predicted  true    ratio | hot list: recall  precision | predictor cost";
  const rows = layers.map(
    (r) =>
      `${String(r.layer).padStart(5)}  ${String(r.rank).padStart(4)}  ${r.recall.toFixed(4)}  ${r.precision.toFixed(4).padStart(9)}  ${pct(r.predictedFraction).padStart(9)}  ${pct(r.trueFraction).padStart(6)}  ${(r.predictedFraction / r.trueFraction).toFixed(2).padStart(5)} |           ${r.hot.recall.toFixed(4)}  ${r.hot.precision.toFixed(4).padStart(9)} | ${pct(r.predictorCost).padStart(6)} of the dense FFN`,
  );
  return [head, ...rows].join("\n");
}

export function register(program: Command): void {
  program
    .command("train-predictor")
    .description("train activation predictors for a ReLU model and write it with them (PowerInfer GGUF)")
    .requiredOption("-m, --model <file>", "GGUF or PowerInfer GGUF model with a ReLU FFN")
    .requiredOption("-f, --file <file>", "text to train on (its last --holdout part is kept for the report)")
    .requiredOption("-o, --output <file>", "output model file")
    .option(
      "--holdout <fraction>",
      "share of the text (at a line break) held out for the report; 0 = none",
      float("holdout", { min: 0, below: 1 }),
      0.2,
    )
    .option(
      "--rank <r>",
      'predictor rank: "auto", an even number, or one per layer (comma-separated)',
      parseRank,
      "auto" as ReturnType<typeof parseRank>,
    )
    .option(
      "--target-recall <x>",
      "recall each layer's threshold is calibrated for",
      float("target-recall", { above: 0, max: 1 }),
      0.95,
    )
    .option(
      "--max-active-ratio <x>",
      '"auto" rank: smallest rank selecting at most this × the truly active neurons',
      float("max-active-ratio", { min: 1 }),
      1.5,
    )
    .option(
      "--tokens <n>",
      "train on at most this many token positions of the training part",
      int("tokens", { min: 2 }),
    )
    .option(
      "--eval-tokens <n>",
      "report on at most this many token positions of the held-out part (default: --tokens when given, else all)",
      int("eval-tokens", { min: 1 }),
    )
    .option("--epochs <n>", "maximum epochs per layer (early stopping may end sooner)", int("epochs", { min: 0 }), 8)
    .option("--lr <x>", "AdamW peak learning rate", float("lr", { above: 0 }), 1e-3)
    .option(
      "--pos-weight <x>",
      "weight of the firing neurons in the cross-entropy (recall over precision)",
      float("pos-weight", { above: 0 }),
      3,
    )
    .option("--batch <n>", "samples per training step", int("batch", { min: 1 }), 256)
    .option("--seed <n>", "seed of the shuffles and random starts", int("seed"), 1)
    .option(
      "--init <kind>",
      "starting weights: gate (low-rank approximation of the FFN gate; random for the directions it lacks) or random",
      choice("init", ["gate", "random"]),
      "gate",
    )
    .option(
      "--format <fmt>",
      "output container: pwri (PowerInfer GGUF, ffn_down transposed; the default) or gguf (the default, and the only one, for routed experts)",
      choice("format", ["pwri", "gguf"]),
    )
    .option("--predictor-type <t>", "storage of fc1/fc2: f16 or f32", choice("predictor-type", ["f16", "f32"]), "f16")
    .option("--checkpoint <file>", "checkpoint file (default: <output>.ckpt); resumed when it matches this run")
    .option("--restart", "ignore an existing checkpoint")
    .option("--save-holdout <file>", "write the held-out text to this file (e.g. for powerinfer perplexity)")
    .option(
      "-c, --ctx-size <n>",
      "tokens per evaluation window (default: the model's context, at most 1024)",
      int("ctx-size", { min: 1 }),
    )
    .option("-t, --threads <n>", "CPU threads (default, or -1: number of cores)", threadsArg())
    .option("--backend <names>", 'backend: "auto" or a comma-separated list (env POWERINFER_BACKEND overrides)', "auto")
    .option("--no-repack", REPACK_HELP)
    .option("--mmap", MMAP_HELP)
    .option(
      "--device-backend <name>",
      "backend for the predictors' matrix products (forward and backward passes): \"auto\" = a usable GPU backend, else the model's backend; or a backend name",
      "auto",
    )
    .option("--json", "print the report as JSON on stdout")
    .option("--force", "replace the output file (and the --save-holdout file) if it exists")
    .action(action(trainPredictorCommand));
}

async function trainPredictorCommand(o: TrainPredictorCliOptions): Promise<void> {
  checkOutputPath(o.output, o.model, o.file);
  refuseOverwrite(o.output, o.force);
  // the other files this command writes (and the checkpoint, deletes): never an input, never a file that is not
  // theirs unless --force says so (the held-out text) — a checkpoint path holding anything but a checkpoint is
  // refused even with --restart
  const ckptPath = o.checkpoint ?? `${o.output}.ckpt`;
  checkOutputPath(ckptPath, o.model, o.file, o.output, o.saveHoldout);
  if (existsSync(ckptPath) && !isTrainingCheckpoint(ckptPath)) {
    throw new InvalidArgumentError(
      `checkpoint path ${ckptPath} exists and is not a training checkpoint: it is never replaced; choose another --checkpoint`,
    );
  }
  if (o.saveHoldout) {
    checkOutputPath(o.saveHoldout, o.model, o.file, o.output);
    refuseOverwrite(o.saveHoldout, o.force);
  }
  // options first: a typo must not cost a model load
  // every option's own rule was checked by its parser (see common.ts); the rank against the model below
  const rank = o.rank;
  // the model's header (cheap) decides the ReLU and rank checks before the text is read or the model loaded
  checkInputFile(o.model);
  const cfg = parseModelConfig(openGguf(o.model));
  // routed experts: GGUF only (a PWRI file cannot hold experts), one rank for every expert of a layer
  const format = o.format ?? (cfg.moe ? "gguf" : "pwri");
  if (cfg.moe && format === "pwri") {
    throw new InvalidArgumentError(
      `--format pwri: ${o.model} has routed experts, which PowerInfer files cannot hold; its per-expert predictors are written as GGUF`,
    );
  }
  if (cfg.moe && Array.isArray(rank)) {
    throw new InvalidArgumentError("--rank: one rank for routed experts (every expert of every layer)");
  }
  if (cfg.ffn.activation !== "relu") {
    throw new Error(
      `${o.model}: the FFN uses ${cfg.ffn.activation}, not ReLU — its neurons are rarely exactly zero, so there is nothing to predict`,
    );
  }
  const maxRank = 2 * Math.min(cfg.n_embd, cfg.moe ? cfg.moe.n_ff_exp : cfg.n_ff);
  if (rank !== "auto") {
    const ranks = typeof rank === "number" ? [rank] : rank;
    if (Array.isArray(rank) && rank.length !== cfg.n_layer) {
      throw new InvalidArgumentError(`--rank lists ${rank.length} ranks, the model has ${cfg.n_layer} layers`);
    }
    const bad = ranks.find((r) => r > maxRank);
    if (bad !== undefined) {
      throw new InvalidArgumentError(
        `--rank ${bad} is larger than 2·min(n_embd, n_ff) = ${maxRank}, where a predictor is as costly as the FFN it saves`,
      );
    }
  }
  const quiet = !!o.json;
  const log = (s: string) => {
    if (!quiet) process.stderr.write(`${s}\n`);
  };

  const text = readTextFile(o.file);
  const split = o.holdout > 0 ? splitText(text, o.holdout) : { train: text, heldOut: "", splitAt: text.length };
  if (o.saveHoldout) writeFileSync(o.saveHoldout, split.heldOut);
  // the predictors' products on a GPU where there is one (a named backend that cannot load fails here,
  // before the model is read); the model itself runs on `backend`
  const device: Backend | undefined = await loadDeviceBackend(
    o.deviceBackend,
    { threads: o.threads ?? availableParallelism() },
    (line) => {
      if (o.verbose) log(`device backend skipped: ${line}`);
    },
  );
  let loaded: Awaited<ReturnType<typeof loadModelFromCli>>;
  try {
    loaded = await loadModelFromCli(
      { ...o, sparse: "off", batchSize: 512, kvType: "f16" } as Parameters<typeof loadModelFromCli>[0],
      quiet,
    );
  } catch (e) {
    device?.dispose();
    throw e;
  }
  const { backend, model } = loaded;
  const ac = new AbortController();
  let interrupts = 0;
  const onSigint = () => {
    interrupts++;
    if (interrupts > 1) process.exit(130);
    log("\ninterrupt: saving a checkpoint (Ctrl-C again to quit at once)");
    ac.abort();
  };
  process.on("SIGINT", onSigint);
  try {
    const cfg = model.config;
    const tok = model.tokenizer;
    // with --tokens, only as much text as that many positions can need (64 characters a token: generous)
    const trainText = o.tokens !== undefined ? split.train.slice(0, o.tokens * 64) : split.train;
    const trainIds = tok.tokenize(trainText, { addSpecial: false });
    const options: PredictorTrainingOptions = {
      rank,
      targetRecall: o.targetRecall,
      maxActiveRatio: o.maxActiveRatio,
      init: o.init as "gate" | "random",
      predictorType: o.predictorType as "f16" | "f32",
      train: {
        epochs: o.epochs,
        lr: o.lr,
        posWeight: o.posWeight,
        batchSize: o.batch,
        seed: o.seed,
        targetRecall: o.targetRecall,
      },
    };
    if (cfg.moe) {
      await trainExperts(o, {
        model,
        backend,
        device,
        trainIds,
        corpus: createHash("sha256").update(split.train).digest("hex"),
        heldOut: split.heldOut,
        options,
        signal: ac.signal,
        log,
      });
      return;
    }
    const key = checkpointKey({
      model: modelFingerprint(model.file),
      corpus: createHash("sha256").update(split.train).digest("hex"),
      tokens: trainIds.length,
      options: { ...pipelineDefaults(options), maxTokens: o.tokens ?? null, nCtx: o.ctxSize ?? null },
    });
    let resume: ReturnType<typeof loadCheckpoint> | undefined;
    if (existsSync(ckptPath) && !o.restart) {
      try {
        resume = loadCheckpoint(ckptPath);
      } catch (e) {
        throw new Error(
          `checkpoint ${ckptPath} cannot be resumed here (${(e as Error).message}); pass --restart to discard it`,
        );
      }
      if (resume.key !== key) {
        throw new Error(
          `checkpoint ${ckptPath} is from another run (different model, text or options); pass --restart to discard it`,
        );
      }
      log(
        `resuming from ${ckptPath}: ${resume.done.length} layers done${resume.current ? `, layer ${resume.current.layer} at epoch ${resume.current.state.epoch + 1} step ${resume.current.state.step}` : ""}`,
      );
    }

    const bar =
      process.stderr.isTTY && !quiet
        ? new cliProgress.SingleBar(
            {
              format: "{what} [{bar}] {percentage}% {info}",
              stream: process.stderr,
              hideCursor: true,
              clearOnComplete: true,
            },
            cliProgress.Presets.shades_classic,
          )
        : undefined;
    bar?.start(1, 0, { what: "collecting activations", info: "" });
    const t0 = performance.now();
    let data: Awaited<ReturnType<typeof collectActivations>>;
    try {
      data = await collectActivations(model, trainIds, {
        nCtx: o.ctxSize,
        maxTokens: o.tokens,
        signal: ac.signal,
        onProgress: (d, n) => {
          bar?.setTotal(n);
          bar?.update(d, { info: `${d}/${n} tokens` });
        },
      });
    } catch (e) {
      if (!ac.signal.aborted) throw e;
      bar?.stop();
      process.stderr.write("interrupted while collecting activations (nothing to save yet)\n");
      process.exitCode = 130;
      return;
    }
    bar?.stop();
    log(
      `collected ${data.nTokens} token positions from the training part (${split.train.length} characters) in ${((performance.now() - t0) / 1000).toFixed(1)} s`,
    );

    const mm = backendMatMul(device ?? backend);
    log(`predictor products on ${device ? deviceLabel(device) : deviceLabel(backend)}`);
    let layerInfo = "";
    const onEvent = (e: PipelineEvent) => {
      switch (e.type) {
        case "layer-start":
          // layers counted from 0, as in the report table and the tensor names (blk.N)
          layerInfo = `layer ${e.layer} (of 0–${e.nLayer - 1})`;
          break;
        case "note":
          bar?.stop();
          log(`note: ${e.message}`);
          break;
        case "candidate":
          if (e.candidate.skipped)
            log(
              `${layerInfo}: rank ${e.candidate.rank} skipped (warm start selects ${e.candidate.initRatio.toFixed(2)}× the active neurons)`,
            );
          break;
        case "train-start":
          bar?.start(Math.max(1, e.epochs * e.stepsPerEpoch), 0, {
            what: `${layerInfo} rank ${e.rank}`,
            info: "",
          });
          break;
        case "step":
          bar?.update(e.epoch * e.stepsPerEpoch + e.step, {
            info: `epoch ${e.epoch + 1} loss ${e.loss.toFixed(4)}`,
          });
          break;
        case "epoch": {
          const r = e.report;
          const line = `${layerInfo} rank ${e.rank} epoch ${r.epoch + 1}: loss ${r.loss.toFixed(4)}, validation recall ${r.recall.toFixed(4)} precision ${r.precision.toFixed(3)}, active ${pct(r.predictedFraction)} (true ${pct(r.trueFraction)})`;
          if (bar)
            bar.update({
              info: `loss ${r.loss.toFixed(4)} recall ${r.recall.toFixed(4)} active ${pct(r.predictedFraction)}`,
            });
          else log(line);
          break;
        }
        case "layer-done": {
          bar?.stop();
          const r = e.result;
          log(
            `${layerInfo}: rank ${r.rank}, threshold ${r.threshold.toPrecision(4)}, validation recall ${r.val.recall.toFixed(4)} precision ${r.val.precision.toFixed(3)}, active ${pct(r.val.predictedFraction)} (true ${pct(r.val.trueFraction)})`,
          );
          break;
        }
      }
    };
    const t1 = performance.now();
    const res = await trainPredictors({
      file: model.file,
      data,
      mm,
      options,
      key,
      resume,
      signal: ac.signal,
      onEvent,
      onCheckpoint: (c) => saveCheckpoint(ckptPath, c),
    });
    bar?.stop();
    if (!res.complete) {
      process.stderr.write(`interrupted: progress saved to ${ckptPath}; run the same command again to resume\n`);
      process.exitCode = 130;
      return;
    }
    log(`trained in ${((performance.now() - t1) / 1000).toFixed(1)} s`);

    const f16 = o.predictorType === "f16";
    const baked = bakeThresholds(res.layers, f16);
    for (const l of baked.inexact) {
      log(
        `note: layer ${l}'s threshold has the other sign than the others; it runs at a slightly lower one (more neurons)`,
      );
    }
    const written = rewriteModelFile(model.file, o.output, {
      format: format === "pwri" ? "PWRI" : "GGUF",
      predictors: { layers: baked.predictors, type: o.predictorType as "f16" | "f32", threshold: baked.threshold },
      metadata: provenance(o, data.nTokens),
    });
    for (const n of written.notes) log(`note: ${n}`);
    log(
      `wrote ${o.output} (${written.format}, ${written.tensors} tensors, sparse threshold ${baked.threshold}: each layer's calibrated threshold is folded into its fc2 scale, so one file threshold serves them all)`,
    );
    rmSync(ckptPath, { force: true });

    let report: LayerReport[] = [];
    if (split.heldOut.length > 0) {
      const evalTokens = o.evalTokens ?? o.tokens;
      const heldIds = tok.tokenize(evalTokens !== undefined ? split.heldOut.slice(0, evalTokens * 64) : split.heldOut, {
        addSpecial: false,
      });
      log(`held-out report: running ${evalTokens !== undefined ? `at most ${evalTokens}` : "all"} held-out positions`);
      const held = await collectActivations(model, heldIds, { nCtx: o.ctxSize, maxTokens: evalTokens });
      report = evaluatePredictors({
        predictors: baked.predictors,
        threshold: baked.threshold,
        data: held,
        trainCounts: activationCounts(data),
        mm,
        f16Activations: f16,
        ffnMatrices: cfg.ffn.gated ? 3 : 2,
      });
      const s = summarizeReport(report);
      if (!quiet) {
        process.stdout.write(
          `held-out report (${held.nTokens} token positions, text disjoint from training):\n${reportTable(report)}\n` +
            `mean: recall ${s.recall.toFixed(4)}, precision ${s.precision.toFixed(4)}, predicted ${pct(s.predictedFraction)} vs true ${pct(s.trueFraction)} active; fixed hot list of the same size: recall ${s.hotRecall.toFixed(4)}\n`,
        );
        const worse = report.filter((r) => r.recall <= r.hot.recall);
        if (worse.length) {
          process.stdout.write(
            `warning: layers ${worse.map((r) => r.layer).join(", ")} do no better than the fixed hot list\n`,
          );
        }
      }
      if (o.json) {
        process.stdout.write(
          `${JSON.stringify(
            {
              output: o.output,
              format: written.format,
              threshold: baked.threshold,
              trainingTokens: data.nTokens,
              heldOutTokens: held.nTokens,
              layers: report,
              mean: s,
              training: res.layers.map((r) => ({
                layer: r.layer,
                rank: r.rank,
                threshold: r.threshold,
                scale: baked.scales[r.layer],
                val: r.val,
                epochs: r.history.length,
                candidates: r.candidates,
              })),
            },
            null,
            2,
          )}\n`,
        );
      }
    } else if (o.json) {
      process.stdout.write(
        `${JSON.stringify({ output: o.output, format: written.format, threshold: baked.threshold, layers: [] })}\n`,
      );
    }
  } finally {
    process.off("SIGINT", onSigint);
    model.dispose();
    device?.dispose();
    backend.dispose();
  }
}

/** Metadata recording how the predictors were trained. */
function provenance(o: TrainPredictorCliOptions, tokens: number) {
  return [
    { key: "powerinfer.predictor.trainer", type: GgufTypes.string, value: "powerinfer-ts train-predictor" },
    { key: "powerinfer.predictor.target_recall", type: GgufTypes.f32, value: o.targetRecall },
    { key: "powerinfer.predictor.training_tokens", type: GgufTypes.u32, value: tokens },
  ];
}

/** Whether `path` is a predictor training checkpoint (of a dense or an expert run). */
function isTrainingCheckpoint(path: string): boolean {
  try {
    return openGguf(path).metadata.get("general.architecture") === CHECKPOINT_ARCH;
  } catch {
    return false;
  }
}

/** Expert predictors default to this rank when --rank is "auto" (the generator's design rank). */
const EXPERT_RANK = 64;

/**
 * train-predictor on a model with routed ReLU experts: collects (FFN input, firing mask) pairs per
 * (layer, expert), trains one predictor per expert (packages/predictor experts.ts; resumable by expert: the
 * checkpoint holds the experts finished, saved after each layer, every 30 s and on Ctrl-C), writes the model
 * as GGUF with blk.N.fc1_exps/fc2_exps and reports held-out recall per layer.
 */
async function trainExperts(
  o: TrainPredictorCliOptions,
  c: {
    model: Model;
    backend: Backend;
    device?: Backend;
    trainIds: number[];
    /** SHA-256 of the training text (the checkpoint's key). */
    corpus: string;
    heldOut: string;
    options: PredictorTrainingOptions;
    signal: AbortSignal;
    log: (s: string) => void;
  },
): Promise<void> {
  const { model, log } = c;
  const moe = model.config.moe!;
  const rank = typeof o.rank === "number" ? o.rank : EXPERT_RANK;
  if (o.rank === "auto")
    log(`routed experts: rank ${rank} for every expert ("auto" chooses per layer only for dense FFNs)`);
  // resumable by expert: a checkpoint holds the experts finished, for this model, text and options only
  const key = checkpointKey({
    model: modelFingerprint(model.file),
    corpus: c.corpus,
    tokens: c.trainIds.length,
    options: {
      experts: true,
      ...pipelineDefaults({ ...c.options, rank }),
      maxTokens: o.tokens ?? null,
      nCtx: o.ctxSize ?? null,
    },
  });
  const ckptPath = o.checkpoint ?? `${o.output}.ckpt`;
  let resume: ExpertPredictorResult[] | undefined;
  if (existsSync(ckptPath) && !o.restart) {
    let ck: ReturnType<typeof loadExpertCheckpoint>;
    try {
      ck = loadExpertCheckpoint(ckptPath);
    } catch (e) {
      throw new Error(
        `checkpoint ${ckptPath} cannot be resumed here (${(e as Error).message}); pass --restart to discard it`,
      );
    }
    if (ck.key !== key) {
      throw new Error(
        `checkpoint ${ckptPath} is from another run (different model, text or options); pass --restart to discard it`,
      );
    }
    resume = ck.done;
    log(`resuming from ${ckptPath}: ${resume.length} of ${moe.n_expert * model.config.n_layer} experts done`);
  }
  const t0 = performance.now();
  let data: ExpertActivationDataset;
  try {
    data = await collectExpertActivations(model, c.trainIds, {
      nCtx: o.ctxSize,
      maxTokens: o.tokens,
      signal: c.signal,
    });
  } catch (e) {
    if (!c.signal.aborted) throw e;
    process.stderr.write("interrupted while collecting activations (nothing to save yet)\n");
    process.exitCode = 130;
    return;
  }
  const pairs = data.nTokens * moe.n_expert_used;
  log(
    `collected ${data.nTokens} token positions (${pairs} routed pairs per layer, ${moe.n_expert} experts) in ${((performance.now() - t0) / 1000).toFixed(1)} s`,
  );
  const mm = backendMatMul(c.device ?? c.backend);
  const t1 = performance.now();
  let finished: readonly ExpertPredictorResult[] = resume ?? [];
  let saved = performance.now();
  const save = () => {
    saveExpertCheckpoint(ckptPath, { key, done: [...finished] });
    saved = performance.now();
  };
  const res = await trainExpertPredictors({
    file: model.file,
    data,
    mm,
    options: { ...c.options, rank },
    signal: c.signal,
    resume,
    onExpert: (l, e, n) => {
      if (o.verbose) log(`layer ${l} expert ${e}: ${n} pairs`);
    },
    // a checkpoint after each layer and at most every 30 s (each save writes every finished expert)
    onExpertDone: (r, done) => {
      finished = done;
      if (r.expert === moe.n_expert - 1 || performance.now() - saved > 30_000) save();
    },
  });
  if (!res.complete) {
    save();
    process.stderr.write(
      `interrupted: ${finished.length} experts saved to ${ckptPath}; run the same command again to resume\n`,
    );
    process.exitCode = 130;
    return;
  }
  const f16 = o.predictorType === "f16";
  const flat = res.experts.flat();
  const baked = bakeThresholds(flat, f16);
  const zero = flat.filter((r) => r.val === undefined).length;
  log(
    `trained ${flat.length - zero} expert predictors${resume ? ` (${resume.length} experts from the checkpoint)` : ""} in ${((performance.now() - t1) / 1000).toFixed(1)} s${zero ? `; ${zero} experts had fewer than 32 routed pairs and compute every neuron (zero predictor)` : ""}`,
  );
  const byLayer = res.experts.map((layer, l) => layer.map((_, e) => baked.predictors[l * moe.n_expert + e]!));
  const written = rewriteModelFile(model.file, o.output, {
    format: "GGUF",
    expertPredictors: { layers: byLayer, type: o.predictorType as "f16" | "f32", threshold: baked.threshold },
    metadata: provenance(o, data.nTokens),
  });
  rmSync(ckptPath, { force: true });
  for (const n of written.notes) log(`note: ${n}`);
  log(
    `wrote ${o.output} (GGUF, ${written.tensors} tensors, per-expert predictors rank ${rank}, sparse threshold ${baked.threshold}; llama.cpp cannot read it)`,
  );
  let report: ExpertLayerReport[] = [];
  if (c.heldOut.length > 0) {
    const evalTokens = o.evalTokens ?? o.tokens;
    const heldIds = model.tokenizer.tokenize(
      evalTokens !== undefined ? c.heldOut.slice(0, evalTokens * 64) : c.heldOut,
      {
        addSpecial: false,
      },
    );
    log(`held-out report: running ${evalTokens !== undefined ? `at most ${evalTokens}` : "all"} held-out positions`);
    const held = await collectExpertActivations(model, heldIds, { nCtx: o.ctxSize, maxTokens: evalTokens });
    report = evaluateExpertPredictors(byLayer, baked.threshold, held, mm, f16);
    if (!o.json) {
      const rows = report.map(
        (r) =>
          `${String(r.layer).padStart(5)} | ${r.pairs} | ${r.recall.toFixed(4)} | ${r.precision.toFixed(3)} | ${pct(r.predictedFraction)} | ${pct(r.trueFraction)} | ${r.zeroExperts}`,
      );
      process.stdout.write(
        `held-out report (${held.nTokens} token positions, text disjoint from training; pairs = routed (token, expert) pairs):\n` +
          `layer | pairs | recall | precision | predicted | true active | experts computed densely\n${rows.join("\n")}\n`,
      );
    }
  }
  if (o.json) {
    process.stdout.write(
      `${JSON.stringify(
        {
          output: o.output,
          format: "GGUF",
          threshold: baked.threshold,
          rank,
          trainingTokens: data.nTokens,
          layers: report,
          training: flat.map((r, i) => ({
            layer: r.layer,
            expert: r.expert,
            samples: r.samples,
            threshold: r.threshold,
            scale: baked.scales[i],
            val: r.val ?? null,
          })),
        },
        null,
        2,
      )}\n`,
    );
  }
}

/** "cuda (NVIDIA H200)": the backend and its first device, for the log line. */
function deviceLabel(b: Backend): string {
  const d = b.devices[0];
  return d ? `${b.name} (${d.name})` : b.name;
}
