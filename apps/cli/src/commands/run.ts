/** `powerinfer run`: generate text from a prompt, streaming it, with llama.cpp-style timings. */
import { type Command, InvalidArgumentError } from "commander";
import type { NeuronCacheStats } from "@powerinfer/core";
import { servesExperts } from "@powerinfer/engine";
import { action } from "../errors.js";
import { type DeviceCliOptions, deviceOptions, loadModelWithDevice } from "./device.js";
import {
  cacheDelta,
  contextFullNote,
  describeCacheStats,
  generateOptionsFromCli,
  nPredictArg,
  type ModelCliOptions,
  modelOptions,
  readPromptFile,
  type SamplingCliOptions,
  samplingOptions,
  plural,
} from "./common.js";

interface RunOptions extends ModelCliOptions, DeviceCliOptions, SamplingCliOptions {
  prompt?: string;
  file?: string;
  nPredict: number;
  displayPrompt: boolean;
}

/** llama.cpp's timing line: `ms / n tokens` (or `runs`: generation counts its decodes, as llama.cpp does). */
function perf(label: string, ms: number, n: number, unit = "tokens"): string {
  const per = n > 0 ? ms / n : 0;
  const tps = ms > 0 ? (n * 1000) / ms : 0;
  return `${label.padStart(18)} = ${ms.toFixed(2).padStart(10)} ms / ${String(n).padStart(5)} ${unit} (${per.toFixed(2).padStart(8)} ms per token, ${tps.toFixed(2).padStart(9)} tokens per second)`;
}

export function register(program: Command): void {
  samplingOptions(deviceOptions(modelOptions(program.command("run").description("generate text from a prompt"))))
    .option("-p, --prompt <text>", "prompt text")
    .option(
      "-f, --file <file>",
      "read the prompt from a file (- for standard input; one final newline is dropped, as llama.cpp does)",
    )
    .option(
      "-n, --n-predict <n>",
      "tokens to generate (-1 = until end of text or context full; -2, llama.cpp's until the context is full, the same)",
      nPredictArg(),
      -1,
    )
    .option("--no-display-prompt", "do not print the prompt before the generated text")
    .action(
      action(async (o: RunOptions) => {
        if (o.prompt === undefined && o.file === undefined)
          throw new InvalidArgumentError("give a prompt with -p or -f");
        if (o.prompt !== undefined && o.file !== undefined)
          throw new InvalidArgumentError("give the prompt with -p or -f, not both");
        const prompt = o.prompt ?? readPromptFile(o.file!);
        // hot neurons (and --n-gpu-layers layers) on a device when one is there, the rest on the CPU
        const loaded = await loadModelWithDevice(o);
        const { backend, model } = loaded;
        const session = model.createSession({ nCtx: o.ctxSize, nBatch: o.batchSize, kvType: o.kvType as "f16" });
        for (const w of session.warnings) process.stderr.write(`warning: ${w}\n`);
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
        // text on stdout not yet ended by a newline: an error ends the line first, so its message starts on
        // a line of its own
        let openLine = o.displayPrompt && prompt !== "" && !prompt.endsWith("\n");
        try {
          for await (const t of session.generate(ids, {
            ...generateOptionsFromCli(o, session.nCtx),
            maxTokens: o.nPredict,
            signal: ac.signal,
          })) {
            // counters of decode only: from the first token (the prompt is evaluated by then)
            if (decodeStart === undefined) decodeStart = cacheStats();
            else decodeTokens++;
            process.stdout.write(t.text);
            if (t.text !== "") openLine = !t.text.endsWith("\n");
          }
        } catch (e) {
          if (openLine) process.stdout.write("\n");
          throw e;
        } finally {
          process.off("SIGINT", onSigint);
        }
        process.stdout.write("\n");
        const tm = session.timings;
        if (tm.stopReason === "context") process.stderr.write(`\n${contextFullNote(session.nCtx)}\n`);
        process.stderr.write(
          `\n${"load time".padStart(18)} = ${model.loadMs.toFixed(2).padStart(10)} ms\n${perf("prompt eval time", tm.promptMs, tm.promptTokens)}\n${perf("eval time", tm.generateMs, tm.decodes ?? tm.generatedTokens, tm.decodes === undefined ? "tokens" : "runs")}\n` +
            `backend: ${backend.name}, ${plural(backend.threads, "thread")}\n`,
        );
        const cacheEnd = cacheStats();
        if (decodeStart && cacheEnd)
          process.stderr.write(
            `${describeCacheStats(
              cacheDelta(decodeStart, cacheEnd),
              decodeTokens,
              backend.threads,
              model.ramPlan && servesExperts(model.ramPlan) ? "expert cache" : "neuron cache",
            )}\n`,
          );
        if (model.ramPlan) {
          // beside the budget: the KV cache and the whole process (peak resident set; mapped weights included)
          const kvBytes = [...session.kv.k, ...session.kv.v].reduce((n, t) => n + t.byteLength, 0);
          process.stderr.write(
            `memory beside the RAM budget: KV cache ${(kvBytes / 2 ** 20).toFixed(1)} MiB; process peak resident set ${(process.resourceUsage().maxRSS / 1024).toFixed(1)} MiB (mapped resident weights and the neuron cache included)\n`,
          );
        }
        if (loaded.device) {
          const st = session.stats;
          process.stderr.write(
            `hybrid: ${(st.calls / Math.max(1, st.steps)).toFixed(1)} backend calls per step (${st.calls} over ${st.steps} graphs)\n`,
          );
        }
        if (model.sparse !== "off" && session.stats.tokens > 0) {
          // with routed experts the neurons that could run per token are those of the chosen experts
          const moe = model.config.moe;
          const nff = moe ? moe.n_ff_exp * moe.n_expert_used : model.config.n_ff;
          const st = session.stats;
          const frac = st.activeRows.map((r, l) => r / Math.max(1, st.layerTokens[l] ?? 0) / nff);
          const mean = frac.reduce((a, b) => a + b, 0) / frac.length;
          process.stderr.write(
            `sparse: ${model.sparse} mode${model.sparse === "predictor" ? `, threshold ${model.threshold}` : ""}; neurons computed per token: ${(mean * 100).toFixed(1)} % of ${moe ? "the chosen experts' neurons" : "n_ff"} on average (per layer: ${frac.map((f) => (f * 100).toFixed(1)).join(", ")} %)\n`,
          );
        } else if (model.config.ffn.activation !== "relu") {
          process.stderr.write(
            model.config.moe
              ? `note: ${model.config.ffn.activation} experts — their neurons are rarely exactly zero, so only the routing is sparse (each token reads its ${model.config.moe.n_expert_used} chosen experts whole)\n`
              : `note: ${model.config.ffn.activation} FFN — a dense model gains nothing from sparse inference\n`,
          );
        }
        session.dispose();
        loaded.dispose();
        // interrupted: the timings above are printed, and the exit status says so (128 + SIGINT, as llama.cpp)
        if (ac.signal.aborted) process.exitCode = 130;
      }),
    );
}
