/**
 * `powerinfer plan`: the placement plan for a device memory budget (hot neurons and which layers' attention + KV
 * cache live on the device), explained with its expected tokens/s, without running.
 */
import {
  DEFAULT_THROUGHPUT,
  expectedTokensPerSecond,
  expertLayerPlacement,
  explainPlan,
  type Throughput,
} from "@powerinfer/core/placement";
import { contextSize, trainedContextWarning } from "@powerinfer/engine";
import { type Command, InvalidArgumentError } from "commander";
import { loadBackend } from "../backends.js";
import { action } from "../errors.js";
import { float, loadModelFromCli, type ModelCliOptions, modelOptions } from "./common.js";
import { budgetBytes, type DeviceCliOptions, deviceOptions, gpuLayers, resolvePlanFromCli } from "./device.js";

/** The options of `plan` beside the model's: the device options every decoding command has. */
export type PlanCliOptions = DeviceCliOptions;

/** Adds the placement options (the device options, see device.ts). */
export const planOptions = deviceOptions;

/** Throughput from --device-gbps and --cpu-gbps (both or neither), else the planner's defaults. */
export function throughputFromCli(o: { deviceGbps?: number; cpuGbps?: number }): Throughput {
  if (o.deviceGbps === undefined && o.cpuGbps === undefined) return DEFAULT_THROUGHPUT;
  if (o.deviceGbps === undefined || o.cpuGbps === undefined) {
    throw new InvalidArgumentError("give both --device-gbps and --cpu-gbps (or neither, for the defaults)");
  }
  return { deviceBytesPerSecond: o.deviceGbps * 1e9, cpuBytesPerSecond: o.cpuGbps * 1e9, source: "measured" };
}

interface PlanCommandOptions extends ModelCliOptions, PlanCliOptions {
  json?: boolean;
  nGpuLayers?: number;
  deviceGbps?: number;
  cpuGbps?: number;
}

export function register(program: Command): void {
  planOptions(
    modelOptions(
      program
        .command("plan")
        .description(
          "print the placement for a device memory budget: hot neurons and the layers whose attention + KV cache (for -c) live on the device",
        ),
    ),
  )
    .option(
      "--device-gbps <GB/s>",
      `device read throughput for the expected tokens/s (default ${DEFAULT_THROUGHPUT.deviceBytesPerSecond / 1e9}; with --cpu-gbps)`,
      float("device-gbps", { above: 0, max: 1e6 }),
    )
    .option(
      "--cpu-gbps <GB/s>",
      `CPU read throughput for the expected tokens/s (default ${DEFAULT_THROUGHPUT.cpuBytesPerSecond / 1e9}; with --device-gbps)`,
      float("cpu-gbps", { above: 0, max: 1e6 }),
    )
    .option("--json", "print the plan as JSON")
    .action(
      action(async (o: PlanCommandOptions) => {
        if (o.solver !== "ilp" && o.solver !== "greedy")
          throw new InvalidArgumentError("--solver must be ilp or greedy");
        if (o.disableGpuIndex)
          throw new InvalidArgumentError(
            "--disable-gpu-index leaves nothing to plan (every neuron on the main backend): it is for run, serve and the other commands that load a model",
          );
        const throughput = throughputFromCli(o);
        const { backend, model } = await loadModelFromCli(o, true);
        const device = await loadBackend(
          o.deviceBackend === "auto" ? "auto" : o.deviceBackend,
          { threads: 1 },
          () => {},
        );
        try {
          const free = device.devices[0]?.freeMemory ?? 0;
          const budget = budgetBytes(o, free);
          const cfg = model.config;
          if (cfg.ffn.activation !== "relu" && !cfg.moe) {
            throw new InvalidArgumentError(
              `this model's FFN is dense (${cfg.ffn.activation}): there is no hot/cold neuron plan to make; \`run -ngl N\` puts its last N whole layers on the device`,
            );
          }
          // the KV cache is sized as a session sizes it
          const nCtx = contextSize(cfg, o.ctxSize);
          // as a session warns (run, serve, batched): the plan is for a context the model was not trained on
          const ctxWarning = trainedContextWarning(cfg, nCtx);
          if (ctxWarning) process.stderr.write(`warning: ${ctxWarning}\n`);
          const r = await resolvePlanFromCli(model, device.name, o, { budget, nCtx, throughput });
          // the output layer stays on the CPU (the planner places the repeating layers only)
          const outputBytes = model.weights.output.byteLength + model.weights.outputNorm.byteLength;
          const withOutput = expectedTokensPerSecond(r.plan, throughput, { cpuBytesPerToken: outputBytes });
          if (o.json) {
            process.stdout.write(
              `${JSON.stringify({
                ...r,
                nCtx,
                expectedTokensPerSecondWithOutput: withOutput,
                plan: {
                  ...r.plan,
                  layers: r.plan.layers.map((L, l) => ({
                    ...L,
                    hot: L.hot.length,
                    // routed experts: (expert, neuron) pairs on the device per expert
                    ...(r.experts
                      ? (({ hotPerExpert, ...x }) => ({
                          experts: { ...x, hotPerExpert: Array.from(hotPerExpert) },
                        }))(expertLayerPlacement(L.hot, r.experts.nFfExp, r.experts.nExpert, r.experts.selections?.[l]))
                      : {}),
                  })),
                },
              })}\n`,
            );
          } else {
            for (const n of r.notes) process.stderr.write(`${n}\n`);
            if (device.devices[0]?.kind !== "gpu") {
              process.stderr.write(
                `note: no GPU backend is usable; planning for "${device.name}" standing in for the device\n`,
              );
            }
            process.stdout.write(
              `device backend: ${device.name}; n_ctx ${nCtx} (${o.kvType} KV cache)${gpuLayers(o, model) ? `; attention of the last ${gpuLayers(o, model)} layers forced on the device (--n-gpu-layers)` : ""}\n` +
                `${explainPlan(r.plan, cfg.moe ? cfg.moe.n_ff_exp * cfg.moe.n_expert : cfg.n_ff, r.experts)}\n` +
                `with the output layer on the CPU (${(outputBytes / 2 ** 20).toFixed(2)} MiB read per token): expected ${Number.isNaN(withOutput) ? "?" : withOutput.toFixed(1)} tokens/s\n`,
            );
          }
        } finally {
          model.dispose();
          backend.dispose();
          device.dispose();
        }
      }),
    );
}
