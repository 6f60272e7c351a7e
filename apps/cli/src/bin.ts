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

createProgram()
  .parseAsync(process.argv)
  .catch((e: unknown) => {
    process.stderr.write(`powerinfer: ${describeError(e, { verbose: verboseRequested() })}\n`);
    process.exitCode = 1;
  });
