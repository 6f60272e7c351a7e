/** `powerinfer run`: generate text from a prompt, streaming it, with llama.cpp-style timings. */
import { type Command, InvalidArgumentError } from "commander";
import { existsSync } from "node:fs";
import type { NeuronCacheStats } from "@powerinfer/core";
import type { PlacementPlan } from "@powerinfer/core/placement";
import { defaultGpuIndexPath, defaultStatsPath, HybridSession, resolvePlan, type Session } from "@powerinfer/engine";
import { loadDeviceBackend } from "../backends.js";
import { action } from "../errors.js";
import { budgetBytes, type PlanCliOptions, planOptions } from "./plan.js";
import {
  cacheDelta,
  describeCacheStats,
  generateOptionsFromCli,
  int,
  loadModelFromCli,
  type ModelCliOptions,
  modelOptions,
  readTextFile,
  type SamplingCliOptions,
  samplingOptions,
} from "./common.js";

interface RunOptions extends ModelCliOptions, PlanCliOptions, SamplingCliOptions {
  disableGpuIndex?: boolean;
  prompt?: string;
  file?: string;
  nPredict: number;
  displayPrompt: boolean;
}

function perf(label: string, ms: number, n: number): string {
  const per = n > 0 ? ms / n : 0;
  const tps = ms > 0 ? (n * 1000) / ms : 0;
  return `${label.padStart(18)} = ${ms.toFixed(2).padStart(10)} ms / ${String(n).padStart(5)} tokens (${per.toFixed(2).padStart(8)} ms per token, ${tps.toFixed(2).padStart(9)} tokens per second)`;
}

export function register(program: Command): void {
  samplingOptions(planOptions(modelOptions(program.command("run").description("generate text from a prompt"))))
    .option("--disable-gpu-index", "keep every FFN neuron on the CPU (no hot/cold split)")
    .option("-p, --prompt <text>", "prompt text")
    .option("-f, --file <file>", "read the prompt from a file")
    .option(
      "-n, --n-predict <n>",
      "tokens to generate (-1 = until end of text or context full)",
      int("n-predict", { min: 0, also: [-1], alsoMeans: "-1 = until end of text or context full" }),
      -1,
    )
    .option("--no-display-prompt", "do not print the prompt before the generated text")
    .action(
      action(async (o: RunOptions) => {
        if (o.prompt === undefined && o.file === undefined)
          throw new InvalidArgumentError("give a prompt with -p or -f");
        const prompt = o.prompt ?? readTextFile(o.file!);
        // Hot neurons on a device when one is there (or named), cold ones on the CPU: the main backend is then
        // the CPU unless the user chose one.
        let device = o.disableGpuIndex
          ? undefined
          : await loadDeviceBackend(
              o.deviceBackend,
              { threads: 1, memoryBudget: o.vramBudget && o.vramBudget * 2 ** 30 },
              () => {},
            );
        const { backend, model } = await loadModelFromCli(
          device && o.backend === "auto" && !process.env["POWERINFER_BACKEND"] ? { ...o, backend: "cpu" } : o,
        );
        const statsPath = o.stats ?? defaultStatsPath(o.model);
        if (
          device &&
          o.deviceBackend === "auto" &&
          !existsSync(statsPath) &&
          !existsSync(o.gpuIndex ?? defaultGpuIndexPath(o.model))
        ) {
          process.stderr.write(
            `note: no activation statistics (${statsPath}), so no hot/cold split: every FFN neuron stays on ${backend.name}; run \`powerinfer profile\` first\n`,
          );
          device.dispose();
          device = undefined;
        }
        let session: Session | HybridSession;
        let plan: PlacementPlan | undefined;
        if (device) {
          const r = await resolvePlan(model, {
            budgetBytes: budgetBytes(o, device.devices[0]?.freeMemory ?? 0),
            backend: device.name,
            statsPath: o.stats,
            gpuIndexPath: o.gpuIndex,
            reset: o.resetGpuIndex,
            solver: o.solver as "ilp",
            bucketSize: o.bucketSize,
          });
          plan = r.plan;
          for (const n of r.notes) process.stderr.write(`${n}\n`);
          const nHot = r.plan.layers.reduce((s, L) => s + L.hot.length, 0);
          if (nHot === 0) {
            process.stderr.write(
              `note: the device budget holds no hot neuron: every FFN neuron stays on ${backend.name}\n`,
            );
            device.dispose();
            device = undefined;
          }
        }
        if (device) {
          session = new HybridSession(model, { device, plan: plan!, nCtx: o.ctxSize, kvType: o.kvType as "f16" });
          process.stderr.write(
            `hybrid: ${plan!.layers.reduce((s, L) => s + L.hot.length, 0)} hot neurons (${(session.deviceBytes() / 2 ** 20).toFixed(2)} MiB) on ${device.name}, the rest on ${backend.name}\n`,
          );
        } else {
          const s = model.createSession({ nCtx: o.ctxSize, nBatch: o.batchSize, kvType: o.kvType as "f16" });
          for (const w of s.warnings) process.stderr.write(`warning: ${w}\n`);
          session = s;
        }
        for (const w of model.config.warnings) process.stderr.write(`warning: ${w}\n`);
        // tokenized (and its length checked) before anything is printed: a prompt too long for the context is
        // refused without echoing it first
        const ids = model.tokenizer.tokenize(prompt, { addSpecial: true, parseSpecial: false });
        if (ids.length === 0) throw new InvalidArgumentError("the prompt is empty");
        if (ids.length > session.nCtx) {
          throw new InvalidArgumentError(
            `the prompt has ${ids.length} tokens, more than the context holds (n_ctx ${session.nCtx}): raise -c/--ctx-size or shorten the prompt`,
          );
        }
        if (o.displayPrompt) process.stdout.write(prompt);
        const ac = new AbortController();
        const onSigint = () => ac.abort();
        process.once("SIGINT", onSigint);
        const cacheStats = () => (model.ramPlan ? backend.neuronCacheStats?.() : undefined);
        let decodeStart: NeuronCacheStats | undefined;
        let decodeTokens = 0;
        try {
          for await (const t of session.generate(ids, {
            ...generateOptionsFromCli(o),
            maxTokens: o.nPredict,
            signal: ac.signal,
          })) {
            // counters of decode only: from the first token (the prompt is evaluated by then)
            if (decodeStart === undefined) decodeStart = cacheStats();
            else decodeTokens++;
            process.stdout.write(t.text);
          }
        } finally {
          process.off("SIGINT", onSigint);
        }
        process.stdout.write("\n");
        const tm = session.timings;
        if (tm.stopReason === "context")
          process.stderr.write(`\ncontext full (n_ctx ${session.nCtx}): generation stopped\n`);
        process.stderr.write(
          `\n${"load time".padStart(18)} = ${model.loadMs.toFixed(2).padStart(10)} ms\n${perf("prompt eval time", tm.promptMs, tm.promptTokens)}\n${perf("eval time", tm.generateMs, tm.generatedTokens)}\n` +
            `backend: ${backend.name}, ${backend.threads} threads\n`,
        );
        const cacheEnd = cacheStats();
        if (decodeStart && cacheEnd)
          process.stderr.write(
            `${describeCacheStats(cacheDelta(decodeStart, cacheEnd), decodeTokens, backend.threads)}\n`,
          );
        if (model.ramPlan && "kv" in session) {
          // beside the budget: the KV cache and the whole process (peak resident set; mapped weights included)
          const kvBytes = [...session.kv.k, ...session.kv.v].reduce((n, t) => n + t.byteLength, 0);
          process.stderr.write(
            `memory beside the RAM budget: KV cache ${(kvBytes / 2 ** 20).toFixed(1)} MiB; process peak resident set ${(process.resourceUsage().maxRSS / 1024).toFixed(1)} MiB (mapped resident weights and the neuron cache included)\n`,
          );
        }
        if (!("stats" in session)) {
          // hybrid: the per-layer counters live in the single-backend session only
        } else if (model.sparse !== "off" && session.stats.tokens > 0) {
          // with routed experts the neurons that could run per token are those of the chosen experts
          const moe = model.config.moe;
          const nff = moe ? moe.n_ff_exp * moe.n_expert_used : model.config.n_ff;
          const frac = session.stats.activeRows.map((r) => r / session.stats.tokens / nff);
          const mean = frac.reduce((a, b) => a + b, 0) / frac.length;
          process.stderr.write(
            `sparse: ${model.sparse} mode${model.sparse === "predictor" ? `, threshold ${model.threshold}` : ""}; neurons computed per token: ${(mean * 100).toFixed(1)} % of ${moe ? "the chosen experts' neurons" : "n_ff"} on average (per layer: ${frac.map((f) => (f * 100).toFixed(1)).join(", ")} %)\n`,
          );
        } else if (model.config.ffn.activation !== "relu") {
          process.stderr.write(
            `note: ${model.config.ffn.activation.toUpperCase()} FFN — a dense model gains nothing from sparse inference\n`,
          );
        }
        session.dispose();
        model.dispose();
        backend.dispose();
        device?.dispose();
      }),
    );
}
