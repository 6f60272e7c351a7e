import { readFileSync } from "node:fs";

/**
 * The AMD GPU targets whose code objects an ELF file (the addon) embeds: clang's offload bundles name
 * each one `hipv4-amdgcn-amd-amdhsa--<gfx>` (plus feature suffixes such as `:xnack-`). Sorted, unique.
 */
export function rocmTargets(path: string): string[] {
  const text = readFileSync(path).toString("latin1");
  const found = new Set<string>();
  for (const m of text.matchAll(/amdgcn-amd-amdhsa--(gfx[0-9a-f]+)/g)) found.add(m[1]!);
  return [...found].sort();
}
