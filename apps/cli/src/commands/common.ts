/** Options and helpers shared by the commands that load a model. */
import { readFileSync, statSync } from "node:fs";
import { resolve } from "node:path";
import { availableParallelism } from "node:os";
import { type Backend, type GenerateOptions, Model, type SparseMode } from "@powerinfer/core";
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

/**
 * Checks the options {@link loadModelFromCli} takes, before anything is loaded.
 * @throws InvalidArgumentError naming the option.
 */
export function checkModelOptions(o: Omit<ModelCliOptions, "model">): void {
  if (o.kvType !== "f16" && o.kvType !== "f32")
    throw new InvalidArgumentError(`--kv-type must be f16 or f32, got "${o.kvType}"`);
  if (o.sparse !== undefined && !["predictor", "oracle", "off"].includes(o.sparse)) {
    throw new InvalidArgumentError(`--sparse must be predictor, oracle or off, got "${o.sparse}"`);
  }
  if (!(o.batchSize >= 1)) throw new InvalidArgumentError(`--batch-size must be ≥ 1, got ${o.batchSize}`);
  if (o.threads !== undefined && o.threads < 1)
    throw new InvalidArgumentError(`--threads must be ≥ 1, got ${o.threads}`);
  if (o.ctxSize !== undefined && o.ctxSize < 1)
    throw new InvalidArgumentError(`--ctx-size must be ≥ 1, got ${o.ctxSize}`);
}

/** Loads the backend and the model, with a progress bar on a terminal. */
export async function loadModelFromCli(o: ModelCliOptions, quiet = false): Promise<{ backend: Backend; model: Model }> {
  checkModelOptions(o);
  const threads = o.threads ?? availableParallelism();
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

/** Text files up to 1 GiB; a device, a directory or a larger file is refused with a clear message. */
export function readTextFile(path: string): string {
  let st: ReturnType<typeof statSync>;
  try {
    st = statSync(path);
  } catch (e) {
    const code = (e as NodeJS.ErrnoException).code;
    throw new InvalidArgumentError(
      code === "ENOENT" ? `text file ${path} does not exist` : `cannot read text file ${path} (${code ?? String(e)})`,
    );
  }
  if (!st.isFile()) throw new InvalidArgumentError(`${path} is not a regular file`);
  if (st.size > 2 ** 30) throw new InvalidArgumentError(`${path} is ${st.size} bytes; text files up to 1 GiB are read`);
  return readFileSync(path, "utf8");
}

/** Refuses an output path that is one of the inputs (the input would be lost). */
export function checkOutputPath(out: string, ...inputs: (string | undefined)[]): void {
  for (const i of inputs) {
    if (i && resolve(i) === resolve(out))
      throw new InvalidArgumentError(`output ${out} is also an input; choose another path`);
  }
}

/** Sampling options as llama.cpp names them (`--temp`, `--top-k`, …) with its defaults. */
export interface SamplingCliOptions {
  temp: number;
  topK: number;
  topP: number;
  minP: number;
  repeatPenalty: number;
  repeatLastN: number;
  presencePenalty: number;
  frequencyPenalty: number;
  seed?: number;
  ignoreEos?: boolean;
  stop?: string[];
}

/** Adds the sampling options; `seedHelp` describes -s for the command. */
export function samplingOptions(cmd: Command, seedHelp = "RNG seed (default: random)"): Command {
  return cmd
    .option("--temp <t>", "temperature (0 = greedy)", float("temp"), 0.8)
    .option("--top-k <k>", "top-k sampling (0 = off)", int("top-k"), 40)
    .option("--top-p <p>", "top-p sampling (1 = off)", float("top-p"), 0.95)
    .option("--min-p <p>", "min-p sampling (0 = off)", float("min-p"), 0.05)
    .option("--repeat-penalty <x>", "repetition penalty (1 = off)", float("repeat-penalty"), 1)
    .option("--repeat-last-n <n>", "tokens the penalties look back over", int("repeat-last-n"), 64)
    .option("--presence-penalty <x>", "presence penalty", float("presence-penalty"), 0)
    .option("--frequency-penalty <x>", "frequency penalty", float("frequency-penalty"), 0)
    .option("-s, --seed <n>", `${seedHelp}; -1 = random`, int("seed"))
    .option("--ignore-eos", "keep generating after end of text")
    .option("--stop <text...>", "stop strings");
}

/** The engine's generation options from the CLI's sampling options. */
export function generateOptionsFromCli(o: SamplingCliOptions): GenerateOptions {
  return {
    temperature: o.temp,
    topK: o.topK,
    topP: o.topP,
    minP: o.minP,
    repeatPenalty: o.repeatPenalty,
    penaltyLastN: o.repeatLastN,
    presencePenalty: o.presencePenalty,
    frequencyPenalty: o.frequencyPenalty,
    seed: o.seed === -1 ? undefined : o.seed, // llama.cpp: -1 = random
    ignoreEos: o.ignoreEos,
    stop: o.stop,
  };
}
