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

/**
 * The memory cgroups this process is in that limit memory: for each, the limit and the current usage in
 * bytes (v2 `memory.max` and `memory.current`; v1 `memory.limit_in_bytes` and `memory.usage_in_bytes`).
 * A group without a limit ("max", or v1's 2^63-ish "unlimited") is left out; empty when none or unreadable.
 * A group's usage counts its page cache.
 */
export function cgroupMemory(): { limit: number; usage: number }[] {
  const out: { limit: number; usage: number }[] = [];
  const groups = read("/proc/self/cgroup") ?? "";
  for (const line of groups.split("\n")) {
    const [, controllers, path] = line.split(":");
    if (path === undefined) continue;
    const files =
      controllers === ""
        ? [`/sys/fs/cgroup${path}/memory.max`, `/sys/fs/cgroup${path}/memory.current`]
        : controllers!.split(",").includes("memory")
          ? [`/sys/fs/cgroup/memory${path}/memory.limit_in_bytes`, `/sys/fs/cgroup/memory${path}/memory.usage_in_bytes`]
          : undefined;
    if (!files) continue;
    const limit = Number(read(files[0]!)?.trim());
    if (!Number.isFinite(limit) || limit <= 0 || limit >= 2 ** 60) continue;
    const usage = Number(read(files[1]!)?.trim());
    out.push({ limit, usage: Number.isFinite(usage) ? usage : 0 });
  }
  return out;
}

/** The smallest memory limit of this process's cgroups in bytes ({@link cgroupMemory}), undefined when none. */
export function cgroupMemoryLimit(): number | undefined {
  const limits = cgroupMemory().map((g) => g.limit);
  return limits.length ? Math.min(...limits) : undefined;
}

/**
 * Bytes this process can still take before memory runs short: MemAvailable of /proc/meminfo, lowered to the
 * room left in the process's memory cgroups (limit − usage, {@link cgroupMemory}). A cgroup's usage counts
 * its page cache, so this errs low.
 */
export function availableMemory(): number {
  let free = systemMemory().free;
  for (const g of cgroupMemory()) free = Math.min(free, Math.max(0, g.limit - g.usage));
  return free;
}

/**
 * Whether the kernel gives transparent huge pages to memory advised for them (MADV_HUGEPAGE):
 * /sys/kernel/mm/transparent_hugepage/enabled is `[always]` or `[madvise]`.
 */
export function transparentHugePages(): boolean {
  const v = read("/sys/kernel/mm/transparent_hugepage/enabled");
  return !!v && /\[(always|madvise)\]/.test(v);
}
