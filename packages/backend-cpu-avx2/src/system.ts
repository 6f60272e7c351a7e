/** Host facts for the probe and defaults: CPU model, memory, physical core count. Never throw. */
import { readdirSync, readFileSync } from "node:fs";
import os from "node:os";

function read(path: string): string | undefined {
  try {
    return readFileSync(path, "utf8");
  } catch {
    return undefined;
  }
}

/** The CPU model name (`model name` of /proc/cpuinfo, else os.cpus()). */
export function cpuModelName(): string {
  const info = read("/proc/cpuinfo");
  const m = info?.match(/^model name\s*:\s*(.+)$/m);
  if (m) return m[1]!.trim();
  return os.cpus()[0]?.model?.trim() || `${os.arch()} CPU`;
}

/** Available and total system memory in bytes (MemAvailable of /proc/meminfo, else os.freemem()). */
export function systemMemory(): { free: number; total: number } {
  const info = read("/proc/meminfo");
  const kb = (key: string) => {
    const m = info?.match(new RegExp(`^${key}:\\s*(\\d+)\\s*kB`, "m"));
    return m ? Number(m[1]) * 1024 : undefined;
  };
  return { free: kb("MemAvailable") ?? os.freemem(), total: kb("MemTotal") ?? os.totalmem() };
}

/**
 * Physical cores usable by this process: distinct (package, core) pairs in /sys topology, capped by
 * os.availableParallelism() (which honours the affinity mask). Without /sys: availableParallelism(),
 * halved when it is even and > 2 on x86 (an SMT guess).
 */
export function physicalCores(): number {
  const avail = os.availableParallelism();
  try {
    const base = "/sys/devices/system/cpu";
    const cores = new Set<string>();
    for (const d of readdirSync(base)) {
      if (!/^cpu\d+$/.test(d)) continue;
      const online = read(`${base}/${d}/online`);
      if (online !== undefined && online.trim() === "0") continue;
      const core = read(`${base}/${d}/topology/core_id`);
      const pkg = read(`${base}/${d}/topology/physical_package_id`);
      if (core === undefined) continue;
      cores.add(`${pkg?.trim() ?? "0"}:${core.trim()}`);
    }
    if (cores.size > 0) return Math.max(1, Math.min(cores.size, avail));
  } catch {
    // fall through to the guess
  }
  const smtGuess = (os.arch() === "x64" || os.arch() === "ia32") && avail > 2 && avail % 2 === 0;
  return Math.max(1, smtGuess ? avail / 2 : avail);
}
