/**
 * `powerinfer convert`: rewrites a model as PowerInfer GGUF (`PWRI`: ffn_down stored transposed as
 * ffn_down_t) or back to plain GGUF, optionally taking the predictors of another file.
 */
import { openGguf, parseModelConfig } from "@powerinfer/gguf";
import { readPredictors, rewriteModelFile } from "@powerinfer/predictor";
import { type Command, InvalidArgumentError } from "commander";
import { action } from "../errors.js";
import { checkInputFile, checkOutputPath, choice, float } from "./common.js";

interface ConvertOptions {
  to: string;
  predictors?: string;
  keepPredictors?: boolean;
  sparseThreshold?: number;
}

export function register(program: Command): void {
  program
    .command("convert")
    .description("rewrite a model as PowerInfer GGUF (PWRI, ffn_down transposed) or plain GGUF")
    .argument("<input>", "GGUF or PowerInfer GGUF model")
    .argument("<output>", "output file")
    .option("--to <format>", "pwri or gguf", choice("to", ["pwri", "gguf"]), "pwri")
    .option("--predictors <file>", "take the predictors (blk.N.fc1/fc2 and the threshold) from this model file")
    .option(
      "--keep-predictors",
      "with --to gguf: keep the predictor tensors (powerinfer-ts reads them; llama.cpp does not)",
    )
    .option("--sparse-threshold <x>", "set powerinfer.sparse_threshold (needs predictors)", float("sparse-threshold"))
    .action(
      action(async (input: string, output: string, o: ConvertOptions) => {
        const to = o.to;
        checkOutputPath(output, input, o.predictors);
        checkInputFile(input);
        if (o.predictors) checkInputFile(o.predictors, "predictor file");
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
        // a plain GGUF is for llama.cpp, which refuses tensors it does not know: predictors stay out unless kept
        const drop = to === "gguf" && !preds && cfg.has_predictors && !o.keepPredictors;
        if (drop) {
          process.stderr.write(
            "note: predictors (blk.N.fc1/fc2) left out: llama.cpp cannot load a GGUF with them (--keep-predictors keeps them for powerinfer-ts)\n",
          );
        }
        const r = rewriteModelFile(file, output, {
          format: to === "pwri" ? "PWRI" : "GGUF",
          predictors: preds,
          dropPredictors: drop,
        });
        for (const n of r.notes) process.stderr.write(`note: ${n}\n`);
        process.stderr.write(`wrote ${output} (${r.format}, ${r.tensors} tensors)\n`);
      }),
    );
}
