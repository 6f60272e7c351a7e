/**
 * The build the server reports, in llama.cpp's shape (`system_fingerprint`, `/props` `build_info`):
 * "b" + version + "-" + short commit, e.g. "b0.1.0-f597270".
 */
import { execFileSync } from "node:child_process";
import { readFileSync } from "node:fs";
import { dirname } from "node:path";
import { fileURLToPath } from "node:url";

let cached: string | undefined;

function readJson(rel: string): Record<string, unknown> | undefined {
  try {
    return JSON.parse(readFileSync(new URL(rel, import.meta.url), "utf8")) as Record<string, unknown>;
  } catch {
    return undefined;
  }
}

/** The short commit of the checkout this module lives in, when git is there to say. */
function gitCommit(): string | undefined {
  try {
    const dir = dirname(fileURLToPath(import.meta.url));
    // an installed copy: any repository around it is someone else's
    if (dir.split(/[\\/]/).includes("node_modules")) return undefined;
    const out = execFileSync("git", ["rev-parse", "--short=7", "HEAD"], {
      cwd: dir,
      encoding: "utf8",
      stdio: ["ignore", "pipe", "ignore"],
      timeout: 2000,
    }).trim();
    return /^[0-9a-f]{7,40}$/.test(out) ? out : undefined;
  } catch {
    return undefined;
  }
}

/**
 * "b<version>-<commit>". The commit is the checkout's (git, when the server runs from one), else the one
 * `scripts/build-info.mjs` recorded at build time (dist/build-info.json), else "unknown"; the version is the
 * server package's.
 */
export function buildInfo(): string {
  if (cached !== undefined) return cached;
  const built = readJson("./build-info.json") ?? readJson("../dist/build-info.json");
  const pkg = readJson("../package.json");
  const version =
    (typeof pkg?.version === "string" ? pkg.version : undefined) ??
    (typeof built?.version === "string" ? built.version : undefined) ??
    "0.0.0";
  const commit = gitCommit() ?? (typeof built?.commit === "string" ? built.commit : undefined) ?? "unknown";
  cached = `b${version}-${commit}`;
  return cached;
}
