/**
 * Finding backends that are not built in, without editing the app that uses them:
 *
 * - `POWERINFER_BACKENDS`: comma-separated entries, each a package name (resolved from the current
 *   directory's `node_modules`, walking up) or a folder path (absolute, or starting with `.` or `/`,
 *   resolved against the current directory) holding a package;
 * - the `backends` list of the configuration file: `POWERINFER_CONFIG` when set, else `powerinfer.json` in
 *   the current directory, else `$XDG_CONFIG_HOME/powerinfer/config.json` (`~/.config/...`). Its format:
 *   `{ "backends": ["my-backend", "./vendor/fpga-backend"] }`; folder paths in it are relative to the file.
 *
 * A package is imported through its `exports["."]` (`import` or `default` condition, or a string), else
 * `main`, else `index.js`; every export that is a {@link BackendDescriptor} (its default export first) is
 * registered. An entry that cannot be imported, or exports no descriptor, is registered as an unavailable
 * backend named after the entry, whose probe gives the error, so `powerinfer backends` lists it. A discovered
 * backend never replaces one already registered (the built-in ones): its name must be new. Importing and
 * probing each have a 10 s limit.
 */
import { existsSync, readFileSync, statSync } from "node:fs";
import { homedir } from "node:os";
import { dirname, isAbsolute, join, resolve } from "node:path";
import { pathToFileURL } from "node:url";
import type { BackendRegistry } from "./registry.js";
import { BACKEND_API_VERSION, type BackendDescriptor, BackendError } from "./types.js";

/** One entry of `POWERINFER_BACKENDS` or of the configuration file, and what came of it. */
export interface DiscoveredBackend {
  /** The entry as written. */
  entry: string;
  /** Where it was written: "POWERINFER_BACKENDS" or the configuration file's path. */
  from: string;
  /** The descriptors it exports (empty when it failed). */
  descriptors: BackendDescriptor[];
  /** Why it could not be used, when it could not. */
  error?: string;
}

export interface DiscoveryOptions {
  /** Default: process.env. */
  env?: Record<string, string | undefined>;
  /** Where package names and relative folders are resolved from. Default: process.cwd(). */
  cwd?: string;
}

/**
 * The configuration file in effect and its `backends` list.
 * @throws BackendError 'BAD_CONFIG' when the file exists but is not JSON of that shape, or when
 *   `POWERINFER_CONFIG` names a file that does not exist.
 */
export function readBackendConfig(options: DiscoveryOptions = {}): { path?: string; backends: string[] } {
  const env = options.env ?? process.env;
  const cwd = options.cwd ?? process.cwd();
  const explicit = env["POWERINFER_CONFIG"]?.trim();
  const xdg = env["XDG_CONFIG_HOME"]?.trim() || join(homedir(), ".config");
  const candidates = explicit
    ? [resolve(cwd, explicit)]
    : [join(cwd, "powerinfer.json"), join(xdg, "powerinfer", "config.json")];
  if (explicit && !existsSync(candidates[0]!)) {
    throw new BackendError("BAD_CONFIG", `POWERINFER_CONFIG names ${candidates[0]}, which does not exist`);
  }
  const path = candidates.find((p) => existsSync(p));
  if (!path) return { backends: [] };
  if (statSync(path).isDirectory())
    throw new BackendError("BAD_CONFIG", `${path} is a folder, not a configuration file`);
  let json: unknown;
  try {
    json = JSON.parse(readFileSync(path, "utf8"));
  } catch (e) {
    throw new BackendError("BAD_CONFIG", `${path}: not valid JSON (${(e as Error).message})`);
  }
  if (typeof json !== "object" || json === null || Array.isArray(json)) {
    throw new BackendError("BAD_CONFIG", `${path}: must be a JSON object such as {"backends": ["my-backend"]}`);
  }
  const unknown = Object.keys(json).filter((k) => k !== "backends");
  if (unknown.length > 0) {
    throw new BackendError(
      "BAD_CONFIG",
      `${path}: unknown key${unknown.length > 1 ? "s" : ""} ${unknown.map((k) => JSON.stringify(k)).join(", ")} (the file holds {"backends": [...]})`,
    );
  }
  const list = (json as { backends?: unknown }).backends;
  if (list === undefined) return { path, backends: [] };
  if (!Array.isArray(list) || list.some((x) => typeof x !== "string" || x.trim() === "")) {
    throw new BackendError("BAD_CONFIG", `${path}: "backends" must be a list of package names or folder paths`);
  }
  return { path, backends: list.map((x: string) => x.trim()) };
}

const isFolderEntry = (entry: string) => isAbsolute(entry) || entry.startsWith(".") || entry.startsWith("/");

/** The file a package folder's `import` resolves to. @throws Error naming what is missing. */
function packageEntryFile(dir: string): string {
  const manifestPath = join(dir, "package.json");
  if (!existsSync(manifestPath)) {
    const index = join(dir, "index.js");
    if (existsSync(index)) return index;
    throw new Error(`${dir} has no package.json and no index.js`);
  }
  const manifest = JSON.parse(readFileSync(manifestPath, "utf8")) as {
    exports?: unknown;
    main?: string;
  };
  const pick = (e: unknown): string | undefined => {
    if (typeof e === "string") return e;
    if (e && typeof e === "object") {
      const o = e as Record<string, unknown>;
      if ("." in o) return pick(o["."]);
      return pick(o["import"]) ?? pick(o["node"]) ?? pick(o["default"]);
    }
    return undefined;
  };
  const rel = pick(manifest.exports) ?? manifest.main ?? "index.js";
  const file = resolve(dir, rel);
  if (!existsSync(file)) throw new Error(`${manifestPath} points at ${rel}, which does not exist (not built?)`);
  return file;
}

/** The folder of package `name`, looked up in node_modules from `cwd` upwards. */
function findPackage(name: string, cwd: string): string | undefined {
  for (let dir = resolve(cwd); ; dir = dirname(dir)) {
    const candidate = join(dir, "node_modules", name);
    if (existsSync(join(candidate, "package.json"))) return candidate;
    if (dirname(dir) === dir) return undefined;
  }
}

/** How long importing one entry may take (ms). */
const IMPORT_TIMEOUT_MS = 10_000;

/** True for an object with the shape of a {@link BackendDescriptor}. */
export function isBackendDescriptor(x: unknown): x is BackendDescriptor {
  const d = x as BackendDescriptor;
  return (
    typeof d === "object" &&
    d !== null &&
    typeof d.name === "string" &&
    typeof d.apiVersion === "number" &&
    typeof d.probe === "function" &&
    typeof d.load === "function"
  );
}

/** Imports one entry. Never throws: a failure is returned as `error`. */
export async function importBackendEntry(entry: string, from: string, baseDir: string): Promise<DiscoveredBackend> {
  try {
    let dir: string;
    if (isFolderEntry(entry)) {
      dir = resolve(baseDir, entry);
      if (!existsSync(dir) || !statSync(dir).isDirectory()) throw new Error(`no folder ${dir}`);
    } else {
      const found = findPackage(entry, baseDir);
      if (!found) throw new Error(`package ${entry} is not installed (looked in node_modules from ${baseDir} up)`);
      dir = found;
    }
    let timer: ReturnType<typeof setTimeout> | undefined;
    const imported = await Promise.race([
      import(pathToFileURL(packageEntryFile(dir)).href),
      new Promise<"timeout">((resolve) => {
        timer = setTimeout(() => resolve("timeout"), IMPORT_TIMEOUT_MS);
      }),
    ]).finally(() => clearTimeout(timer));
    if (imported === "timeout") throw new Error(`importing it did not finish within ${IMPORT_TIMEOUT_MS / 1000} s`);
    const mod = imported as Record<string, unknown>;
    const descriptors: BackendDescriptor[] = [];
    const seen = new Set<string>();
    for (const value of [mod["default"], ...Object.values(mod)]) {
      if (isBackendDescriptor(value) && !seen.has(value.name)) {
        seen.add(value.name);
        descriptors.push(value);
      }
    }
    if (descriptors.length === 0) throw new Error("it exports no backend descriptor (name, apiVersion, probe, load)");
    return { entry, from, descriptors };
  } catch (e) {
    const message = e instanceof Error ? e.message : String(e);
    return { entry, from, descriptors: [], error: message.split("\n")[0] };
  }
}

/** A descriptor that reports why an entry is unusable (so listings show it). */
function unavailable(d: DiscoveredBackend): BackendDescriptor {
  return {
    name: d.entry,
    apiVersion: BACKEND_API_VERSION,
    probe: () => ({
      usable: false,
      score: 0,
      reason: `unavailable: cannot import ${d.entry} (from ${d.from}): ${d.error}`,
      devices: [],
    }),
    load: () => Promise.reject(new BackendError("UNAVAILABLE", `${d.entry}: ${d.error}`)),
  };
}

/**
 * Imports every backend named by `POWERINFER_BACKENDS` and the configuration file and registers it in
 * `registry` (priority 0; a name already registered is replaced). Returns what happened per entry.
 * @throws BackendError 'BAD_CONFIG' for a malformed configuration file (see {@link readBackendConfig}).
 */
export async function discoverBackends(
  registry: BackendRegistry,
  options: DiscoveryOptions = {},
): Promise<DiscoveredBackend[]> {
  const env = options.env ?? process.env;
  const cwd = options.cwd ?? process.cwd();
  const out: DiscoveredBackend[] = [];
  const fromEnv = (env["POWERINFER_BACKENDS"] ?? "")
    .split(",")
    .map((s) => s.trim())
    .filter(Boolean);
  for (const entry of fromEnv) out.push(await importBackendEntry(entry, "POWERINFER_BACKENDS", cwd));
  const config = readBackendConfig({ env, cwd });
  for (const entry of config.backends) out.push(await importBackendEntry(entry, config.path!, dirname(config.path!)));
  // a discovered backend never replaces one registered before discovery (a built-in) or an earlier entry's
  const taken = new Set(registry.names());
  for (const d of out) {
    for (const desc of d.descriptors) {
      if (taken.has(desc.name) || desc.name.trim() === "") {
        d.error =
          desc.name.trim() === ""
            ? "it exports a backend with an empty name"
            : `it exports backend "${desc.name}", a name already taken (rename it)`;
        continue;
      }
      taken.add(desc.name);
      registry.register(desc);
    }
    if (d.error) {
      const placeholder = unavailable(d);
      const name = taken.has(d.entry) ? `${d.entry} (${d.from})` : d.entry;
      taken.add(name);
      registry.register({ ...placeholder, name });
    }
  }
  return out;
}
