/** The `powerinfer` command tree: each command lives in commands/<name>.ts as a thin layer over the packages. */
import { Command } from "commander";
import { register as backends } from "./commands/backends.js";
import { register as batched } from "./commands/batched.js";
import { register as bench } from "./commands/bench.js";
import { register as chat } from "./commands/chat.js";
import { register as convert } from "./commands/convert.js";
import { register as evalCallback } from "./commands/eval-callback.js";
import { register as genModel } from "./commands/gen-model.js";
import { register as ggufSplit } from "./commands/gguf-split.js";
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

/** Examples shown at the end of each command's --help (file names are placeholders). */
export const EXAMPLES: Record<string, string[]> = {
  run: [
    'run -m model.gguf -p "Once upon a time" -n 32 --temp 0',
    "run -m model.pwri.gguf -f prompt.txt -n 128 --vram-budget 4",
  ],
  batched: ['batched -m model.gguf -p "Once upon a time" -np 4 -n 32 --seed 1'],
  chat: ['chat -m model.gguf --system "You are a helpful assistant."'],
  serve: ["serve -m model.gguf --port 8080 -np 4"],
  perplexity: ["perplexity -m model.gguf -f wiki.test.raw", "perplexity -m model.gguf -f text.txt --all-tokens -c 512"],
  profile: ["profile -m model.pwri.gguf -f text.txt --tokens 20000"],
  "train-predictor": [
    "train-predictor -m relu-model.gguf -f text.txt -o relu-model.pwri.gguf",
    "train-predictor -m relu-model.gguf -f text.txt -o out.pwri.gguf --rank 256 --epochs 2 --tokens 20000",
  ],
  plan: ["plan -m model.pwri.gguf --vram-budget 8"],
  inspect: ["inspect model.gguf", "inspect model.pwri.gguf --json"],
  convert: ["convert model.gguf model.pwri.gguf", "convert model.pwri.gguf model.gguf --to gguf"],
  quantize: ["quantize model-f16.gguf model-q4_0.gguf Q4_0"],
  "gguf-split": [
    "gguf-split --split-max-size 2G model.gguf model-split",
    "gguf-split --merge model-split-00001-of-00003.gguf model.gguf",
  ],
  "gen-model": [
    "gen-model --preset tiny -o tiny.gguf",
    "gen-model --preset 7b --layers 1 --format pwri -o slice.pwri.gguf",
  ],
  bench: ["bench -m model.gguf -p 512 -n 128 -t 1,2 -r 3"],
  "eval-callback": [
    'eval-callback -m model.gguf -p "Once upon a time" --out ours.txt',
    'eval-callback -m model.gguf -p "Once upon a time" --compare llama-eval-callback.txt',
  ],
  backends: ["backends", "backends --json"],
};

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
    ggufSplit,
    genModel,
    bench,
    evalCallback,
    backends,
  ])
    reg(program);
  // every command takes --verbose: error lines then also name the error's class and code
  for (const cmd of program.commands) {
    if (!cmd.options.some((o) => o.long === "--verbose"))
      cmd.option("-v, --verbose", "error lines also name the error's class and code");
    const ex = EXAMPLES[cmd.name()];
    if (ex) cmd.addHelpText("after", `\nExamples:\n${ex.map((e) => `  $ powerinfer ${e}`).join("\n")}\n`);
  }
  return program;
}
