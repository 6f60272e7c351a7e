/**
 * `powerinfer gguf-split [options] IN OUT_PREFIX`: split a model into shards
 * `OUT_PREFIX-0000i-of-0000N.gguf` (llama.cpp's gguf-split layout), or `--merge` the shards of a split
 * model (from its first shard) into one file.
 */
import { rmSync } from "node:fs";
import { basename, dirname, join } from "node:path";
import {
  type GgufFile,
  mergeGgufSplit,
  openGguf,
  openGgufModel,
  planGgufSplit,
  splitPath,
  writeGgufSplit,
} from "@powerinfer/gguf";
import { type Command, InvalidArgumentError } from "commander";
import { action } from "../errors.js";
import { checkInputFile, checkOutputPath, refuseOverwrite } from "./common.js";

/**
 * A size as llama.cpp's `--split-max-size` takes it: an integer with a unit, decimal as llama.cpp
 * counts them (K = 1000, M = 1000², G = 1000³ bytes); a bare integer is bytes.
 * @throws InvalidArgumentError for anything else
 */
export function parseSplitSize(v: string, option = "--split-max-size"): number {
  const m = /^(\d+)([KMG]?)$/i.exec(v.trim());
  const n = m ? Number(m[1]) * { "": 1, K: 1e3, M: 1e6, G: 1e9 }[m[2].toUpperCase() as "" | "K" | "M" | "G"] : NaN;
  if (!m || !Number.isSafeInteger(n) || n < 1) {
    throw new InvalidArgumentError(
      `${option} must be a positive integer of bytes, or one with a unit K, M or G (e.g. 2G), got "${v}"`,
    );
  }
  return n;
}

function positive(name: string) {
  return (v: string): number => {
    const n = Number(v);
    if (!Number.isInteger(n) || n < 1) throw new InvalidArgumentError(`${name} must be a positive integer, got "${v}"`);
    return n;
  };
}

/** The output prefix of a split written in place of OUT (`model.gguf` → `model`). */
export function splitPrefixOf(out: string): string {
  return out.endsWith(".gguf") ? out.slice(0, -".gguf".length) : out;
}

const mb = (n: number) => `${(n / 1e6).toFixed(2)} MB`;

/** Splits an opened model into shards next to OUT_PREFIX, reporting each on stderr. */
export async function splitModel(file: GgufFile, prefix: string, o: { maxTensors?: number; maxBytes?: number }) {
  return writeGgufSplit(file, prefix, {
    ...o,
    onShard: (path, tensors, bytes) => process.stderr.write(`wrote ${path} (${tensors} tensors, ${mb(bytes)})\n`),
  });
}

interface SplitOptions {
  split?: boolean;
  merge?: boolean;
  splitMaxTensors?: number;
  splitMaxSize?: number;
  dryRun?: boolean;
  force?: boolean;
}

export function register(program: Command): void {
  program
    .command("gguf-split")
    .description(
      "split a model into shards OUT_PREFIX-0000i-of-0000N.gguf as llama.cpp's gguf-split does, or merge a split model (give its first shard) into one file",
    )
    .argument(
      "<in>",
      "model to split, or with --merge the first shard of a split model (or its shards joined with cat)",
    )
    .argument("<out>", "output prefix of the shards, or with --merge the output file")
    .option("--split", "split (the default)")
    .option("--merge", "merge the shards of a split model into one file")
    .option("--split-max-tensors <n>", "at most N tensors per shard (default 128)", positive("--split-max-tensors"))
    .option(
      "--split-max-size <size>",
      "at most this much tensor data per shard: N bytes, or N with K, M or G (decimal, e.g. 2G)",
      (v) => parseSplitSize(v),
    )
    .option("--dry-run", "print the shards that would be written, write nothing")
    .option("--force", "overwrite the output file or shards when they exist")
    .action(
      action(async (input: string, out: string, o: SplitOptions) => {
        if (o.split && o.merge) throw new InvalidArgumentError("give --split or --merge, not both");
        if (o.splitMaxTensors !== undefined && o.splitMaxSize !== undefined) {
          throw new InvalidArgumentError("give --split-max-tensors or --split-max-size, not both");
        }
        checkInputFile(input, o.merge ? "first shard" : "model file");
        if (o.merge) {
          if (o.splitMaxTensors !== undefined || o.splitMaxSize !== undefined) {
            throw new InvalidArgumentError("--merge takes no --split-max-* option");
          }
          const file = openGgufModel(input, { joined: true });
          if (o.dryRun) {
            process.stdout.write(
              `would merge ${file.splits?.length ?? 1} shards (${file.tensors.length} tensors) into ${out}\n`,
            );
            return;
          }
          checkOutputPath(out, input);
          refuseOverwrite(out, o.force);
          const bytes = await mergeGgufSplit(input, out);
          process.stderr.write(
            `wrote ${out} (${file.splits?.length} shards merged, ${file.tensors.length} tensors, ${mb(bytes)})\n`,
          );
          return;
        }
        const file = openGgufModel(input);
        const opts =
          o.splitMaxSize !== undefined ? { maxBytes: o.splitMaxSize } : { maxTensors: o.splitMaxTensors ?? 128 };
        if (o.dryRun) {
          const plan = planGgufSplit(file, opts);
          plan.forEach((ts, i) => {
            const bytes = ts.reduce((s, t) => s + t.byteLength, 0);
            process.stdout.write(
              `${splitPath(out, i, plan.length)}: ${ts.length} tensors, ${mb(bytes)} of tensor data\n`,
            );
          });
          return;
        }
        // every shard path before the first is written (a user's file is replaced only with --force)
        const plan = planGgufSplit(file, opts);
        for (let i = 0; i < plan.length; i++) {
          checkOutputPath(splitPath(out, i, plan.length), input);
          refuseOverwrite(splitPath(out, i, plan.length), o.force);
        }
        await splitModel(file, out, opts);
      }),
    );
}

/**
 * Writes a model with `write(path)`, then, when `maxBytes` is given, splits it into shards
 * `OUT_PREFIX-0000i-of-0000N.gguf` (OUT without `.gguf`) of at most that much tensor data and removes
 * the unsplit file. Returns the paths written.
 * @throws InvalidArgumentError when a shard would overwrite one of `inputs`, or an existing file without
 *   `force`
 */
export async function writeModelMaybeSplit(
  output: string,
  maxBytes: number | undefined,
  inputs: string[],
  force: boolean | undefined,
  write: (path: string) => void,
): Promise<string[]> {
  if (maxBytes === undefined) {
    write(output);
    return [output];
  }
  const tmp = join(dirname(output), `.${basename(output)}.${process.pid}.unsplit.tmp`);
  try {
    write(tmp);
    const file = openGguf(tmp);
    const n = planGgufSplit(file, { maxBytes }).length;
    const prefix = splitPrefixOf(output);
    for (let i = 0; i < n; i++) {
      checkOutputPath(splitPath(prefix, i, n), ...inputs);
      refuseOverwrite(splitPath(prefix, i, n), force);
    }
    return await splitModel(file, prefix, { maxBytes });
  } finally {
    rmSync(tmp, { force: true });
  }
}

/** The input model and the files it was read from (all shards of a split model). */
export function modelInputs(file: GgufFile): string[] {
  return file.splits ? file.splits.map((s) => s.path) : [file.path];
}
