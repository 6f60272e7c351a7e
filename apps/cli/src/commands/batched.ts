/**
 * `powerinfer batched`: N sequences from one prompt, decoded together (as llama.cpp's batched example).
 * The prompt is evaluated once and its cache copied to every sequence; then each step is one graph over the
 * N new tokens. Sequence i samples with seed S + i, so it equals `powerinfer run --seed S+i`.
 */
import { formatBytes, Generation, type GenerationStep, type Session, type StopReason } from "@powerinfer/engine";
import { type Command, InvalidArgumentError } from "commander";
import { action } from "../errors.js";
import {
  contextFullNote,
  generateOptionsFromCli,
  int,
  nPredictArg,
  MAX_SEQUENCES,
  type ModelCliOptions,
  modelOptions,
  readPromptFile,
  type SamplingCliOptions,
  samplingOptions,
  plural,
} from "./common.js";
import { type DeviceCliOptions, deviceOptions, loadModelWithDevice } from "./device.js";
import { acceptNp } from "./serve.js";

interface BatchedOptions extends ModelCliOptions, DeviceCliOptions, SamplingCliOptions {
  prompt?: string;
  file?: string;
  parallel: number;
  nPredict: number;
  json?: boolean;
}

export function register(program: Command): void {
  const cmd = samplingOptions(
    deviceOptions(
      modelOptions(
        program
          .command("batched")
          .description(
            "generate N sequences from one prompt in one batch (sequence i uses seed S+i, equal to `run --seed S+i`)",
          ),
      ),
    )
      .option("-p, --prompt <text>", "prompt text")
      .option(
        "-f, --file <file>",
        "read the prompt from a file (- for standard input; one final newline is dropped, as llama.cpp does)",
      )
      .option(
        "--np, --parallel <n>",
        "sequences to generate (also -np), at most 256 as in llama.cpp (LLAMA_MAX_SEQ)",
        int("parallel", { min: 1, max: MAX_SEQUENCES }),
        4,
      )
      .option(
        "-n, --n-predict <n>",
        "tokens to generate per sequence (-1 = until end of text or context full)",
        nPredictArg(),
        32,
      ),
    "RNG seed S of sequence 0; sequence i uses S+i (default: random)",
  ).option("--json", "print the sequences as JSON");
  // -c is each sequence's context here; llama.cpp's batched shares one -c context among all the sequences
  const ctx = cmd.options.find((opt) => opt.long === "--ctx-size");
  if (ctx)
    ctx.description =
      "context size in tokens of each sequence, so N sequences hold N × this (llama.cpp's batched -c is one context shared by all the sequences) (default: the prompt plus -n tokens, at most the model's trained context and 4096; 0: the trained context)";
  cmd.action(
    action(async (o: BatchedOptions) => {
      if (o.prompt === undefined && o.file === undefined) throw new InvalidArgumentError("give a prompt with -p or -f");
      if (o.parallel < 1) throw new InvalidArgumentError("--parallel must be ≥ 1");
      const prompt = o.prompt ?? readPromptFile(o.file!);
      const loaded = await loadModelWithDevice(o, !!o.json, {
        kvPositions: (n) => n * o.parallel,
        batchColumns: o.parallel > 1 ? o.parallel : undefined,
      });
      const { backend, model } = loaded;
      const sessions: Session[] = [];
      try {
        const tok = model.tokenizer;
        const ids = tok.tokenize(prompt, { addSpecial: true, parseSpecial: false });
        if (ids.length === 0) throw new InvalidArgumentError("the prompt is empty");
        // without -c, each sequence's context holds what it needs (prompt + n_predict, as llama.cpp's batched
        // sizes its one context to the sequences' total) rather than the model's default n_ctx each
        const need = o.nPredict >= 0 ? ids.length + o.nPredict : undefined;
        const dflt = Math.min(model.config.n_ctx_train, 4096);
        const nCtxEach = o.ctxSize ?? (need !== undefined && need < dflt ? Math.max(need, 1) : undefined);
        const newSession = () =>
          model.createSession({ nCtx: nCtxEach, nBatch: o.batchSize, kvType: o.kvType as "f16" });
        sessions.push(newSession());
        // all the sequences' KV caches together must fit (each alone is checked by the engine)
        const kv = sessions[0]!.kv;
        const kvBytes = 2 * kv.k.length * kv.nEmbdKv * kv.nCtx * (kv.type === "f16" ? 2 : 4);
        const free = backend.devices[0]?.freeMemory;
        if (free !== undefined && free > 0 && kvBytes * (o.parallel - 1) > free) {
          throw new InvalidArgumentError(
            `${o.parallel} sequences need KV caches of ${formatBytes(kvBytes * o.parallel, 2)} (n_ctx ${kv.nCtx} each), ${backend.name} has ${formatBytes(free + kvBytes, 2)} free; use a smaller --parallel or -c`,
          );
        }
        for (let i = 1; i < o.parallel; i++) sessions.push(newSession());
        const nCtx = sessions[0]!.nCtx;
        if (ids.length > nCtx) {
          throw new InvalidArgumentError(
            `prompt has ${ids.length} tokens, context has room for ${nCtx} (n_ctx ${nCtx}); use a larger -c (each sequence's context) or a shorter prompt`,
          );
        }
        if (!o.json)
          for (const w of [...model.config.warnings, ...sessions[0]!.warnings]) process.stderr.write(`warning: ${w}\n`);
        // -1 (or 4294967295): random, as run
        const seed = o.seed === undefined || o.seed === -1 ? Math.floor(Math.random() * 2 ** 32) : o.seed;
        const gens = sessions.map(
          (_, i) =>
            new Generation(tok, ids, {
              ...generateOptionsFromCli(o, nCtx),
              maxTokens: o.nPredict,
              seed: (seed + i) >>> 0,
            }),
        );
        const t0 = performance.now();
        const first = sessions[0]!.evaluate(ids);
        for (const s of sessions.slice(1)) s.copyFrom(sessions[0]!);
        const promptMs = performance.now() - t0;
        const logits: Float32Array[] = sessions.map(() => first);
        const texts = sessions.map(() => "");
        const reasons: (StopReason | undefined)[] = sessions.map(() => undefined);
        let steps = 0;
        let seqSteps = 0;
        const t1 = performance.now();
        for (;;) {
          const members: number[] = [];
          const tokens: number[] = [];
          sessions.forEach((s, i) => {
            if (reasons[i]) return;
            const g = gens[i]!;
            if (g.exhausted) {
              reasons[i] = "length";
              return;
            }
            const t: GenerationStep = g.next(logits[i]!);
            texts[i] += t.text;
            if (t.stop) {
              reasons[i] = t.stop;
              return;
            }
            if (s.nPast >= s.nCtx) {
              reasons[i] = "context";
              return;
            }
            members.push(i);
            tokens.push(t.id);
          });
          if (members.length === 0) break;
          const r = model.decodeBatch(members.map((i, k) => ({ session: sessions[i]!, tokens: [tokens[k]!] })));
          members.forEach((i, k) => {
            logits[i] = r.logits[k]!;
          });
          steps++;
          seqSteps += members.length;
        }
        const genMs = performance.now() - t1;
        gens.forEach((g, i) => {
          texts[i] += g.flush();
        });
        const generated = gens.reduce((s, g) => s + g.generated, 0);
        if (o.json) {
          process.stdout.write(
            `${JSON.stringify(
              {
                prompt,
                prompt_tokens: ids.length,
                sequences: texts.map((text, i) => ({
                  seed: (seed + i) >>> 0,
                  text,
                  tokens: gens[i]!.generated,
                  stop_reason: reasons[i],
                })),
                prompt_ms: promptMs,
                generate_ms: genMs,
                decode_steps: steps,
              },
              null,
              2,
            )}\n`,
          );
        } else {
          texts.forEach((text, i) => {
            process.stdout.write(`sequence ${i} (seed ${(seed + i) >>> 0}):\n\n${prompt}${text}\n\n`);
          });
          // as run says it: a sequence cut by the context (-c, per sequence) rather than by -n or end of text
          const full = reasons.flatMap((r, i) => (r === "context" ? [i] : []));
          if (full.length > 0) {
            const which =
              o.parallel === 1
                ? ""
                : full.length === o.parallel
                  ? ` for all ${o.parallel} sequences`
                  : ` for sequence${full.length > 1 ? "s" : ""} ${full.join(", ")}`;
            process.stderr.write(`${contextFullNote(nCtx)}${which}\n`);
          }
          const rate = genMs > 0 ? (generated * 1000) / genMs : 0;
          process.stderr.write(
            `prompt: ${ids.length} tokens in ${promptMs.toFixed(2)} ms (evaluated once, copied to ${o.parallel - 1} more sequence${o.parallel === 2 ? "" : "s"})\n` +
              `decoded ${generated} tokens in ${(genMs / 1000).toFixed(3)} s, speed: ${rate.toFixed(2)} t/s, ` +
              `${steps} decode steps of ${(steps > 0 ? seqSteps / steps : 0).toFixed(2)} sequences on average\n` +
              `backend: ${backend.name}, ${plural(backend.threads, "thread")}\n`,
          );
        }
      } finally {
        for (const s of sessions) s.dispose();
        model.dispose();
        backend.dispose();
        loaded.device?.dispose();
      }
    }),
  );
  acceptNp(cmd);
}
