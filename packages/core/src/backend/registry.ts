/**
 * The backend registry: packages register descriptors; apps select one by `"auto"`, by an ordered
 * list of names, or by the `POWERINFER_BACKEND` environment variable (a comma-separated list, which
 * overrides the caller's choice). Nothing here imports a concrete backend.
 */
import {
  BACKEND_API_VERSION,
  type Backend,
  type BackendDescriptor,
  BackendError,
  type BackendLoadOptions,
  type ProbeResult,
} from "./types.js";

/** What {@link BackendRegistry.list} reports per registered backend. */
export interface BackendStatus {
  name: string;
  priority: number;
  probe: ProbeResult;
}

/** How to pick a backend. */
export interface BackendSelection {
  /** "auto" (default): the usable backend with the highest score, then priority; or names in order of preference. */
  prefer?: "auto" | readonly string[];
  /** Names never to pick. */
  exclude?: readonly string[];
  /** Receives one line per candidate skipped, with its reason. */
  log?: (line: string) => void;
  /** Environment to read `POWERINFER_BACKEND` from. Default: process.env. */
  env?: Record<string, string | undefined>;
}

export interface SelectedBackend {
  descriptor: BackendDescriptor;
  probe: ProbeResult;
  /** One line per candidate skipped, e.g. "cuda: unavailable: no NVIDIA driver". */
  skipped: string[];
}

/** How long a probe may take before its backend is reported unavailable (ms). */
export const PROBE_TIMEOUT_MS = 10_000;

const describe = (e: unknown) => (e instanceof Error ? e.message : String(e));

/** Why a probe's result is not a {@link ProbeResult}, or undefined when it is one. */
function badProbeResult(r: unknown): string | undefined {
  if (typeof r !== "object" || r === null) return `returned ${r === null ? "null" : typeof r}`;
  const p = r as Partial<ProbeResult>;
  if (typeof p.usable !== "boolean") return `"usable" is ${JSON.stringify(p.usable) ?? "missing"}, not a boolean`;
  if (typeof p.score !== "number" || !Number.isFinite(p.score)) return `"score" is not a finite number`;
  if (typeof p.reason !== "string") return `"reason" is not a string`;
  if (!Array.isArray(p.devices)) return `"devices" is not a list`;
  for (const d of p.devices) {
    if (
      typeof d !== "object" ||
      d === null ||
      (d.kind !== "cpu" && d.kind !== "gpu") ||
      typeof d.name !== "string" ||
      !Number.isFinite(d.freeMemory) ||
      !Number.isFinite(d.totalMemory)
    ) {
      return "a device is not { kind: cpu|gpu, name, freeMemory, totalMemory }";
    }
  }
  return undefined;
}

/** A descriptor's probe, never throwing, never hanging: a fault or a malformed result is "unavailable". */
async function safeProbe(d: BackendDescriptor): Promise<ProbeResult> {
  const unavailable = (reason: string): ProbeResult => ({
    usable: false,
    score: 0,
    reason: `unavailable: ${reason}`,
    devices: [],
  });
  if (d.apiVersion !== BACKEND_API_VERSION) {
    return unavailable(`implements backend API v${d.apiVersion}, core expects v${BACKEND_API_VERSION}`);
  }
  let timer: ReturnType<typeof setTimeout> | undefined;
  try {
    const r = await Promise.race([
      Promise.resolve().then(() => d.probe()),
      new Promise<"timeout">((resolve) => {
        timer = setTimeout(() => resolve("timeout"), PROBE_TIMEOUT_MS);
      }),
    ]);
    if (r === "timeout") return unavailable(`probe did not answer within ${PROBE_TIMEOUT_MS / 1000} s`);
    const bad = badProbeResult(r);
    return bad ? unavailable(`probe result is malformed: ${bad}`) : r;
  } catch (e) {
    return unavailable(`probe failed: ${describe(e)}`);
  } finally {
    clearTimeout(timer);
  }
}

export class BackendRegistry {
  private readonly entries = new Map<string, { descriptor: BackendDescriptor; priority: number }>();

  /**
   * Adds a backend. A later registration under the same name replaces the earlier one.
   * @param priority breaks ties between equal probe scores (higher wins). Default 0.
   */
  register(descriptor: BackendDescriptor, priority = 0): void {
    this.entries.set(descriptor.name, { descriptor, priority });
  }

  unregister(name: string): boolean {
    return this.entries.delete(name);
  }

  names(): string[] {
    return [...this.entries.keys()];
  }

  get(name: string): BackendDescriptor | undefined {
    return this.entries.get(name)?.descriptor;
  }

  /** Probes every registered backend (never throws), best first. */
  async list(): Promise<BackendStatus[]> {
    const out: BackendStatus[] = [];
    for (const [name, e] of this.entries)
      out.push({ name, priority: e.priority, probe: await safeProbe(e.descriptor) });
    return out.sort(
      (a, b) =>
        Number(b.probe.usable) - Number(a.probe.usable) || b.probe.score - a.probe.score || b.priority - a.priority,
    );
  }

  /**
   * Picks a backend.
   * @throws BackendError 'UNAVAILABLE' when no candidate is usable; the message lists every reason.
   */
  async select(sel: BackendSelection = {}): Promise<SelectedBackend> {
    const env = sel.env ?? process.env;
    const envPref = env["POWERINFER_BACKEND"]?.trim();
    const prefer =
      envPref && envPref !== "auto"
        ? envPref
            .split(",")
            .map((s) => s.trim())
            .filter(Boolean)
        : envPref
          ? "auto"
          : (sel.prefer ?? "auto");
    if (prefer !== "auto" && prefer.length === 0) {
      throw new BackendError(
        "BAD_CONFIG",
        `${envPref !== undefined && envPref !== "" ? "POWERINFER_BACKEND" : "the backend choice"} names no backend (give "auto" or a comma-separated list of names)`,
      );
    }
    const exclude = new Set(sel.exclude ?? []);
    const skipped: string[] = [];
    const skip = (line: string) => {
      skipped.push(line);
      sel.log?.(line);
    };
    let candidates: BackendStatus[];
    if (prefer === "auto") {
      candidates = await this.list();
    } else {
      candidates = [];
      for (const name of prefer) {
        const e = this.entries.get(name);
        if (!e) {
          skip(`${name}: not registered (registered: ${this.names().join(", ") || "none"})`);
          continue;
        }
        candidates.push({ name, priority: e.priority, probe: await safeProbe(e.descriptor) });
      }
    }
    // Every unusable or excluded candidate is logged, also those ranked below the pick.
    let pick: BackendStatus | undefined;
    for (const c of candidates) {
      if (exclude.has(c.name)) {
        skip(`${c.name}: excluded`);
        continue;
      }
      if (!c.probe.usable) {
        const r = c.probe.reason.startsWith("unavailable") ? c.probe.reason : `unavailable: ${c.probe.reason}`;
        skip(`${c.name}: ${r}`);
        continue;
      }
      pick ??= c;
    }
    if (pick) return { descriptor: this.entries.get(pick.name)!.descriptor, probe: pick.probe, skipped };
    throw new BackendError("UNAVAILABLE", `no usable backend${skipped.length ? `: ${skipped.join("; ")}` : ""}`);
  }

  /** {@link select} then `load`. */
  async load(
    sel: BackendSelection = {},
    options?: BackendLoadOptions,
  ): Promise<{ backend: Backend } & SelectedBackend> {
    const s = await this.select(sel);
    let backend: Backend;
    try {
      backend = await s.descriptor.load(options);
    } catch (e) {
      if (e instanceof BackendError) {
        throw e.message.startsWith(`${s.descriptor.name}:`)
          ? e
          : new BackendError(e.code, `${s.descriptor.name}: ${e.message}`);
      }
      throw new BackendError("UNAVAILABLE", `${s.descriptor.name}: load failed: ${describe(e)}`);
    }
    const missing = [
      "createTensor",
      "mapTensor",
      "readTensor",
      "writeTensor",
      "freeTensor",
      "supportsOp",
      "compute",
      "computeAsync",
      "dispose",
      "allocatedBytes",
    ].filter((m) => typeof (backend as unknown as Record<string, unknown>)?.[m] !== "function");
    if (missing.length > 0) {
      throw new BackendError(
        "UNAVAILABLE",
        `${s.descriptor.name}: load() did not return a Backend (missing ${missing.join(", ")})`,
      );
    }
    return { ...s, backend };
  }
}

/** The process-wide registry the apps register their backends in. */
export const registry = new BackendRegistry();
