/** `powerinfer backends`: every registered backend, usable or not, with its devices and reasons. */
import { type BackendStatus, formatConformancePerf, runConformancePerf } from "@powerinfer/core";
import { type Command, InvalidArgumentError } from "commander";
import { loadBackend, registerAllBackends } from "../backends.js";
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
    .option(
      "--perf <names>",
      "the conformance kit's perf mode: time every op and dtype the named backends (comma-separated) claim, beside --baseline",
    )
    .option("--baseline <name>", "the backend shown beside in --perf", "cpu")
    .option("--perf-size <n>", "size parameter of the perf shapes (multiple of 256)", "1024")
    .option("--perf-repeats <n>", "timed computes per op (median reported)", "5")
    .action(
      action(async (o: { json?: boolean; perf?: string; baseline: string; perfSize: string; perfRepeats: string }) => {
        if (o.perf !== undefined) {
          const size = Number(o.perfSize);
          const repeats = Number(o.perfRepeats);
          if (!Number.isInteger(size) || size < 256 || size > 16384 || size % 256 !== 0)
            throw new InvalidArgumentError(
              `--perf-size must be a positive multiple of 256, at most 16384, got ${o.perfSize}`,
            );
          if (!Number.isInteger(repeats) || repeats < 1)
            throw new InvalidArgumentError(`--perf-repeats must be an integer ≥ 1, got ${o.perfRepeats}`);
          const names = o.perf
            .split(",")
            .map((s) => s.trim())
            .filter(Boolean);
          if (names.length === 0) throw new InvalidArgumentError("--perf needs at least one backend name");
          const baseline = await loadBackend(o.baseline, { threads: 1 }, () => {});
          const reports = [];
          for (const name of names) {
            const backend = await loadBackend(name, {}, () => {});
            reports.push(await runConformancePerf(backend, { baseline, size, repeats }));
            backend.dispose();
          }
          baseline.dispose();
          process.stdout.write(
            o.json ? `${JSON.stringify(reports, null, 2)}\n` : `${reports.map(formatConformancePerf).join("\n\n")}\n`,
          );
          return;
        }
        const list = await (await registerAllBackends()).list();
        process.stdout.write(o.json ? `${JSON.stringify(list, null, 2)}\n` : `${formatBackends(list)}\n`);
      }),
    );
}
