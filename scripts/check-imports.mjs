#!/usr/bin/env node
// Enforces the house's import direction (run by `pnpm lint`; import cycles are madge's part of the lint):
// - a package imports only workspace packages it declares in package.json, and no relative path leaves it;
// - the layers below import nothing from the layers above them (see README "Layout").
// Exit status 1 with one line per violation.
import { readdirSync, readFileSync, statSync } from "node:fs";
import { join, relative, resolve, sep } from "node:path";
import { fileURLToPath } from "node:url";

const root = resolve(fileURLToPath(new URL("..", import.meta.url)));

/**
 * Per source folder (relative to the repository root), the import specifiers it must not use. A prefix
 * "./" names a folder of the same package, anything else a package.
 */
const FORBIDDEN = {
  // the contract: no runtime dependency at all
  "packages/core/src/backend": ["@powerinfer/", "glpk.js", "@huggingface/", "zod", "packages/core/src/placement"],
  "packages/core/src/conformance": ["@powerinfer/", "glpk.js", "@huggingface/", "zod", "packages/core/src/placement"],
  "packages/core/src/reference": ["@powerinfer/", "glpk.js", "@huggingface/", "zod", "packages/core/src/placement"],
  "packages/core/src/native": ["@powerinfer/", "glpk.js", "@huggingface/", "zod", "packages/core/src/placement"],
  // the planner: GGUF's GPU index and the solver, nothing of the engine
  "packages/core/src/placement": [
    "@powerinfer/engine",
    "@powerinfer/tokenizer",
    "@powerinfer/synthetic",
    "@powerinfer/backend-",
  ],
  "packages/tokenizer/src": ["@powerinfer/"],
  "packages/synthetic/src": ["@powerinfer/core", "@powerinfer/engine", "@powerinfer/tokenizer", "@powerinfer/backend-"],
  // inside the engine, model graphs and grammars sit below sessions and generation
  "packages/engine/src/model": ["packages/engine/src/engine", "@powerinfer/backend-"],
  "packages/engine/src/grammar": ["packages/engine/src/engine", "packages/engine/src/model", "@powerinfer/backend-"],
  "packages/engine/src/engine": ["@powerinfer/backend-"],
  "packages/gguf/src": ["@powerinfer/"],
};

/** Exceptions, each with its reason. */
const ALLOWED = new Set([
  // the device kit bundles the GPU test suite to run it on a machine without Node (apps/device-kit/README.md)
  "apps/device-kit/src/checks.ts ../../../packages/backend-cuda/test/gpu-suite.ts",
]);

function walk(dir, out = []) {
  for (const name of readdirSync(dir)) {
    if (name === "node_modules" || name === "dist" || name === "build") continue;
    const p = join(dir, name);
    if (statSync(p).isDirectory()) walk(p, out);
    else if (/\.(ts|mts|mjs)$/.test(name) && !name.endsWith(".d.ts")) out.push(p);
  }
  return out;
}

const IMPORT = /(?:^|\n)\s*(?:import|export)\s[^;]*?from\s*"([^"]+)"|\bimport\s*\(?\s*"([^"]+)"/g;
const problems = [];
for (const group of ["packages", "apps"]) {
  for (const pkg of readdirSync(join(root, group))) {
    const pkgDir = join(root, group, pkg);
    let manifest;
    try {
      manifest = JSON.parse(readFileSync(join(pkgDir, "package.json"), "utf8"));
    } catch {
      continue;
    }
    const declared = new Set([
      manifest.name,
      ...Object.keys(manifest.dependencies ?? {}),
      ...Object.keys(manifest.devDependencies ?? {}),
      ...Object.keys(manifest.peerDependencies ?? {}),
    ]);
    for (const file of walk(pkgDir)) {
      const rel = relative(root, file).split(sep).join("/");
      const text = readFileSync(file, "utf8");
      for (const m of text.matchAll(IMPORT)) {
        const spec = m[1] ?? m[2];
        let target = spec;
        if (spec.startsWith(".")) {
          const abs = resolve(file, "..", spec);
          // tests and configs may share fixtures across packages; sources may not (but see ALLOWED)
          if (!abs.startsWith(pkgDir + sep) && rel.includes("/src/") && !ALLOWED.has(`${rel} ${spec}`)) {
            problems.push(`${rel}: relative import ${spec} leaves ${manifest.name}`);
            continue;
          }
          target = relative(root, abs).split(sep).join("/");
        } else if (spec.startsWith("@powerinfer/")) {
          const name = spec.split("/").slice(0, 2).join("/");
          if (!declared.has(name))
            problems.push(`${rel}: imports ${name}, not declared in ${manifest.name}'s package.json`);
        }
        for (const [folder, banned] of Object.entries(FORBIDDEN)) {
          if (!rel.startsWith(`${folder}/`)) continue;
          for (const b of banned) {
            if (target.startsWith(b)) problems.push(`${rel}: imports ${spec} (${folder} must not import ${b})`);
          }
        }
      }
    }
  }
}
for (const p of problems) console.error(p);
if (problems.length) {
  console.error(`check-imports: ${problems.length} import(s) against the house's direction`);
  process.exit(1);
}
console.log("check-imports: every import runs downwards and is declared");
