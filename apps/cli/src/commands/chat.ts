/** `powerinfer chat`: an interactive session using the model's chat template (ChatML when it has none). */
import { createInterface } from "node:readline/promises";
import { ChatTemplate, type ChatMessage } from "@powerinfer/core";
import type { Command } from "commander";
import { action } from "../errors.js";
import { float, int, loadModelFromCli, type ModelCliOptions, modelOptions } from "./common.js";

interface ChatOptions extends ModelCliOptions {
  system?: string;
  nPredict: number;
  temp: number;
  topK: number;
  topP: number;
  minP: number;
  seed?: number;
}

export function register(program: Command): void {
  modelOptions(program.command("chat").description("interactive chat using the model's chat template"))
    .option("--system <text>", "system message")
    .option("-n, --n-predict <n>", "most tokens per reply (-1 = until end of turn)", int("n-predict"), -1)
    .option("--temp <t>", "temperature (0 = greedy)", float("temp"), 0.8)
    .option("--top-k <k>", "top-k", int("top-k"), 40)
    .option("--top-p <p>", "top-p", float("top-p"), 0.95)
    .option("--min-p <p>", "min-p", float("min-p"), 0.05)
    .option("-s, --seed <n>", "RNG seed", int("seed"))
    .action(
      action(async (o: ChatOptions) => {
        const { backend, model } = await loadModelFromCli(o);
        const tok = model.tokenizer;
        const template = ChatTemplate.fromGguf(
          model.file,
          tok.bosId === undefined ? "" : tok.tokenText(tok.bosId),
          tok.eosId === undefined ? "" : tok.tokenText(tok.eosId),
        );
        if (template.isFallback)
          process.stderr.write("note: the model has no chat template; using ChatML (llama.cpp's fallback)\n");
        const session = model.createSession({ nCtx: o.ctxSize, nBatch: o.batchSize, kvType: o.kvType as "f16" });
        const messages: ChatMessage[] = o.system ? [{ role: "system", content: o.system }] : [];
        let cached: number[] = [];
        const rl = createInterface({ input: process.stdin, output: process.stdout, terminal: process.stdin.isTTY });
        try {
          for (;;) {
            let line: string;
            try {
              line = await rl.question("> ");
            } catch {
              break; // stdin closed
            }
            if (line.trim() === "/exit") break;
            messages.push({ role: "user", content: line });
            const ids = tok.tokenize(template.apply(messages), { addSpecial: true, parseSpecial: true });
            // reuse the KV cache for the common prefix of the conversation
            let p = 0;
            while (p < cached.length && p < ids.length - 1 && cached[p] === ids[p]) p++;
            session.nPast = p;
            let reply = "";
            const generated: number[] = [];
            for await (const t of session.generate(ids.slice(p), {
              maxTokens: o.nPredict,
              temperature: o.temp,
              topK: o.topK,
              topP: o.topP,
              minP: o.minP,
              seed: o.seed,
              stop: template.isFallback ? ["<|im_end|>"] : [],
            })) {
              if (t.id >= 0) generated.push(t.id);
              reply += t.text;
              process.stdout.write(t.text);
            }
            process.stdout.write("\n");
            cached = [...ids, ...generated].slice(0, session.nPast);
            messages.push({ role: "assistant", content: reply });
            if (session.timings.stopReason === "context") {
              process.stderr.write(`context full (n_ctx ${session.nCtx}); start a new chat\n`);
              break;
            }
          }
        } finally {
          rl.close();
          session.dispose();
          model.dispose();
          backend.dispose();
        }
      }),
    );
}
