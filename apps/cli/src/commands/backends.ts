/** `powerinfer backends`: every registered backend, usable or not, with its devices and reasons. */
import type { BackendStatus } from "@powerinfer/core";
import type { Command } from "commander";
import { registerAllBackends } from "../backends.js";
import { action } from "../errors.js";

const gib = (b: number) => `${(b / 2 ** 30).toFixed(1)} GiB`;

/** The report as text (one block per backend). */
export function formatBackends(list: BackendStatus[]): string {
  const lines: string[] = [];
  for (const b of list) {
    const p = b.probe;
    lines.push(
      `${b.name}: ${p.usable ? "usable" : "not usable"} (score ${p.score}, priority ${b.priority}) — ${p.reason}`,
    );
    for (const d of p.devices) {
      lines.push(`  ${d.kind} ${d.name}: ${gib(d.freeMemory)} free / ${gib(d.totalMemory)} total`);
    }
  }
  return lines.join("\n");
}

export function register(program: Command): void {
  program
    .command("backends")
    .description(
      "list the backends (built in, POWERINFER_BACKENDS and the configuration file's), whether each is usable, and why not",
    )
    .option("--json", "print JSON")
    .action(
      action(async (o: { json?: boolean }) => {
        const list = await (await registerAllBackends()).list();
        process.stdout.write(o.json ? `${JSON.stringify(list, null, 2)}\n` : `${formatBackends(list)}\n`);
      }),
    );
}
