#!/usr/bin/env node
import { describeError, verboseRequested } from "./errors.js";
import { createProgram } from "./program.js";

// Output piped into a reader that stopped (`| head`): end quietly, as a C program on SIGPIPE would. Any
// other write error (a full disk, /dev/full) ends the command with one line and exit status 1.
for (const stream of [process.stdout, process.stderr]) {
  stream.on("error", (e: NodeJS.ErrnoException) => {
    if (e.code === "EPIPE") process.exit(0);
    if (stream === process.stdout) {
      try {
        process.stderr.write(`powerinfer: cannot write the output: ${e.message}\n`);
      } catch {
        // stderr unwritable too: the exit status says it
      }
    }
    process.exit(1);
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
