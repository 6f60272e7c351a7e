// Records the version and commit the server was built from in dist/build-info.json (read by src/build-info.ts
// where no git checkout is at hand at run time).
import { execFileSync } from "node:child_process";
import { mkdirSync, readFileSync, writeFileSync } from "node:fs";

const pkg = JSON.parse(readFileSync(new URL("../package.json", import.meta.url), "utf8"));
let commit = "unknown";
try {
  commit = execFileSync("git", ["rev-parse", "--short=7", "HEAD"], {
    encoding: "utf8",
    stdio: ["ignore", "pipe", "ignore"],
  }).trim();
} catch {
  // no git: the server reports "unknown"
}
mkdirSync(new URL("../dist/", import.meta.url), { recursive: true });
writeFileSync(
  new URL("../dist/build-info.json", import.meta.url),
  `${JSON.stringify({ version: pkg.version, commit })}\n`,
);
