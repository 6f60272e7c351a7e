import { project } from "../../vitest.shared.ts";

export default project("backend-cuda", { testTimeout: 300_000 });
