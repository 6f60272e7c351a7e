/**
 * `powerinfer quantize IN OUT TYPE`: converts the weight matrices of a model (F32/F16/BF16) to Q8_0, Q4_0,
 * F16, BF16 or F32, keeping its container (GGUF or PowerInfer PWRI), predictors and metadata.
 */
import { ggmlTypeFromName, ggmlTypeName, openGguf } from "@powerinfer/gguf";
import { QUANTIZE_TYPES, rewriteModelFile } from "@powerinfer/predictor";
import { type Command, InvalidArgumentError } from "commander";
import { action } from "../errors.js";
import { checkInputFile, checkOutputPath } from "./common.js";

export function register(program: Command): void {
  const names = QUANTIZE_TYPES.map((t) => ggmlTypeName(t)).join(", ");
  program
    .command("quantize")
    .description(`quantize a model's weight matrices (${names}); predictors, vectors and metadata are kept`)
    .argument("<input>", "GGUF or PowerInfer GGUF model")
    .argument("<output>", "output file (same container as the input)")
    .argument("<type>", names)
    .action(
      action(async (input: string, output: string, typeName: string) => {
        const type = ggmlTypeFromName(typeName);
        if (type === undefined || !(QUANTIZE_TYPES as readonly number[]).includes(type)) {
          throw new InvalidArgumentError(`cannot quantize to "${typeName}" (supported: ${names})`);
        }
        checkOutputPath(output, input);
        checkInputFile(input);
        const file = openGguf(input);
        const t0 = performance.now();
        const r = rewriteModelFile(file, output, { quantize: type });
        for (const n of r.notes) process.stderr.write(`note: ${n}\n`);
        process.stderr.write(
          `wrote ${output} (${r.format}, ${ggmlTypeName(type)}, ${r.tensors} tensors) in ${((performance.now() - t0) / 1000).toFixed(1)} s\n`,
        );
      }),
    );
}
