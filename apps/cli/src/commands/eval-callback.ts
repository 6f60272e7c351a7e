/**
 * `powerinfer eval-callback`: llama.cpp's `llama-eval-callback` for our forward graph — the prompt evaluated
 * in one batch, every node printed (first/last 3 values per row, sum) under llama.cpp's node names, so
 * both dumps can be compared node by node; `--compare` does the comparison against a llama.cpp dump.
 */
import { writeFileSync } from "node:fs";
import {
  compareTrace,
  evalCallback,
  formatEvalCallback,
  type NodeComparison,
  parseEvalCallback,
} from "@powerinfer/engine";
import { type Command, InvalidArgumentError } from "commander";
import { action } from "../errors.js";
import {
  checkOutputPath,
  loadModelFromCli,
  type ModelCliOptions,
  modelOptions,
  plural,
  readPromptFile,
  readTextFile,
  refuseOverwrite,
} from "./common.js";

interface EvalCallbackCliOptions extends ModelCliOptions {
  prompt?: string;
  file?: string;
  out?: string;
  compare?: string;
  namedOnly?: boolean;
  force?: boolean;
}

/** One line per compared node: "name  max |Δ| in the 4th decimal  Δ sum in the 6th". */
function comparisonReport(cmp: readonly NodeComparison[]): string {
  const lines = cmp.map(
    (c) =>
      `${c.name.padStart(16)}  max Δ ${String(c.maxDiff).padStart(5)} (1e-4)  Δ sum ${String(c.sumDiff).padStart(8)} (1e-6)${c.lastColumn ? "  (last token)" : ""}`,
  );
  const first = cmp.find((c) => c.maxDiff > 2 || c.sumDiff > 2);
  // the printed values (4 decimals) and the printed sum (6 decimals) are both compared; say which one failed
  const where = (c: NodeComparison) =>
    c.maxDiff > 2
      ? `row ${c.at.row}, value ${c.at.col}: ours ${(c.ours / 1e4).toFixed(4)}, llama.cpp ${(c.ref / 1e4).toFixed(4)}; Δ sum ${c.sumDiff}e-6`
      : `its values within ±2 (max Δ ${c.maxDiff}e-4), its printed sum off by ${c.sumDiff} in the 6th decimal`;
  lines.push(
    first
      ? `first node beyond ±2 in the last printed digit: ${first.name} (${where(first)})`
      : `all ${cmp.length} compared nodes within ±2 in the last printed digit (values and sums)`,
  );
  return `${lines.join("\n")}\n`;
}

export function register(program: Command): void {
  modelOptions(
    program
      .command("eval-callback")
      .description(
        "print every node of the prompt's forward pass as llama.cpp's llama-eval-callback does (llama.cpp's node names), or compare with its output",
      ),
  )
    .option("-p, --prompt <text>", "prompt text (BOS added as the model says)")
    .option(
      "-f, --file <file>",
      "read the prompt from a file (- for standard input; one final newline is dropped, as llama.cpp does)",
    )
    .option("-o, --out <file>", "write the dump to this file instead of stdout")
    .option("--force", "overwrite the --out file when it exists")
    .option(
      "--compare <file>",
      "a llama-eval-callback output for the same model and prompt: print, per node, the largest difference and the first node beyond ±2 in the last printed digit",
    )
    .option("--named-only", "only the nodes with a llama.cpp name (default: every node, unnamed ones as node_N)")
    .action(
      action(async (o: EvalCallbackCliOptions) => {
        if (o.prompt === undefined && o.file === undefined)
          throw new InvalidArgumentError("give a prompt with -p or -f");
        const prompt = o.prompt ?? readPromptFile(o.file!);
        if (o.out) {
          checkOutputPath(o.out, o.model, o.file, o.compare);
          refuseOverwrite(o.out, o.force);
        }
        const ref = o.compare ? parseEvalCallback(readTextFile(o.compare)) : undefined;
        if (ref?.length === 0) throw new InvalidArgumentError(`${o.compare} holds no llama-eval-callback node`);
        const { backend, model } = await loadModelFromCli(o, true);
        try {
          const ids = model.tokenizer.tokenize(prompt, { addSpecial: true, parseSpecial: false });
          if (ids.length === 0) throw new InvalidArgumentError("the prompt is empty");
          // a dump of another prompt would be compared on its last column only, node after node: say so before
          // the forward pass (the embd node has a column per token)
          const refTokens = ref?.find((r) => r.name === "embd")?.ne[1];
          if (refTokens !== undefined && refTokens !== ids.length) {
            throw new InvalidArgumentError(
              `${o.compare} is a dump of ${plural(refTokens, "token")} (its embd node), and this prompt tokenizes to ${plural(ids.length, "token")}: compare the same model and prompt`,
            );
          }
          const nodes = evalCallback(model, ids, {
            nCtx: o.ctxSize ?? ids.length,
            kvType: o.kvType as "f16" | "f32",
            nodes: o.namedOnly ? "named" : "all",
          });
          const text = formatEvalCallback(nodes);
          if (o.out) writeFileSync(o.out, text);
          else if (!ref) process.stdout.write(text);
          if (ref) {
            const cmp = compareTrace(nodes, ref);
            process.stdout.write(comparisonReport(cmp));
            // like diff: a node beyond the tolerance is a failure a script can see
            if (cmp.some((c) => c.maxDiff > 2 || c.sumDiff > 2)) process.exitCode = 1;
          }
        } finally {
          model.dispose();
          backend.dispose();
        }
      }),
    );
}
