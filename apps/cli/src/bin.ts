#!/usr/bin/env node
import { describeError, verboseRequested } from "./errors.js";
import { createProgram } from "./program.js";

// Output piped into a reader that stopped (`| head`): end quietly, as a C program on SIGPIPE would.
for (const stream of [process.stdout, process.stderr]) {
  stream.on("error", (e: NodeJS.ErrnoException) => {
    if (e.code === "EPIPE") process.exit(0);
    throw e;
  });
}

// llama.cpp's multi-letter short flag `-ngl N` (commander's short flags are one letter)
const argv = process.argv.map((a, i) => (i >= 2 && a === "-ngl" ? "--n-gpu-layers" : a));

createProgram()
  .parseAsync(argv)
  .catch((e: unknown) => {
    process.stderr.write(`powerinfer: ${describeError(e, { verbose: verboseRequested() })}\n`);
    process.exitCode = 1;
  });
