#!/usr/bin/env node
import { describeError } from "./errors.js";
import { createProgram } from "./program.js";

createProgram()
  .parseAsync(process.argv)
  .catch((e: unknown) => {
    process.stderr.write(`powerinfer: ${describeError(e)}\n`);
    process.exitCode = 1;
  });
