/** Options and helpers shared by the commands that load a model. */
import { readFileSync } from "node:fs";
import { availableParallelism } from "node:os";
import { type Backend, Model, type SparseMode } from "@powerinfer/core";
import cliProgress from "cli-progress";
import { type Command, InvalidArgumentError } from "commander";
import { loadBackend } from "../backends.js";

export function int(name: string) {
  return (v: string): number => {
    const n = Number(v);
    if (!Number.isInteger(n)) throw new InvalidArgumentError(`${name} must be an integer, got "${v}"`);
    return n;
  };
}

export function float(name: string) {
  return (v: string): number => {
    const n = Number(v);
    if (!Number.isFinite(n)) throw new InvalidArgumentError(`${name} must be a number, got "${v}"`);
    return n;
  };
}

/** Adds -m, -c, -t, --backend, -b. */
export function modelOptions(cmd: Command): Command {
  return cmd
    .requiredOption("-m, --model <file>", "GGUF or PowerInfer GGUF model file")
    .option(
      "-c, --ctx-size <n>",
      "context size in tokens (default: the model's trained context, at most 4096)",
      int("ctx-size"),
    )
    .option("-t, --threads <n>", "CPU threads (default: number of cores)", int("threads"))
    .option("-b, --batch-size <n>", "prompt tokens per graph", int("batch-size"), 512)
    .option("--backend <names>", 'backend: "auto" or a comma-separated list (env POWERINFER_BACKEND overrides)', "auto")
    .option("--kv-type <type>", "KV cache type: f16 or f32", "f16")
    .option("-v, --verbose", "also report every backend skipped and why")
    .option(
      "--sparse <mode>",
      "FFN mode: predictor (default when the model has predictors), oracle (true mask from the gate; testing) or off (dense)",
    )
    .option(
      "--sparse-threshold <x>",
      "predictor threshold (default: the model's powerinfer.sparse_threshold)",
      float("sparse-threshold"),
    );
}

export interface ModelCliOptions {
  model: string;
  ctxSize?: number;
  threads?: number;
  batchSize: number;
  backend: string;
  kvType: string;
  verbose?: boolean;
  sparse?: string;
  sparseThreshold?: number;
}

/** Loads the backend and the model, with a progress bar on a terminal. */
export async function loadModelFromCli(o: ModelCliOptions, quiet = false): Promise<{ backend: Backend; model: Model }> {
  if (o.kvType !== "f16" && o.kvType !== "f32") throw new InvalidArgumentError(`--kv-type must be f16 or f32`);
  if (o.sparse !== undefined && !["predictor", "oracle", "off"].includes(o.sparse)) {
    throw new InvalidArgumentError(`--sparse must be predictor, oracle or off, got "${o.sparse}"`);
  }
  const threads = o.threads ?? availableParallelism();
  if (threads < 1) throw new InvalidArgumentError("--threads must be ≥ 1");
  const backend = await loadBackend(o.backend, { threads }, (line) => {
    if (!quiet && o.verbose) process.stderr.write(`backend skipped: ${line}\n`);
  });
  const bar =
    process.stderr.isTTY && !quiet
      ? new cliProgress.SingleBar(
          { format: "loading [{bar}] {percentage}% {what}", stream: process.stderr, hideCursor: true },
          cliProgress.Presets.shades_classic,
        )
      : undefined;
  bar?.start(100, 0, { what: "" });
  try {
    const model = await Model.load(o.model, {
      backend,
      sparse: o.sparse as SparseMode | undefined,
      threshold: o.sparseThreshold,
      onProgress: (f, what) => bar?.update(Math.round(f * 100), { what }),
    });
    return { backend, model };
  } finally {
    bar?.stop();
  }
}

export function readTextFile(path: string): string {
  return readFileSync(path, "utf8");
}
