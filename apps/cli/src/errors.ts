/** Turns any thrown value into the one-line message the CLI prints (no stack dump). */
export function describeError(e: unknown): string {
  if (e instanceof Error) {
    const code = (e as { code?: unknown }).code;
    const name = e.name && e.name !== "Error" ? e.name : "error";
    if (typeof code === "string" && code.startsWith("E") && code.length > 3 && /^E[A-Z]+$/.test(code)) {
      // Node fs errors, e.g. ENOENT
      return `${e.message}`;
    }
    return `${name}${typeof code === "string" ? ` ${code}` : ""}: ${e.message}`.replace(/\s*\n\s*/g, " ");
  }
  return String(e);
}

/** Runs a command action; on error prints one line to stderr and sets a non-zero exit code. */
export function action<A extends unknown[]>(fn: (...args: A) => Promise<void> | void): (...args: A) => Promise<void> {
  return async (...args: A) => {
    try {
      await fn(...args);
    } catch (e) {
      process.stderr.write(`powerinfer: ${describeError(e)}\n`);
      process.exitCode = 1;
    }
  };
}
