/**
 * Error lines of the CLI. A user gets the message (which names the problem and, where there is one, the
 * fix) — not the error's class and code; `--verbose` adds those in brackets for bug reports. No stack
 * trace is ever printed.
 */
import type { Command } from "commander";

/** Options of {@link describeError}. */
export interface DescribeErrorOptions {
  /** Also name the error's class and code, e.g. `[EngineError BAD_INPUT]`. */
  verbose?: boolean;
}

/** Turns any thrown value into the one-line message the CLI prints (no stack dump). */
export function describeError(e: unknown, o: DescribeErrorOptions = {}): string {
  if (!(e instanceof Error)) return oneLine(String(e));
  const code = (e as { code?: unknown }).code;
  if (typeof code === "string" && code.startsWith("commander.") && !o.verbose) return oneLine(e.message);
  let message = e.message || (e.name && e.name !== "Error" ? e.name : "unknown error");
  // a TypeError or ReferenceError is a bug of ours, not the user's input: say so
  if (e instanceof TypeError || e instanceof ReferenceError)
    message = `${message} (an internal error: please report it, with the output of the same command with --verbose)`;
  if (!o.verbose) return oneLine(message);
  const tag = [e.name && e.name !== "Error" ? e.name : "", typeof code === "string" ? code : ""]
    .filter(Boolean)
    .join(" ");
  return oneLine(tag ? `${message} [${tag}]` : message);
}

/** One printable line of at most 500 characters: control characters escaped, the middle cut. */
function oneLine(s: string): string {
  const flat = s
    .replace(/\s*\n\s*/g, " ")
    .replace(/[\u0000-\u001f\u007f]/g, (c) => `\\x${c.charCodeAt(0).toString(16).padStart(2, "0")}`);
  return flat.length > 500 ? `${flat.slice(0, 350)} … ${flat.slice(-140)}` : flat;
}

/** Whether the command line asked for --verbose (for errors raised outside a command's action). */
export function verboseRequested(argv: readonly string[] = process.argv.slice(2)): boolean {
  return argv.some((a) => a === "--verbose" || a === "-v");
}

/**
 * Runs a command action; on error prints one line to stderr (see {@link describeError}; the command's
 * `--verbose` option adds the class and code) and sets exit code 1.
 */
export function action<A extends unknown[]>(fn: (...args: A) => Promise<void> | void): (...args: A) => Promise<void> {
  return async (...args: A) => {
    try {
      await fn(...args);
    } catch (e) {
      const cmd = args[args.length - 1] as Command | undefined;
      const verbose =
        cmd && typeof (cmd as Command).opts === "function" ? !!(cmd as Command).opts().verbose : verboseRequested();
      process.stderr.write(`powerinfer: ${describeError(e, { verbose })}\n`);
      process.exitCode = 1;
    }
  };
}
