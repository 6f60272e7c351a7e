/**
 * `powerinfer batched`: N sequences from one prompt, decoded together (as llama.cpp's batched example).
 * The prompt is evaluated once and its cache copied to every sequence; then each step is one graph over the
 * N new tokens. Sequence i samples with seed S + i, so it equals `powerinfer run --seed S+i`.
 */
import { Generation, type GenerationStep, type Session, type StopReason } from "@powerinfer/core";
import { type Command, InvalidArgumentError } from "commander";
import { action } from "../errors.js";
import { float, int, loadModelFromCli, type ModelCliOptions, modelOptions, readTextFile } from "./common.js";
import { acceptNp } from "./serve.js";

interface BatchedOptions extends ModelCliOptions {
  prompt?: string;
  file?: string;
  parallel: number;
  nPredict: number;
  temp: number;
  topK: number;
  topP: number;
  minP: number;
  repeatPenalty: number;
  repeatLastN: number;
  presencePenalty: number;
  frequencyPenalty: number;
  seed?: number;
  ignoreEos?: boolean;
  stop?: string[];
  json?: boolean;
}

export function register(program: Command): void {
  const cmd = modelOptions(
    program
      .command("batched")
      .description(
        "generate N sequences from one prompt in one batch (sequence i uses seed S+i, equal to `run --seed S+i`)",
      ),
  )
    .option("-p, --prompt <text>", "prompt text")
    .option("-f, --file <file>", "read the prompt from a file")
    .option("--np, --parallel <n>", "sequences to generate (also -np)", int("parallel"), 4)
    .option(
      "-n, --n-predict <n>",
      "tokens to generate per sequence (-1 = until end of text or context full)",
      int("n-predict"),
      32,
    )
    .option("--temp <t>", "temperature (0 = greedy)", float("temp"), 0.8)
    .option("--top-k <k>", "top-k sampling (0 = off)", int("top-k"), 40)
    .option("--top-p <p>", "top-p sampling (1 = off)", float("top-p"), 0.95)
    .option("--min-p <p>", "min-p sampling (0 = off)", float("min-p"), 0.05)
    .option("--repeat-penalty <x>", "repetition penalty (1 = off)", float("repeat-penalty"), 1)
    .option("--repeat-last-n <n>", "tokens the penalties look back over", int("repeat-last-n"), 64)
    .option("--presence-penalty <x>", "presence penalty", float("presence-penalty"), 0)
    .option("--frequency-penalty <x>", "frequency penalty", float("frequency-penalty"), 0)
    .option("-s, --seed <n>", "RNG seed S of sequence 0; sequence i uses S+i (default: random)", int("seed"))
    .option("--ignore-eos", "keep generating after end of text")
    .option("--stop <text...>", "stop strings")
    .option("--json", "print the sequences as JSON")
    .action(
      action(async (o: BatchedOptions) => {
        if (o.prompt === undefined && o.file === undefined)
          throw new InvalidArgumentError("give a prompt with -p or -f");
        if (o.parallel < 1) throw new InvalidArgumentError("--parallel must be ≥ 1");
        const prompt = o.prompt ?? readTextFile(o.file!);
        const { backend, model } = await loadModelFromCli(o, !!o.json);
        const sessions: Session[] = [];
        try {
          const tok = model.tokenizer;
          const ids = tok.tokenize(prompt, { addSpecial: true, parseSpecial: false });
          if (ids.length === 0) throw new InvalidArgumentError("the prompt is empty");
          for (let i = 0; i < o.parallel; i++)
            sessions.push(model.createSession({ nCtx: o.ctxSize, nBatch: o.batchSize, kvType: o.kvType as "f16" }));
          const nCtx = sessions[0]!.nCtx;
          if (ids.length > nCtx) {
            throw new InvalidArgumentError(
              `prompt has ${ids.length} tokens, context has room for ${nCtx} (n_ctx ${nCtx})`,
            );
          }
          if (!o.json)
            for (const w of [...model.config.warnings, ...sessions[0]!.warnings])
              process.stderr.write(`warning: ${w}\n`);
          const seed = o.seed ?? Math.floor(Math.random() * 2 ** 32);
          const gens = sessions.map(
            (_, i) =>
              new Generation(tok, ids, {
                maxTokens: o.nPredict,
                temperature: o.temp,
                topK: o.topK,
                topP: o.topP,
                minP: o.minP,
                repeatPenalty: o.repeatPenalty,
                penaltyLastN: o.repeatLastN,
                presencePenalty: o.presencePenalty,
                frequencyPenalty: o.frequencyPenalty,
                seed: (seed + i) >>> 0,
                ignoreEos: o.ignoreEos,
                stop: o.stop,
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
            const rate = genMs > 0 ? (generated * 1000) / genMs : 0;
            process.stderr.write(
              `prompt: ${ids.length} tokens in ${promptMs.toFixed(2)} ms (evaluated once, copied to ${o.parallel - 1} more sequence${o.parallel === 2 ? "" : "s"})\n` +
                `decoded ${generated} tokens in ${(genMs / 1000).toFixed(3)} s, speed: ${rate.toFixed(2)} t/s, ` +
                `${steps} decode steps of ${(steps > 0 ? seqSteps / steps : 0).toFixed(2)} sequences on average\n` +
                `backend: ${backend.name}, ${backend.threads} threads\n`,
            );
          }
        } finally {
          for (const s of sessions) s.dispose();
          model.dispose();
          backend.dispose();
        }
      }),
    );
  acceptNp(cmd);
}
