import { project } from "../../vitest.shared.ts";

export default project("backend-cpu-avx2", { testTimeout: 300_000 });
