import { project } from "../../vitest.shared.ts";

export default project("backend-rocm", { testTimeout: 300_000 });
