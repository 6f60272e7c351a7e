/** Turns any thrown value into the one-line message the CLI prints (no stack dump). */
export function describeError(e: unknown): string {
  if (e instanceof Error) {
    const code = (e as { code?: unknown }).code;
    if (typeof code === "string" && code.startsWith("commander.")) return oneLine(e.message);
    const name = e.name && e.name !== "Error" ? e.name : "error";
    if (typeof code === "string" && code.startsWith("E") && code.length > 3 && /^E[A-Z]+$/.test(code)) {
      // Node fs errors, e.g. ENOENT
      return `${e.message}`;
    }
    return oneLine(`${name}${typeof code === "string" ? ` ${code}` : ""}: ${e.message}`);
  }
  return oneLine(String(e));
}

/** One printable line of at most 500 characters: control characters escaped, the middle cut. */
function oneLine(s: string): string {
  const flat = s
    .replace(/\s*\n\s*/g, " ")
    .replace(/[\u0000-\u001f\u007f]/g, (c) => `\\x${c.charCodeAt(0).toString(16).padStart(2, "0")}`);
  return flat.length > 500 ? `${flat.slice(0, 350)} … ${flat.slice(-140)}` : flat;
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
