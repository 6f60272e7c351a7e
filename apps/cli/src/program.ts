/** The `powerinfer` command tree: each command lives in commands/<name>.ts as a thin layer over the packages. */
import { Command } from "commander";
import { register as backends } from "./commands/backends.js";
import { register as batched } from "./commands/batched.js";
import { register as bench } from "./commands/bench.js";
import { register as chat } from "./commands/chat.js";
import { register as convert } from "./commands/convert.js";
import { register as genModel } from "./commands/gen-model.js";
import { register as inspect } from "./commands/inspect.js";
import { register as perplexity } from "./commands/perplexity.js";
import { register as plan } from "./commands/plan.js";
import { register as profile } from "./commands/profile.js";
import { register as quantize } from "./commands/quantize.js";
import { register as run } from "./commands/run.js";
import { register as serve } from "./commands/serve.js";
import { register as trainPredictor } from "./commands/train-predictor.js";

/**
 * "error: option '-n, --n-predict <n>' argument '-5' is invalid. --n-predict must be …" →
 * "powerinfer: --n-predict must be …"; any other "error: …" → "powerinfer: …".
 */
export function commanderErrorLine(str: string): string {
  return str
    .replace(/^error: (option|argument) '[^']*' argument '[^']*' is invalid\. /, "powerinfer: ")
    .replace(/^error: command-argument value '[^']*' is invalid for argument '[^']*'\. /, "powerinfer: ")
    .replace(/^error: /, "powerinfer: ");
}

export function createProgram(): Command {
  const program = new Command("powerinfer")
    .description("local LLM inference exploiting activation sparsity")
    .version("0.1.0")
    .showHelpAfterError("(run with --help for usage)")
    // commander's own errors (a bad or missing option) in the same form as the commands' errors:
    // "powerinfer: <message>", without repeating the option's flags and value around our message
    .configureOutput({ outputError: (str, write) => write(commanderErrorLine(str)) });
  for (const reg of [
    run,
    batched,
    chat,
    serve,
    perplexity,
    profile,
    trainPredictor,
    plan,
    inspect,
    convert,
    quantize,
    genModel,
    bench,
    backends,
  ])
    reg(program);
  // every command takes --verbose: error lines then also name the error's class and code
  for (const cmd of program.commands) {
    if (!cmd.options.some((o) => o.long === "--verbose"))
      cmd.option("-v, --verbose", "error lines also name the error's class and code");
  }
  return program;
}
