import { project } from "../../vitest.shared.ts";

// Building the kit compresses a Node binary and runs its CPU checks: minutes on 2 cores.
export default project("device-kit", { testTimeout: 1_200_000 });
