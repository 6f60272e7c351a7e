/**
 * `powerinfer serve`: the HTTP server (OpenAI's API and llama.cpp's server API, continuous batching over
 * `-np` slots). It listens at once and answers 503 until the model has loaded.
 */
import { accessSync, constants, readFileSync } from "node:fs";
import { availableParallelism } from "node:os";
import { ChatTemplate, EngineError, type KvCacheType } from "@powerinfer/engine";
import { assertModelFile, openGgufModel, parseModelConfig } from "@powerinfer/gguf";
import { createServer } from "@powerinfer/server";
import { type Command, InvalidArgumentError } from "commander";
import { action } from "../errors.js";
import {
  checkInputFile,
  checkModelOptions,
  choice,
  describeRamPlan,
  float,
  int,
  MAX_SEQUENCES,
  MMAP_HELP,
  REPACK_HELP,
  seedArg,
  TEMP_HELP,
  plural,
  threadsArg,
} from "./common.js";
import { type DeviceCliOptions, deviceOptions, loadModelWithDevice } from "./device.js";

interface ServeOptions extends DeviceCliOptions {
  model: string;
  host: string;
  port: number;
  ctxSize?: number;
  parallel: number;
  apiKey?: string;
  metrics?: boolean;
  queue: number;
  alias?: string;
  threads?: number;
  batchSize: number;
  backend: string;
  kvType: string;
  sparse?: string;
  sparseThreshold?: number;
  /** GiB (--ram-budget). */
  ramBudget?: number;
  log?: boolean;
  /** Generation defaults (llama-server's options of the same names). */
  seed?: number;
  temp?: number;
  topK?: number;
  topP?: number;
  minP?: number;
  nPredict?: number;
  repeatPenalty?: number;
  /** false with --no-slots. */
  slots?: boolean;
  /** A jinja chat template used instead of the model's, as text or from a file. */
  chatTemplate?: string;
  chatTemplateFile?: string;
}

/**
 * The chat template `--chat-template` / `--chat-template-file` give (undefined: the model's), checked.
 * @throws InvalidArgumentError for both given, an unreadable file, or a template that does not parse.
 */
export function chatTemplateOption(o: { chatTemplate?: string; chatTemplateFile?: string }): string | undefined {
  if (o.chatTemplate !== undefined && o.chatTemplateFile !== undefined)
    throw new InvalidArgumentError("give --chat-template or --chat-template-file, not both");
  let src = o.chatTemplate;
  const flag = o.chatTemplateFile !== undefined ? "--chat-template-file" : "--chat-template";
  if (o.chatTemplateFile !== undefined) {
    checkInputFile(o.chatTemplateFile, "chat template file");
    src = readFileSync(o.chatTemplateFile, "utf8");
  }
  if (src === undefined) return undefined;
  if (src.trim() === "") throw new InvalidArgumentError(`${flag}: the template is empty`);
  try {
    new ChatTemplate(src, false, "", "");
  } catch (e) {
    if (e instanceof EngineError) throw new InvalidArgumentError(`${flag}: ${e.message}`);
    throw e;
  }
  return src;
}

/** Lets llama.cpp's `-np N` through (commander's short flags are one character). */
export function acceptNp(cmd: Command): Command {
  const parse = cmd.parseOptions.bind(cmd);
  cmd.parseOptions = (argv: string[]) => parse(argv.map((a) => (a === "-np" ? "--parallel" : a)));
  return cmd;
}

/** Below this many tokens per slot serve warns: a request's prompt and reply must fit in a slot's context. */
export const SMALL_SLOT_CONTEXT = 64;

/**
 * Checks the context each slot gets: -c split evenly over -np (llama-server's n_ctx / n_parallel).
 * @param trained -c 0 was given: `ctxSize` is the model's trained context
 * @returns a warning when a slot holds fewer than {@link SMALL_SLOT_CONTEXT} tokens (undefined otherwise)
 * @throws InvalidArgumentError naming -c, -np and the per-slot context when a slot cannot hold one prompt
 *   token and one generated token (fewer than 2 tokens)
 */
export function checkSlotContext(ctxSize: number, parallel: number, trained = false): string | undefined {
  const perSlot = Math.floor(ctxSize / parallel);
  const c = trained ? `-c 0 (the model's trained context, ${ctxSize} tokens)` : `-c ${ctxSize}`;
  const split = `${c} split over -np ${parallel} ${parallel === 1 ? "slot" : "slots"} leaves ${plural(perSlot, "token")} of context per slot`;
  const fix = "raise -c/--ctx-size or lower -np/--parallel";
  if (perSlot < 2)
    throw new InvalidArgumentError(
      `${split}: a slot needs at least 2 (one prompt token and one generated token); ${fix}`,
    );
  if (perSlot < SMALL_SLOT_CONTEXT)
    return `${split}: every request's prompt and reply must fit in ${plural(perSlot, "token")}; ${fix}`;
  return undefined;
}

/**
 * Checks serve's options (those the model loader takes too).
 * @throws InvalidArgumentError naming the option and the value.
 */
export function checkServeOptions(o: ServeOptions): void {
  if (o.port < 0 || o.port > 65535) throw new InvalidArgumentError(`--port must be in 0..65535, got ${o.port}`);
  if (o.parallel < 1) throw new InvalidArgumentError(`--parallel must be ≥ 1, got ${o.parallel}`);
  if (o.ctxSize !== undefined && o.ctxSize < 0)
    throw new InvalidArgumentError(`--ctx-size must be ≥ 0 (0: the model's trained context), got ${o.ctxSize}`);
  if (o.queue < 0) throw new InvalidArgumentError(`--queue must be ≥ 0, got ${o.queue}`);
  if (o.apiKey === "") throw new InvalidArgumentError("--api-key is empty");
  if (o.alias !== undefined && o.alias.trim() === "") throw new InvalidArgumentError("--alias is empty");
  checkModelOptions({ ...o, ctxSize: undefined });
}

export function register(program: Command): void {
  const base = program
    .command("serve")
    .description("serve a model over HTTP: OpenAI's API and llama.cpp's server API, with continuous batching")
    .requiredOption("-m, --model <file>", "GGUF or PowerInfer GGUF model file")
    .option("--host <address>", "address to listen on", "127.0.0.1")
    .option("--port <n>", "port to listen on (0 = any free port)", int("port", { min: 0, max: 65535 }), 8080)
    .option(
      "-c, --ctx-size <n>",
      "KV cache budget in tokens, split evenly over the slots (default: slots × the model's trained context, at most 4096 each; 0: the trained context)",
      int("ctx-size", { min: 0 }),
    )
    .option(
      "--np, --parallel <n>",
      "slots: requests decoded together in one batch (also -np), at most 256 as in llama.cpp (LLAMA_MAX_SEQ)",
      int("parallel", { min: 1, max: MAX_SEQUENCES }),
      1,
    )
    .option("--api-key <key>", "require this key (Authorization: Bearer KEY); env POWERINFER_API_KEY")
    .option("--metrics", "serve Prometheus metrics at /metrics")
    .option(
      "--queue <n>",
      "requests that may wait for a slot before the server answers 503",
      int("queue", { min: 0 }),
      64,
    )
    .option("--alias <name>", "model id reported by the API (default: the file name)")
    .option("-t, --threads <n>", "CPU threads (default, or -1: number of cores)", threadsArg())
    .option("-b, --batch-size <n>", "most tokens per decode step", int("batch-size", { min: 1 }), 512)
    .option("--backend <names>", 'backend: "auto" or a comma-separated list (env POWERINFER_BACKEND overrides)', "auto")
    .option("--kv-type <type>", "KV cache type: f16 or f32", choice("kv-type", ["f16", "f32"]), "f16")
    .option("--no-repack", REPACK_HELP)
    .option("--mmap", MMAP_HELP)
    .option(
      "--sparse <mode>",
      "FFN mode: predictor (default when the model has predictors), oracle or off",
      choice("sparse", ["predictor", "oracle", "off"]),
    )
    .option("--sparse-threshold <x>", "predictor threshold", float("sparse-threshold"))
    .option(
      "--ram-budget <GiB>",
      "GiB held for weights + the neuron cache (default: no limit); the sparse FFN's other rows (routed experts: whole experts) are read from the file on demand (see run --ram-budget)",
      float("ram-budget", { above: 0, max: 2 ** 20 }),
    )
    .option("--log", "log every request (JSON lines on stdout)");
  // the device options: hot neurons and --n-gpu-layers layers on a device, as run has them
  const cmd = deviceOptions(base)
    // generation defaults of requests that leave them out, as llama-server's options
    .option("-s, --seed <n>", "default RNG seed (-1 = random per request)", seedArg())
    .option("--temp <t>", `default ${TEMP_HELP} (default 0.8)`, float("temp"))
    .option("--top-k <k>", "default top-k (≤ 0 = off, as llama.cpp; default 40)", (v: string) =>
      Math.max(0, int("top-k")(v)),
    )
    .option("--top-p <p>", "default top-p (1 = off; default 0.95)", float("top-p", { min: 0, max: 1 }))
    .option("--min-p <p>", "default min-p (0 = off; default 0.05)", float("min-p", { min: 0, max: 1 }))
    .option(
      "-n, --n-predict <n>",
      "default tokens to generate (-1 = no limit, -2 = until the context is full; default -1)",
      int("n-predict", { min: 0, also: [-1, -2], alsoMeans: "-1 = no limit, -2 = until the context is full" }),
    )
    .option(
      "--repeat-penalty <x>",
      "default repetition penalty (1 = off; default 1)",
      float("repeat-penalty", { above: 0 }),
    )
    .option("--slots", "serve GET /slots (the default)")
    .option("--no-slots", "answer GET /slots with 501, as llama-server --no-slots")
    .option(
      "--chat-template <jinja>",
      "jinja chat template to use instead of the model's (its tool-call format is detected from it)",
    )
    .option("--chat-template-file <file>", "the same, read from a file")
    .action(
      action(async (o: ServeOptions) => {
        // every option is checked before listening: a bad value never gets as far as "listening"
        checkServeOptions(o);
        const chatTemplate = chatTemplateOption(o);
        checkInputFile(o.model); // a missing file is reported before listening
        accessSync(o.model, constants.R_OK);
        // so is a file that is not a model (bad header, vocabulary-only, a shard other than the first, …)
        const header = openGgufModel(o.model);
        assertModelFile(header);
        // llama-server's -c 0: the model's trained context, split over the slots
        const trained = o.ctxSize === 0;
        if (trained) o.ctxSize = parseModelConfig(header).n_ctx_train;
        // a slot too small for a prompt token and a reply is refused; a small one is warned about
        const slotWarning = o.ctxSize !== undefined ? checkSlotContext(o.ctxSize, o.parallel, trained) : undefined;
        if (slotWarning) process.stderr.write(`warning: ${slotWarning}\n`);
        const apiKey = o.apiKey ?? (process.env.POWERINFER_API_KEY || undefined);
        // the load starts once the port is open: its synchronous parts (copying weights into huge-page
        // memory) would otherwise hold the event loop before listen(), and nobody could connect until then
        let startLoad!: () => void;
        const listening = new Promise<void>((resolve) => {
          startLoad = resolve;
        });
        const loaded = listening.then(() =>
          loadModelWithDevice({ ...o, threads: o.threads ?? availableParallelism(), ctxSize: undefined }, true, {
            // the KV cache over all slots: -c, else slots × the model's context (at most 4096 each)
            kvPositions: (n) => o.ctxSize ?? n * o.parallel,
            // a step holds at most -b tokens over the slots
            batchColumns: o.parallel > 1 ? o.batchSize : undefined,
          }),
        );
        const server = createServer({
          model: loaded.then((l) => l.model),
          alias: o.alias,
          slots: o.parallel,
          ctxSize: o.ctxSize,
          nBatch: o.batchSize,
          kvType: o.kvType as KvCacheType,
          queueLimit: o.queue,
          apiKey,
          metrics: o.metrics ?? false,
          slotsEndpoint: o.slots ?? true,
          chatTemplate,
          defaults: {
            seed: o.seed,
            temperature: o.temp,
            topK: o.topK,
            topP: o.topP,
            minP: o.minP,
            nPredict: o.nPredict,
            repeatPenalty: o.repeatPenalty,
          },
          logger: o.log ?? false,
        });
        const url = await server.listen({ host: o.host, port: o.port }).catch(async (e: NodeJS.ErrnoException) => {
          await server.close().catch(() => undefined);
          // the system's words (EADDRINUSE, ENOTFOUND) name the cause but not the option to change
          if (e.code === "EADDRINUSE")
            throw new InvalidArgumentError(
              `port ${o.port} on ${o.host} is in use by another program: choose another --port (0 = any free port)`,
            );
          if (e.code === "ENOTFOUND" || e.code === "EAI_AGAIN")
            throw new InvalidArgumentError(
              `cannot listen on --host ${o.host}: the host name cannot be resolved (${e.code === "EAI_AGAIN" ? "EAI_AGAIN: name resolution failed for now" : e.code}); give an address of this machine or a name that resolves to one`,
            );
          if (e.code === "EADDRNOTAVAIL")
            throw new InvalidArgumentError(
              `cannot listen on --host ${o.host}: not an address of this machine (${e.code})`,
            );
          if (e.code === "EACCES")
            throw new InvalidArgumentError(
              `no permission to listen on port ${o.port}: ports below 1024 need root; choose another --port`,
            );
          throw e;
        });
        process.stderr.write(`powerinfer serve: listening on ${url}, loading ${o.model}\n`);
        let stopping: Promise<void> | undefined;
        // (announced on a signal; a failed load closes quietly, so its error is the last line)
        const stop = (announce = true) => {
          stopping ??= (async () => {
            if (announce) process.stderr.write("powerinfer serve: stopping\n");
            await server.close();
          })();
          return stopping;
        };
        const done = new Promise<void>((resolve) => {
          const onSignal = () => {
            process.off("SIGINT", onSignal);
            process.off("SIGTERM", onSignal);
            void stop().then(resolve);
          };
          process.on("SIGINT", onSignal);
          process.on("SIGTERM", onSignal);
        });
        // (a turn of the event loop first, so the line above and the signal handlers are in place)
        setImmediate(startLoad);
        try {
          await server.ready;
        } catch (e) {
          await stop(false);
          throw e;
        }
        const { backend, model, device } = await loaded;
        const s = server.scheduler;
        if (!s) {
          // stopped while loading
          await done;
          (await loaded).dispose();
          return;
        }
        for (const w of [...model.config.warnings, ...s.warnings]) process.stderr.write(`warning: ${w}\n`);
        if (model.ramPlan) process.stderr.write(`powerinfer serve: ${describeRamPlan(model)}\n`);
        process.stderr.write(
          `powerinfer serve: ready — ${s.nSlots} slot${s.nSlots > 1 ? "s" : ""} × ${s.nCtx} tokens, ${backend.name} backend (${plural(backend.threads, "thread")})${device ? `, ${(await loaded).summary}` : ""}, FFN ${model.sparse === "off" ? "dense" : `sparse (${model.sparse})`}${apiKey ? ", API key required" : ""}${o.metrics ? ", /metrics on" : ""}\n`,
        );
        await done;
        (await loaded).dispose();
      }),
    );
  acceptNp(cmd);
}
