/**
 * Wires the backend packages into core's registry (core knows no concrete backend), plus the backends
 * named by `POWERINFER_BACKENDS` and the configuration file (core's discovery; see README "Backends").
 */
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import { cudaBackend } from "@powerinfer/backend-cuda";
import { rocmBackend } from "@powerinfer/backend-rocm";
import { InvalidArgumentError } from "commander";
import {
  type Backend,
  type BackendLoadOptions,
  discoverBackends,
  REFERENCE_BACKEND_NAME,
  referenceBackend,
  registry,
} from "@powerinfer/core";

let registered = false;

/** Registers every backend package this CLI ships. Idempotent. */
export function registerBackends(): typeof registry {
  if (!registered) {
    registry.register(cpuBackend, 0);
    registry.register(cudaBackend, 0);
    registry.register(rocmBackend, 0);
    // core's float64 reference backend: chosen only by name (never by "auto": far too slow for real models)
    registry.register(referenceBackend, -1);
    registered = true;
  }
  return registry;
}

let discovered: Promise<typeof registry> | undefined;

/**
 * {@link registerBackends}, then the third-party backends of `POWERINFER_BACKENDS` and the configuration
 * file (imported once per process; one that cannot be imported is listed as unavailable with the error).
 * @throws BackendError 'BAD_CONFIG' for a malformed configuration file.
 */
export function registerAllBackends(): Promise<typeof registry> {
  discovered ??= (async () => {
    const reg = registerBackends();
    await discoverBackends(reg);
    return reg;
  })();
  return discovered;
}

/**
 * Loads the backend the user asked for: "auto" or a comma-separated list of names; `POWERINFER_BACKEND` overrides.
 * Skipped candidates are reported through `log`.
 */
export async function loadBackend(
  choice: string,
  options: BackendLoadOptions,
  log: (line: string) => void,
): Promise<Backend> {
  const reg = await registerAllBackends();
  const names = choice
    .split(",")
    .map((s) => s.trim())
    .filter(Boolean);
  if (choice !== "auto" && names.length === 0)
    throw new InvalidArgumentError(
      `--backend must be "auto" or a comma-separated list of backend names, got "${choice}"`,
    );
  const prefer = choice === "auto" ? "auto" : names;
  const exclude = prefer === "auto" ? [REFERENCE_BACKEND_NAME] : [];
  const quiet = (line: string) => {
    if (line !== `${REFERENCE_BACKEND_NAME}: excluded`) log(line);
  };
  const { backend } = await reg.load({ prefer, exclude, log: quiet }, options);
  return backend;
}

/**
 * The backend that holds hot neurons: with "auto", the best usable GPU backend (none → undefined, all
 * FFN on the CPU); with a name, that backend (e.g. "cpu" as a stand-in device for tests).
 */
export async function loadDeviceBackend(
  choice: string,
  options: BackendLoadOptions,
  log: (line: string) => void,
): Promise<Backend | undefined> {
  const reg = await registerAllBackends();
  if (choice !== "auto") return (await reg.load({ prefer: [choice], log, env: {} }, options)).backend;
  for (const b of await reg.list()) {
    if (b.probe.usable && b.probe.devices.some((d) => d.kind === "gpu")) {
      try {
        return (await reg.load({ prefer: [b.name], env: {} }, options)).backend;
      } catch (e) {
        // an automatic choice that fails to load is skipped: the run goes on with the next one, or on the CPU
        log(`${b.name}: unavailable: ${(e as Error).message}`);
        continue;
      }
    }
    if (!b.probe.usable) log(`${b.name}: ${b.probe.reason}`);
  }
  return undefined;
}
