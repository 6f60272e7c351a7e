/** `powerinfer plan`: the neuron placement plan for a device memory budget, explained, without running. */
import { explainPlan } from "@powerinfer/core/placement";
import { resolvePlan } from "@powerinfer/engine";
import { type Command, InvalidArgumentError } from "commander";
import { loadBackend } from "../backends.js";
import { action } from "../errors.js";
import { choice, float, int, loadModelFromCli, type ModelCliOptions, modelOptions } from "./common.js";

export interface PlanCliOptions {
  vramBudget?: number;
  deviceBackend: string;
  stats?: string;
  gpuIndex?: string;
  resetGpuIndex?: boolean;
  solver: string;
  bucketSize: number;
}

/** Adds the placement options shared by `plan` and `run`. */
export function planOptions(cmd: Command): Command {
  return cmd
    .option(
      "--vram-budget <GiB>",
      "device memory for hot neurons in GiB (default: the device's free memory minus 10 %)",
      float("vram-budget", { min: 0 }),
    )
    .option(
      "--device-backend <name>",
      'backend holding the hot neurons (a GPU backend; "cpu" stands in for tests)',
      "auto",
    )
    .option("--stats <file>", "activation statistics (default: <model>.activations.gguf)")
    .option("--gpu-index <file>", "GPU index to reuse or write (default: <model>.generated.gpuidx)")
    .option("--reset-gpu-index", "solve the plan again even when a matching GPU index exists")
    .option("--solver <name>", "ilp (GLPK) or greedy", choice("solver", ["ilp", "greedy"]), "ilp")
    .option("--bucket-size <n>", "neurons per bucket of the integer program", int("bucket-size", { min: 1 }), 256);
}

/** Budget in bytes: --vram-budget, else 90 % of the device's free memory. */
export function budgetBytes(o: PlanCliOptions, deviceFree: number): number {
  if (o.vramBudget !== undefined) {
    if (!(o.vramBudget >= 0)) throw new InvalidArgumentError("--vram-budget must be ≥ 0");
    return Math.floor(o.vramBudget * 2 ** 30);
  }
  return Math.floor(deviceFree * 0.9);
}

export function register(program: Command): void {
  planOptions(
    modelOptions(program.command("plan").description("print the hot/cold neuron placement for a device memory budget")),
  )
    .option("--json", "print the plan as JSON")
    .action(
      action(async (o: ModelCliOptions & PlanCliOptions & { json?: boolean }) => {
        if (o.solver !== "ilp" && o.solver !== "greedy")
          throw new InvalidArgumentError("--solver must be ilp or greedy");
        const { backend, model } = await loadModelFromCli(o, true);
        const device = await loadBackend(
          o.deviceBackend === "auto" ? "auto" : o.deviceBackend,
          { threads: 1 },
          () => {},
        );
        try {
          const free = device.devices[0]?.freeMemory ?? 0;
          const budget = budgetBytes(o, free);
          const r = await resolvePlan(model, {
            budgetBytes: budget,
            backend: device.name,
            statsPath: o.stats,
            gpuIndexPath: o.gpuIndex,
            reset: o.resetGpuIndex,
            solver: o.solver as "ilp",
            bucketSize: o.bucketSize,
          });
          if (o.json) {
            process.stdout.write(
              `${JSON.stringify({
                ...r,
                plan: { ...r.plan, layers: r.plan.layers.map((L) => ({ ...L, hot: L.hot.length })) },
              })}\n`,
            );
          } else {
            for (const n of r.notes) process.stderr.write(`${n}\n`);
            if (device.devices[0]?.kind !== "gpu") {
              process.stderr.write(
                `note: no GPU backend is usable; planning for "${device.name}" standing in for the device\n`,
              );
            }
            process.stdout.write(`device backend: ${device.name}\n${explainPlan(r.plan, model.config.n_ff)}\n`);
          }
        } finally {
          model.dispose();
          backend.dispose();
          device.dispose();
        }
      }),
    );
}
