/**
 * `powerinfer quantize IN OUT TYPE`: converts the weight matrices of a model (F32/F16/BF16) to Q8_0, Q4_0,
 * F16, BF16 or F32, keeping its container (GGUF or PowerInfer PWRI), predictors and metadata.
 */
import { GGMLType, ggmlTypeFromName, ggmlTypeName, openGgufModel } from "@powerinfer/gguf";
import { isFloatType, isQuantizableMatrix, QUANTIZE_TYPES, rewriteModelFile } from "@powerinfer/predictor";
import { type Command, InvalidArgumentError } from "commander";
import { action } from "../errors.js";
import { checkInputFile, checkOutputPath, refuseOverwrite } from "./common.js";
import { modelInputs, parseSplitSize, writeModelMaybeSplit } from "./gguf-split.js";

/**
 * llama-quantize's numeric types (llama_ftype, include/llama.h) for the types this command writes: 0 F32,
 * 1 F16, 2 Q4_0, 7 Q8_0, 32 BF16.
 */
const LLAMA_FTYPES: Readonly<Record<number, GGMLType>> = {
  0: GGMLType.F32,
  1: GGMLType.F16,
  2: GGMLType.Q4_0,
  7: GGMLType.Q8_0,
  32: GGMLType.BF16,
};

export function register(program: Command): void {
  const names = QUANTIZE_TYPES.map((t) => ggmlTypeName(t)).join(", ");
  program
    .command("quantize")
    .description(`quantize a model's weight matrices (${names}); predictors, vectors and metadata are kept`)
    .argument("<input>", "GGUF or PowerInfer GGUF model")
    .argument(
      "<output>",
      "output file, same container as the input (with --split-max-size: OUT without .gguf is the prefix of the shards)",
    )
    .argument("<type>", `${names} (or llama-quantize's number: 0 F32, 1 F16, 2 Q4_0, 7 Q8_0, 32 BF16)`)
    .option(
      "--split-max-size <size>",
      "write shards OUT-0000i-of-0000N.gguf of at most this much tensor data (e.g. 2G)",
      (v) => parseSplitSize(v),
    )
    .option("-f, --force", "replace OUT (or its shards) if it exists")
    .action(
      action(async (input: string, output: string, typeName: string, o: { splitMaxSize?: number; force?: boolean }) => {
        const type = /^\s*\d+\s*$/.test(typeName) ? LLAMA_FTYPES[Number(typeName)] : ggmlTypeFromName(typeName);
        if (type === undefined || !(QUANTIZE_TYPES as readonly number[]).includes(type)) {
          throw new InvalidArgumentError(
            `cannot quantize to "${typeName}" (supported: ${names}, or llama-quantize's numbers 0, 1, 2, 7, 32 for F32, F16, Q4_0, Q8_0, BF16)`,
          );
        }
        checkOutputPath(output, input);
        if (o.splitMaxSize === undefined) refuseOverwrite(output, o.force);
        checkInputFile(input);
        // the first shard of a split model opens the whole model; the output is one file (or new shards)
        const file = openGgufModel(input);
        // llama.cpp's llama-quantize refuses to requantize without --allow-requantize; this command converts
        // float matrices only, so a quantized matrix of another type would be kept as it is and the output
        // would not be the type asked for
        const matrices = file.tensors.filter(isQuantizableMatrix);
        const other = matrices.filter((t) => !isFloatType(t.type) && t.type !== type);
        if (other.length > 0) {
          const kinds = [...new Set(other.map((t) => ggmlTypeName(t.type)))].join(", ");
          const all =
            other.length === matrices.length ? "" : ` (${other.length} of its ${matrices.length} weight matrices)`;
          throw new InvalidArgumentError(
            `${input}'s weight matrices are already quantized (${kinds})${all}: this command converts F32/F16/BF16 matrices only, so they would stay ${kinds} in a file asked to be ${ggmlTypeName(type)} (requantizing loses precision, and llama.cpp's llama-quantize refuses it too); start from the F32/F16/BF16 model`,
          );
        }
        const t0 = performance.now();
        let r: ReturnType<typeof rewriteModelFile> | undefined;
        const paths = await writeModelMaybeSplit(output, o.splitMaxSize, modelInputs(file), o.force, (path) => {
          r = rewriteModelFile(file, path, { quantize: type });
        });
        if (!r) return;
        for (const n of r.notes) process.stderr.write(`note: ${n}\n`);
        process.stderr.write(
          `wrote ${paths.length > 1 ? `${paths.length} shards ${paths[0]} …` : paths[0]} (${r.format}, ${r.tensors} tensors: ${r.types.map(([t, n]) => `${n} ${t}`).join(", ")}) in ${((performance.now() - t0) / 1000).toFixed(1)} s\n`,
        );
      }),
    );
}
