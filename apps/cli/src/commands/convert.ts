/**
 * `powerinfer convert`: rewrites a model as PowerInfer GGUF (`PWRI`: ffn_down stored transposed as
 * ffn_down_t) or back to plain GGUF, optionally taking the predictors of another file.
 */
import {
  type GgufMetadataEntry,
  GgufTypes,
  ggmlTypeName,
  openGguf,
  openGgufModel,
  parseModelConfig,
} from "@powerinfer/gguf";
import { readPredictors, rewriteModelFile } from "@powerinfer/predictor";
import { type Command, InvalidArgumentError } from "commander";
import { action } from "../errors.js";
import { isBundled, writeBundled, writeUnbundled } from "@powerinfer/engine";
import { checkInputFile, checkOutputPath, choice, float, int, refuseOverwrite } from "./common.js";
import { modelInputs, parseSplitSize, writeModelMaybeSplit } from "./gguf-split.js";

interface ConvertOptions {
  to: string;
  predictors?: string;
  keepPredictors?: boolean;
  sparseThreshold?: number;
  splitMaxSize?: number;
  bundle?: boolean;
  bucketSize?: number;
  force?: boolean;
}

export function register(program: Command): void {
  program
    .command("convert")
    .description("rewrite a model as PowerInfer GGUF (PWRI, ffn_down transposed) or plain GGUF")
    .argument("<input>", "GGUF or PowerInfer GGUF model")
    .argument("<output>", "output file (with --split-max-size: OUT without .gguf is the prefix of the shards)")
    .option("--to <format>", "pwri or gguf", choice("to", ["pwri", "gguf"]), "pwri")
    .option("--predictors <file>", "take the predictors (blk.N.fc1/fc2 and the threshold) from this model file")
    .option(
      "--keep-predictors",
      "with --to gguf: keep the predictor tensors (powerinfer-ts reads them; llama.cpp does not)",
    )
    .option(
      "--sparse-threshold <x>",
      "set powerinfer.sparse_threshold (needs predictors; stored as f32)",
      float("sparse-threshold", { min: -3.4e38, max: 3.4e38 }),
    )
    .option(
      "--bundle",
      "write the bundled layout: each neuron's up, gate and down_t rows together, in 4 KiB-aligned buckets (read by --ram-budget in one read per neuron; PowerInfer/llama.cpp cannot read it: `convert --to pwri` turns it back)",
    )
    .option(
      "--bucket-size <n>",
      "with --bundle: neurons per 4 KiB-aligned bucket (default: the fewest that fill whole 4 KiB blocks)",
      int("bucket-size", { min: 1, max: 4096 }),
    )
    .option(
      "--split-max-size <size>",
      "write shards OUT-0000i-of-0000N.gguf of at most this much tensor data (e.g. 2G)",
      (v) => parseSplitSize(v),
    )
    .option("-f, --force", "replace OUT (or its shards) if it exists")
    .action(
      action(async (input: string, output: string, o: ConvertOptions) => {
        const to = o.to;
        // the inputs first: a missing input is the message, not an output that exists
        checkInputFile(input);
        if (o.predictors) checkInputFile(o.predictors, "predictor file");
        checkOutputPath(output, input, o.predictors);
        if (o.splitMaxSize === undefined) refuseOverwrite(output, o.force);
        // the first shard of a split model opens the whole model; the output is one file (or new shards)
        const file = openGgufModel(input);
        const cfg = parseModelConfig(file);
        if (o.bucketSize !== undefined && !o.bundle) throw new InvalidArgumentError("--bucket-size needs --bundle");
        if (isBundled(file) || o.bundle) {
          if (o.predictors || o.sparseThreshold !== undefined || o.splitMaxSize !== undefined || o.keepPredictors)
            throw new InvalidArgumentError(
              "--bundle and bundled inputs take no other option: bundle a finished PWRI file, or convert back first",
            );
          if (to !== "pwri")
            throw new InvalidArgumentError(
              isBundled(file)
                ? "a bundled model converts back to PWRI (--to pwri); convert that to GGUF afterwards"
                : "--bundle writes a PowerInfer file: use --to pwri",
            );
          if (cfg.moe) {
            throw new InvalidArgumentError(
              `${input} has routed experts: the bundled layout holds dense FFNs only (--ram-budget serves routed experts from the file as it is: whole experts, one read each)`,
            );
          }
          if (isBundled(file)) {
            if (o.bundle) throw new InvalidArgumentError(`${input} is bundled already`);
            await writeUnbundled(file, output, cfg.n_embd, cfg.n_ff);
            process.stderr.write(`wrote ${output}: PWRI (ffn_up, ffn_gate, ffn_down_t per layer), unbundled\n`);
            return;
          }
          if (file.format !== "PWRI")
            throw new InvalidArgumentError(
              `${input} is plain GGUF: convert it to PWRI first (\`powerinfer convert ${input} OUT.gguf --to pwri\`), then bundle that`,
            );
          // a bundled model runs in predictor mode only (its rows are read on demand for predicted neurons)
          if (!cfg.has_predictors)
            throw new InvalidArgumentError(
              `${input} has no predictors, and a bundled model runs only in predictor mode: add them first (\`powerinfer convert ${input} OUT.gguf --predictors FILE\` or train-predictor), then bundle that`,
            );
          const r = await writeBundled(file, output, { bucketSize: o.bucketSize });
          process.stderr.write(
            `wrote ${output}: PWRI, bundled FFN (${r.layers} layers, ${r.bucketSize} neurons per 4 KiB-aligned bucket)\n`,
          );
          return;
        }
        let preds: ReturnType<typeof readPredictors> | undefined;
        if (cfg.moe && o.predictors) {
          throw new InvalidArgumentError(
            `--predictors: ${input} has routed experts, whose predictors are per expert (blk.N.fc1_exps/fc2_exps); convert cannot replace them — train them with \`powerinfer train-predictor\``,
          );
        }
        if (o.predictors) {
          const pf = openGguf(o.predictors);
          if (!pf.tensorMap.has("blk.0.fc1.weight") && pf.tensorMap.has("blk.0.fc1_exps.weight")) {
            throw new InvalidArgumentError(
              `--predictors ${o.predictors} holds per-expert predictors (blk.N.fc1_exps/fc2_exps) of a model with routed experts; ${input} has dense FFNs, whose predictors are blk.N.fc1/fc2`,
            );
          }
          preds = readPredictors(pf, { nEmbd: cfg.n_embd, nFf: cfg.n_ff, nLayer: cfg.n_layer });
          // they are rewritten from their values: F16 stays F16, any other type becomes F32
          const kept = pf.tensors.filter((t) => /^blk\.\d+\.fc[12]\.weight$/.test(t.name));
          const types = [...new Set(kept.map((t) => ggmlTypeName(t.type)))];
          if (types.some((t) => t !== "F16" && t !== "F32"))
            process.stderr.write(
              `note: the predictors of ${o.predictors} (${types.join(", ")}) are written as ${preds.type.toUpperCase()}\n`,
            );
          if (o.sparseThreshold !== undefined) preds.threshold = o.sparseThreshold;
        } else if (o.sparseThreshold !== undefined && !cfg.has_predictors) {
          throw new InvalidArgumentError("--sparse-threshold needs a model with predictors");
        }
        const metadata: GgufMetadataEntry[] = [];
        // a new threshold for the file's own predictors is metadata only: the predictor tensors stay as stored
        if (!preds && o.sparseThreshold !== undefined)
          metadata.push({ key: "powerinfer.sparse_threshold", type: GgufTypes.f32, value: o.sparseThreshold });
        // a PWRI llama/falcon file is ReLU without saying so; a plain GGUF of it must say so, or it reads as
        // the architecture's default (SiLU, GELU): another model
        const actKey = `${cfg.arch}.hidden_act`;
        if (to === "gguf" && file.format === "PWRI" && cfg.ffn.activation === "relu" && !file.metadata.has(actKey))
          metadata.push({ key: actKey, type: GgufTypes.string, value: "relu" });
        if (to === "pwri" && cfg.ffn.activation !== "relu") {
          // PowerInfer and this engine read a PWRI llama file's FFN as ReLU(gate)·up: the file would be another model
          throw new InvalidArgumentError(
            `${input}: its FFN uses ${cfg.ffn.activation}(gate)·up, and a PowerInfer (PWRI) llama file is read as ReLU(gate)·up (by PowerInfer and by powerinfer-ts), so the converted file would compute a different model; PWRI is for ReLU models — keep this one as GGUF (--to gguf)`,
          );
        }
        // a plain GGUF is for llama.cpp, which refuses tensors it does not know: predictors stay out unless kept
        const drop = to === "gguf" && !preds && cfg.has_predictors && !o.keepPredictors;
        if (drop) {
          process.stderr.write(
            "note: predictors (blk.N.fc1/fc2, or the experts' fc1_exps/fc2_exps) left out: llama.cpp cannot load a GGUF with them (--keep-predictors keeps them for powerinfer-ts)\n",
          );
        }
        let r: ReturnType<typeof rewriteModelFile> | undefined;
        const paths = await writeModelMaybeSplit(output, o.splitMaxSize, modelInputs(file), o.force, (path) => {
          r = rewriteModelFile(file, path, {
            format: to === "pwri" ? "PWRI" : "GGUF",
            predictors: preds,
            dropPredictors: drop,
            metadata,
          });
        });
        if (!r) return;
        for (const n of r.notes) process.stderr.write(`note: ${n}\n`);
        process.stderr.write(
          `wrote ${paths.length > 1 ? `${paths.length} shards ${paths[0]} …` : paths[0]} (${r.format}, ${r.tensors} tensors)\n`,
        );
      }),
    );
}
