import { defineConfig } from "vitest/config";

// One vitest run over every package (vitest "projects", not the deprecated workspace file).
export default defineConfig({
  test: {
    projects: ["packages/*/vitest.config.ts", "apps/*/vitest.config.ts"],
  },
});
