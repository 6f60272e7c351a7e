/**
 * `powerinfer convert`: rewrites a model as PowerInfer GGUF (`PWRI`: ffn_down stored transposed as
 * ffn_down_t) or back to plain GGUF, optionally taking the predictors of another file.
 */
import { openGguf, parseModelConfig } from "@powerinfer/gguf";
import { readPredictors, rewriteModelFile } from "@powerinfer/predictor";
import { type Command, InvalidArgumentError } from "commander";
import { action } from "../errors.js";
import { float } from "./common.js";

interface ConvertOptions {
  to: string;
  predictors?: string;
  sparseThreshold?: number;
}

export function register(program: Command): void {
  program
    .command("convert")
    .description("rewrite a model as PowerInfer GGUF (PWRI, ffn_down transposed) or plain GGUF")
    .argument("<input>", "GGUF or PowerInfer GGUF model")
    .argument("<output>", "output file")
    .option("--to <format>", "pwri or gguf", "pwri")
    .option("--predictors <file>", "take the predictors (blk.N.fc1/fc2 and the threshold) from this model file")
    .option("--sparse-threshold <x>", "set powerinfer.sparse_threshold (needs predictors)", float("sparse-threshold"))
    .action(
      action(async (input: string, output: string, o: ConvertOptions) => {
        const to = o.to.toLowerCase();
        if (to !== "pwri" && to !== "gguf") throw new InvalidArgumentError(`--to must be pwri or gguf, got "${o.to}"`);
        const file = openGguf(input);
        const cfg = parseModelConfig(file);
        let preds: ReturnType<typeof readPredictors> | undefined;
        if (o.predictors) {
          preds = readPredictors(openGguf(o.predictors), { nEmbd: cfg.n_embd, nFf: cfg.n_ff, nLayer: cfg.n_layer });
        } else if (o.sparseThreshold !== undefined) {
          if (!cfg.has_predictors) throw new InvalidArgumentError("--sparse-threshold needs a model with predictors");
          preds = readPredictors(file, { nEmbd: cfg.n_embd, nFf: cfg.n_ff, nLayer: cfg.n_layer });
        }
        if (preds && o.sparseThreshold !== undefined) preds.threshold = o.sparseThreshold;
        if (to === "pwri" && cfg.ffn.activation !== "relu") {
          process.stderr.write(
            `note: the FFN uses ${cfg.ffn.activation}, not ReLU; PowerInfer reads PWRI llama files as ReLU models\n`,
          );
        }
        const r = rewriteModelFile(file, output, { format: to === "pwri" ? "PWRI" : "GGUF", predictors: preds });
        for (const n of r.notes) process.stderr.write(`note: ${n}\n`);
        process.stderr.write(`wrote ${output} (${r.format}, ${r.tensors} tensors)\n`);
      }),
    );
}
