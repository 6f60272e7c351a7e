/** `powerinfer plan`: the neuron placement plan for a device memory budget, explained, without running. */
import { explainPlan } from "@powerinfer/core/placement";
import { resolvePlan } from "@powerinfer/engine";
import { type Command, InvalidArgumentError } from "commander";
import { loadBackend } from "../backends.js";
import { action } from "../errors.js";
import { loadModelFromCli, type ModelCliOptions, modelOptions } from "./common.js";
import { budgetBytes, type DeviceCliOptions, deviceOptions } from "./device.js";

/** The options of `plan` beside the model's: the device options every decoding command has. */
export type PlanCliOptions = DeviceCliOptions;

/** Adds the placement options (the device options, see device.ts). */
export const planOptions = deviceOptions;

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
