import { fileURLToPath } from "node:url";
import { defineProject } from "vitest/config";

const root = fileURLToPath(new URL(".", import.meta.url));
const pkgs = [
  "core",
  "gguf",
  "tokenizer",
  "engine",
  "synthetic",
  "predictor",
  "backend-cpu-avx2",
  "backend-cuda",
  "backend-rocm",
];

/** Per-package vitest project; workspace packages resolve to their TypeScript sources. */
export function project(name: string, extra: { testTimeout?: number } = {}) {
  return defineProject({
    resolve: {
      alias: [
        { find: /^@powerinfer\/core\/placement$/, replacement: `${root}packages/core/src/placement/index.ts` },
        ...pkgs.map((p) => ({
          find: new RegExp(`^@powerinfer/${p}$`),
          replacement: `${root}packages/${p}/src/index.ts`,
        })),
      ],
    },
    test: {
      name,
      include: ["test/**/*.test.ts"],
      testTimeout: extra.testTimeout ?? 60_000,
      env: { POWERINFER_TEST_MODELS: process.env.POWERINFER_TEST_MODELS ?? `${root}../shared/models` },
    },
  });
}
