/**
 * The HTTP server (fastify): OpenAI's API and llama.cpp's, over one model whose slots are decoded together
 * by a {@link BatchScheduler} (continuous batching). It answers as soon as it is created: `/health` (and
 * everything else) says 503 until the model has loaded.
 */
import { STATUS_CODES } from "node:http";
import type { Duplex } from "node:stream";
import { basename } from "node:path";
import { BatchScheduler, ChatTemplate, EngineError, type KvCacheType, type Model } from "@powerinfer/engine";
import Fastify, { type FastifyInstance, type FastifyRequest } from "fastify";
import { buildInfo } from "./build-info.js";
import type { GenerationDefaults, ServerContext } from "./context.js";
import { ApiError, BODY_LIMIT_BYTES, toApiError } from "./errors.js";
import { registerLlamaCpp } from "./llamacpp.js";
import { prometheusText } from "./metrics.js";
import { registerOpenAi } from "./openai.js";
import { TokenizerService } from "./tokenize.js";

export type { GenerationDefaults } from "./context.js";

/** Options of {@link createServer}; every field but `model` is optional. */
export interface ServerOptions {
  /** The model, or a promise of it while it loads (requests get 503 until it resolves). The caller keeps ownership. */
  model: Model | Promise<Model>;
  /** The model id reported by the API. Default: the file name. */
  alias?: string;
  /** Slots: requests decoded together in one batch. Default 1. */
  slots?: number;
  /**
   * KV cache budget in tokens, split evenly over the slots (as llama.cpp's `-c` with `-np`).
   * Default: slots × the model's trained context (at most 4096 each).
   */
  ctxSize?: number;
  /** Most tokens per decode step. Default 512. */
  nBatch?: number;
  /** KV cache type. Default "f16". */
  kvType?: KvCacheType;
  /** Requests that may wait for a slot before the server answers 503. Default 64. */
  queueLimit?: number;
  /**
   * When set, every endpoint but `/health` and `/models` needs the key: `Authorization: Bearer <key>`,
   * `Authorization: <key>` or `X-Api-Key: <key>` (as llama.cpp).
   */
  apiKey?: string;
  /** Serve `GET /metrics`. Default false (501). */
  metrics?: boolean;
  /** Serve `GET /slots`. Default true (llama.cpp's `--no-slots`: 501). */
  slotsEndpoint?: boolean;
  /** Generation defaults for requests that leave a setting out (llama-server's `--seed`, `--temp`, …). */
  defaults?: GenerationDefaults;
  /**
   * A jinja chat template used instead of the model's (llama.cpp's `--chat-template` with `--jinja`); its
   * tool-call format is detected from it. Checked when the server is created.
   */
  chatTemplate?: string;
  /** fastify's request log. Default false. */
  logger?: boolean;
}

/** A created server. */
export interface PowerinferServer {
  readonly app: FastifyInstance;
  /** Resolves when the model has loaded and the slots are allocated; rejects when loading failed. */
  readonly ready: Promise<void>;
  /** The scheduler, once ready. */
  readonly scheduler: BatchScheduler | undefined;
  /** Starts listening; resolves to the address, e.g. "http://127.0.0.1:8080". */
  listen(opts?: { host?: string; port?: number }): Promise<string>;
  /** Aborts every request, frees the slots, and stops listening. The model is not disposed. */
  close(): Promise<void>;
}

/** Endpoints reachable without the API key (as llama.cpp's server). */
const HTTP_METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"] as const;

const PUBLIC = new Set(["/health", "/v1/health", "/models", "/v1/models"]);

/** llama.cpp's CORS answer (its defaults: any origin, with credentials). */
const CORS_METHODS = "GET, POST, DELETE, OPTIONS";
const CORS_HEADERS = "*";

/** The body as text; invalid UTF-8 is refused rather than replaced by U+FFFD. */
const utf8 = new TextDecoder("utf-8", { fatal: true });

function pathOf(req: FastifyRequest): string {
  const q = req.url.indexOf("?");
  return q < 0 ? req.url : req.url.slice(0, q);
}

/** @throws EngineError 'BAD_INPUT' naming the first bad option. */
function checkOptions(opts: ServerOptions): void {
  const integer = (v: number | undefined, what: string, min: number) => {
    if (v !== undefined && (!Number.isInteger(v) || v < min))
      throw new EngineError("BAD_INPUT", `${what} must be an integer ≥ ${min}, got ${v}`);
  };
  integer(opts.slots, "slots", 1);
  integer(opts.ctxSize, "ctxSize", 1);
  integer(opts.nBatch, "nBatch", 1);
  integer(opts.queueLimit, "queueLimit", 0);
  const slots = opts.slots ?? 1;
  if (opts.ctxSize !== undefined && opts.ctxSize < slots)
    throw new EngineError("BAD_INPUT", `ctxSize ${opts.ctxSize} leaves no context for ${slots} slots`);
  if (opts.kvType !== undefined && opts.kvType !== "f16" && opts.kvType !== "f32")
    throw new EngineError("BAD_INPUT", `kvType must be f16 or f32, got ${String(opts.kvType)}`);
  checkDefaults(opts.defaults ?? {});
  if (opts.chatTemplate !== undefined) {
    if (typeof opts.chatTemplate !== "string" || opts.chatTemplate.trim() === "")
      throw new EngineError("BAD_INPUT", "chatTemplate is empty");
    new ChatTemplate(opts.chatTemplate, false, "", ""); // throws when it does not parse
  }
}

/** @throws EngineError 'BAD_INPUT' naming the first bad default. */
export function checkDefaults(d: GenerationDefaults): void {
  const bad = (what: string, rule: string, v: number) => {
    throw new EngineError("BAD_INPUT", `defaults.${what} must be ${rule}, got ${v}`);
  };
  const { seed, temperature, topK, topP, minP, nPredict, repeatPenalty } = d;
  if (seed !== undefined && !(Number.isInteger(seed) && ((seed >= 0 && seed <= 0xffffffff) || seed === -1)))
    bad("seed", "an integer in [0, 4294967295] or -1 (random)", seed);
  if (temperature !== undefined && !Number.isFinite(temperature)) bad("temperature", "a number", temperature);
  if (topK !== undefined && !(Number.isInteger(topK) && topK >= 0)) bad("topK", "an integer ≥ 0", topK);
  if (topP !== undefined && !(topP >= 0 && topP <= 1)) bad("topP", "in [0, 1]", topP);
  if (minP !== undefined && !(minP >= 0 && minP <= 1)) bad("minP", "in [0, 1]", minP);
  if (nPredict !== undefined && !(Number.isInteger(nPredict) && nPredict >= -2))
    bad("nPredict", "an integer ≥ -2 (-1 = no limit, -2 = until the context is full)", nPredict);
  if (repeatPenalty !== undefined && !(repeatPenalty > 0)) bad("repeatPenalty", "> 0", repeatPenalty);
}

/**
 * Creates the server (not yet listening).
 * @throws EngineError 'BAD_INPUT' for a bad option (before anything is loaded or listens).
 */
export function createServer(opts: ServerOptions): PowerinferServer {
  checkOptions(opts);
  const app = Fastify({
    logger: opts.logger ?? false,
    bodyLimit: BODY_LIMIT_BYTES,
    forceCloseConnections: true,
    clientErrorHandler: answerClientError,
  });
  let ctx: ServerContext | undefined;
  let loadError: unknown;
  let closed = false;
  /** Unix seconds the server started (llama.cpp's `Process-Start-Time-Unix` on /metrics). */
  const startTime = Math.floor(Date.now() / 1000);

  const ready = (async () => {
    try {
      const model = await opts.model;
      const slots = opts.slots ?? 1;
      const perSlot =
        opts.ctxSize !== undefined ? Math.floor(opts.ctxSize / slots) : Math.min(model.config.n_ctx_train, 4096);
      const scheduler = new BatchScheduler(model, {
        slots,
        nCtx: perSlot,
        kvType: opts.kvType,
        nBatch: opts.nBatch,
        queueLimit: opts.queueLimit,
      });
      if (closed) {
        await scheduler.close();
        return;
      }
      const tok = model.tokenizer;
      const bos = tok.bosId === undefined ? "" : tok.tokenText(tok.bosId);
      const eos = tok.eosId === undefined ? "" : tok.tokenText(tok.eosId);
      const template =
        opts.chatTemplate !== undefined
          ? new ChatTemplate(opts.chatTemplate, false, bos, eos)
          : ChatTemplate.fromGguf(model.file, bos, eos);
      ctx = {
        model,
        scheduler,
        template,
        alias: opts.alias ?? basename(model.file.path),
        modelPath: model.file.path,
        created: Math.floor(Date.now() / 1000),
        defaults: { ...opts.defaults },
        tokens: new TokenizerService(tok),
        build: buildInfo(),
        endpoints: { slots: opts.slotsEndpoint ?? true, metrics: opts.metrics ?? false },
      };
    } catch (e) {
      loadError = e;
      throw e;
    }
  })();
  ready.catch(() => {}); // reported through /health and to whoever awaits `ready`

  const getCtx = (): ServerContext => {
    if (!ctx) throw new ApiError(503, "unavailable_error", "Loading model");
    return ctx;
  };

  // llama.cpp accepts a JSON body whatever the content type says (curl -d sends form encoding, fetch text/plain)
  app.removeAllContentTypeParsers();
  app.addContentTypeParser("*", { parseAs: "buffer" }, (_req, body, done) => {
    let text: string;
    try {
      text = utf8.decode(body as Buffer);
    } catch {
      return done(new ApiError(400, "invalid_request_error", "the body is not valid UTF-8"), undefined);
    }
    if (text.trim() === "") return done(null, undefined);
    try {
      done(null, JSON.parse(text));
    } catch (e) {
      done(
        new ApiError(400, "invalid_request_error", `the body is not valid JSON: ${(e as Error).message}`),
        undefined,
      );
    }
  });

  app.addHook("onRequest", async (req, reply) => {
    const path = pathOf(req);
    // CORS as llama.cpp: the request's origin is allowed (with credentials) on every response — set on the
    // raw response so that streamed (hijacked) answers carry it too — and a preflight is answered at once,
    // without a key (browsers send none)
    const origin = req.headers.origin;
    if (origin) reply.raw.setHeader("Access-Control-Allow-Origin", origin);
    if (req.method === "OPTIONS") {
      return reply
        .code(200)
        .header("Access-Control-Allow-Credentials", "true")
        .header("Access-Control-Allow-Methods", CORS_METHODS)
        .header("Access-Control-Allow-Headers", CORS_HEADERS)
        .type("text/html")
        .send("");
    }
    if (opts.apiKey !== undefined && !PUBLIC.has(path)) {
      // llama.cpp: Authorization with or without "Bearer ", else X-Api-Key
      const auth = req.headers.authorization;
      const key = auth ? (auth.startsWith("Bearer ") ? auth.slice(7) : auth).trim() : req.headers["x-api-key"];
      if (key !== opts.apiKey) {
        const e = new ApiError(401, "authentication_error", key === undefined ? "Missing API key" : "Invalid API key");
        return reply.code(401).send(e.body());
      }
    }
    if (path === "/health" || path === "/v1/health") return;
    if (!ctx) {
      const e = loadError
        ? new ApiError(500, "server_error", `the model failed to load: ${(loadError as Error).message ?? loadError}`)
        : new ApiError(503, "unavailable_error", "Loading model");
      return reply.code(e.status).send(e.body());
    }
  });

  app.setErrorHandler((err, _req, reply) => {
    const e = toApiError(err);
    if (e.status >= 500 && e.type === "server_error") app.log.error(err);
    if (!reply.sent && !reply.raw.headersSent) reply.code(e.status).send(e.body());
  });

  app.setNotFoundHandler((req, reply) => {
    const path = pathOf(req);
    // a path that exists with other methods: 405 and the methods it takes (RFC 9110 §15.5.6)
    const allow = HTTP_METHODS.filter((method) => app.hasRoute({ method, url: path }));
    if (allow.length > 0) {
      const e = new ApiError(
        405,
        "invalid_request_error",
        `${req.method} is not allowed on ${path}; use ${allow.join(" or ")}`,
      );
      reply.code(405).header("allow", allow.join(", ")).send(e.body());
      return;
    }
    const e = new ApiError(404, "not_found_error", `no route ${req.method} ${path}`);
    reply.code(404).send(e.body());
  });

  const health = async (_req: FastifyRequest, reply: import("fastify").FastifyReply) => {
    if (ctx) return { status: "ok" };
    const e = loadError
      ? new ApiError(500, "server_error", `the model failed to load: ${(loadError as Error).message ?? loadError}`)
      : new ApiError(503, "unavailable_error", "Loading model");
    return reply.code(e.status).send(e.body());
  };
  app.get("/health", health);
  app.get("/v1/health", health);

  app.get("/metrics", async (_req, reply) => {
    if (!opts.metrics) {
      throw new ApiError(501, "not_supported_error", "this server does not serve metrics; start it with --metrics");
    }
    reply.type("text/plain; version=0.0.4; charset=utf-8");
    reply.header("Process-Start-Time-Unix", String(startTime));
    return prometheusText(getCtx().scheduler);
  });

  registerOpenAi(app, getCtx);
  registerLlamaCpp(app, getCtx);

  return {
    app,
    ready,
    get scheduler() {
      return ctx?.scheduler;
    },
    async listen(o = {}) {
      return app.listen({ host: o.host ?? "127.0.0.1", port: o.port ?? 8080 });
    },
    async close() {
      closed = true;
      await ctx?.scheduler.close();
      ctx?.tokens.close();
      await app.close();
    },
  };
}

/**
 * A request node's HTTP parser refuses (a malformed request line or header, headers too large, a request that
 * took too long to arrive) is answered in the OpenAI error shape every other error has, then the connection is
 * closed (fastify's default answers `{"error":"Bad Request","message":"Client Error"}`).
 */
function answerClientError(err: NodeJS.ErrnoException, socket: Duplex): void {
  if (err.code === "ECONNRESET" || socket.destroyed) return;
  const [status, message] =
    err.code === "ERR_HTTP_REQUEST_TIMEOUT"
      ? [408, "the request took too long to arrive"]
      : err.code === "HPE_HEADER_OVERFLOW"
        ? [431, "the request's headers are too large"]
        : [400, `malformed HTTP request (${err.code ?? "parse error"}${err.message ? `: ${err.message}` : ""})`];
  const body = JSON.stringify(new ApiError(status, "invalid_request_error", message).body());
  if (socket.writable) {
    socket.write(
      `HTTP/1.1 ${status} ${STATUS_CODES[status]}\r\nContent-Length: ${Buffer.byteLength(body)}\r\nContent-Type: application/json\r\nConnection: close\r\n\r\n${body}`,
    );
  }
  socket.destroy(err);
}
