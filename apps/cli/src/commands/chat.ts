/**
 * `powerinfer chat`: an interactive session using the model's chat template (ChatML when it has none).
 * Every line read is one user message, answered in order (also with input piped on stdin); end of input or
 * `/exit` ends the chat. When the context fills, the oldest turns are dropped (the system prompt is kept)
 * with a one-line notice, and the chat goes on.
 */
import { createInterface } from "node:readline";
import { Chat, ChatTemplate } from "@powerinfer/engine";
import type { Command } from "commander";
import { action } from "../errors.js";
import { float, int, type ModelCliOptions, modelOptions, seedArg, TEMP_HELP } from "./common.js";
import { type DeviceCliOptions, deviceOptions, loadModelWithDevice } from "./device.js";

interface ChatOptions extends ModelCliOptions, DeviceCliOptions {
  system?: string;
  nPredict: number;
  temp: number;
  topK: number;
  topP: number;
  minP: number;
  seed?: number;
}

export function register(program: Command): void {
  deviceOptions(modelOptions(program.command("chat").description("interactive chat using the model's chat template")))
    .option("--system <text>", "system message")
    .option(
      "-n, --n-predict <n>",
      "most tokens per reply (-1 = until end of turn)",
      int("n-predict", { min: 0, also: [-1], alsoMeans: "-1 = until end of turn" }),
      -1,
    )
    .option("--temp <t>", TEMP_HELP, float("temp"), 0.8)
    .option("--top-k <k>", "top-k sampling (≤ 0 = off)", (v: string) => Math.max(0, int("top-k")(v)), 40)
    .option("--top-p <p>", "top-p", float("top-p", { min: 0, max: 1 }), 0.95)
    .option("--min-p <p>", "min-p", float("min-p", { min: 0, max: 1 }), 0.05)
    .option("-s, --seed <n>", "RNG seed; -1 = random", seedArg())
    .action(
      action(async (o: ChatOptions) => {
        const loaded = await loadModelWithDevice(o);
        const { backend, model } = loaded;
        const tok = model.tokenizer;
        const interactive = process.stdin.isTTY === true;
        let session: ReturnType<typeof model.createSession> | undefined;
        const rl = createInterface({
          input: process.stdin,
          output: process.stdout,
          terminal: interactive,
          prompt: "> ",
        });
        let chat: Chat | undefined;
        // Ctrl+C stops the reply being written; at the prompt it ends the chat
        rl.on("SIGINT", () => {
          if (!chat?.interrupt()) rl.close();
        });
        try {
          const template = ChatTemplate.fromGguf(
            model.file,
            tok.bosId === undefined ? "" : tok.tokenText(tok.bosId),
            tok.eosId === undefined ? "" : tok.tokenText(tok.eosId),
          );
          if (template.isFallback)
            process.stderr.write("note: the model has no chat template; using ChatML (llama.cpp's fallback)\n");
          session = model.createSession({ nCtx: o.ctxSize, nBatch: o.batchSize, kvType: o.kvType as "f16" });
          for (const w of [...model.config.warnings, ...session.warnings]) process.stderr.write(`warning: ${w}\n`);
          chat = new Chat(
            session,
            (text) => tok.tokenize(text, { addSpecial: true, parseSpecial: true }),
            template,
            {
              system: o.system,
              nPredict: o.nPredict,
              sampling: {
                temperature: o.temp,
                topK: o.topK,
                topP: o.topP,
                minP: o.minP,
                seed: o.seed,
                stop: template.isFallback ? ["<|im_end|>"] : [],
              },
            },
            {
              text: (s) => process.stdout.write(s),
              notice: (line) => process.stderr.write(`${line}\n`),
              terminal: process.stdout.isTTY === true,
            },
          );
          if (interactive) rl.prompt();
          // lines that arrive while a reply is generated wait in the iterator, so piped input is answered in order
          for await (const line of rl) {
            if (line.trim() === "/exit") break;
            if (line.trim() !== "") await chat.turn(line);
            if (interactive) rl.prompt();
          }
        } finally {
          rl.close();
          session?.dispose();
          model.dispose();
          backend.dispose();
          loaded.device?.dispose();
        }
      }),
    );
}
