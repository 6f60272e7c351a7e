/** `powerinfer perplexity`: perplexity over a text file (llama.cpp's protocol, or --all-tokens). */
import { perplexity } from "@powerinfer/engine";
import { type Command, InvalidArgumentError } from "commander";
import { action } from "../errors.js";
import { type ModelCliOptions, modelOptions, plural, readPromptFile } from "./common.js";
import { type DeviceCliOptions, deviceOptions, loadModelWithDevice } from "./device.js";

export function register(program: Command): void {
  deviceOptions(modelOptions(program.command("perplexity").description("perplexity of the model over a text file")))
    .requiredOption(
      "-f, --file <file>",
      "text file (- for standard input; one final newline is dropped, as llama.cpp does)",
    )
    .option(
      "--all-tokens",
      "BOS-prefixed chunks of n_ctx−1 tokens, every token scored once (protocol of shared/models/README-relu.md)",
    )
    .option("--json", "print the result as JSON")
    .action(
      action(async (o: ModelCliOptions & DeviceCliOptions & { file: string; allTokens?: boolean; json?: boolean }) => {
        const text = readPromptFile(o.file);
        const loaded = await loadModelWithDevice(o, !!o.json);
        const { backend, model } = loaded;
        const session = model.createSession({ nCtx: o.ctxSize, nBatch: o.batchSize, kvType: o.kvType as "f16" });
        // e.g. a context beyond the trained one (perplexity there says little about the model), or the file's
        // (a special token id outside the vocabulary)
        for (const w of [...model.config.warnings, ...session.warnings]) process.stderr.write(`warning: ${w}\n`);
        const tok = model.tokenizer;
        const protocol = o.allTokens ? "all-tokens" : "llama.cpp";
        const ids = tok.tokenize(text, { addSpecial: protocol === "llama.cpp" });
        if (protocol === "llama.cpp" && ids.length < 2 * session.nCtx) {
          // llama.cpp's perplexity refuses the same text (tools/perplexity: "you need at least …")
          throw new InvalidArgumentError(
            `you need at least ${2 * session.nCtx} tokens to evaluate perplexity with a context of ${session.nCtx}: ${o.file} tokenizes to only ${plural(ids.length, "token")} (a smaller -c, or --all-tokens, scores shorter texts)`,
          );
        }
        if (protocol === "all-tokens" && ids.length < session.nCtx - 1) {
          throw new InvalidArgumentError(
            `--all-tokens scores chunks of n_ctx − 1 = ${session.nCtx - 1} tokens: ${o.file} tokenizes to only ${plural(ids.length, "token")} (a smaller -c scores shorter texts)`,
          );
        }
        const r = perplexity(session, ids, {
          protocol,
          bosId: tok.bosId,
          addBos: tok.addBos,
          onChunk: (d, n, p) => {
            // llama.cpp's running estimate after each chunk: "[1]15.4127,[2]15.9143," (readable in a pipe too)
            if (!o.json) process.stderr.write(`[${d}]${fixed4(p)},${d === n ? "\n" : ""}`);
          },
        });
        if (o.json) process.stdout.write(`${JSON.stringify({ protocol, n_ctx: session.nCtx, ...r })}\n`);
        else
          process.stdout.write(
            `perplexity (${protocol}, n_ctx ${session.nCtx}): ${fixed4(r.perplexity)} over ${r.tokensScored} tokens in ${r.chunks} chunks (mean NLL ${r.meanNll.toFixed(5)})\n`,
          );
        session.dispose();
        model.dispose();
        backend.dispose();
        loaded.device?.dispose();
      }),
    );
}

/**
 * A number as C's printf("%.4f") prints it (llama.cpp's perplexity): "inf"/"nan" for non-finite values and
 * every integer digit for large ones (JavaScript's toFixed switches to exponent form from 1e21).
 */
export function fixed4(x: number): string {
  if (Number.isNaN(x)) return "nan";
  if (!Number.isFinite(x)) return x > 0 ? "inf" : "-inf";
  return x.toLocaleString("en-US", { useGrouping: false, minimumFractionDigits: 4, maximumFractionDigits: 4 });
}
