/**
 * Continuous batching. A fixed set of slots — each a {@link Session} with its own KV cache — shares one
 * model. Requests wait in a bounded queue, take a free slot between decode steps, and leave the batch when
 * they finish, are cancelled or their signal aborts (the slot is free for the next step; its cache is simply
 * overwritten, nothing is allocated per request). One decode step is one graph over the new tokens of every
 * busy slot ({@link Model.decodeBatch}): one token per generating slot, then prompt chunks in the room left
 * by `nBatch`. Each sequence is sampled by its own {@link Generation}, so its tokens are the ones it would
 * get alone.
 */
import type { BatchEntry, Model, Session } from "./engine.js";
import { type GeneratedToken, Generation, type GenerateOptions, type StopReason, type Timings } from "./generation.js";
import { BackendError } from "@powerinfer/core";
import { EngineError } from "../errors.js";
import type { KvCacheType } from "../model/kv-cache.js";
import { formatBytes } from "../model/ram-budget.js";

/** Options of a {@link BatchScheduler}. */
export interface BatchSchedulerOptions {
  /** Slots: sequences decoded together. Default 1. */
  slots?: number;
  /** Context of each slot in tokens. Default: the model's n_ctx_train, at most 4096. */
  nCtx?: number;
  /** KV cache element type. Default "f16". */
  kvType?: KvCacheType;
  /** Most tokens (graph columns) in one decode step; prompt chunks fill what generating slots leave. Default 512. */
  nBatch?: number;
  /** Requests that may wait for a slot; one more is refused with EngineError 'QUEUE_FULL'. Default 64. */
  queueLimit?: number;
}

/** Options of one request ({@link BatchScheduler.submit}). */
export interface BatchRequestOptions extends GenerateOptions {
  /** Report, for every generated token, its log-probability and the `nProbs` most likely tokens'. Default 0. */
  nProbs?: number;
  /**
   * Reuse the longest prefix of the prompt that a free slot's cache still holds from its last request
   * (llama.cpp's `cache_prompt`); the output is the same, only that prefix is not evaluated again. Default true.
   */
  cachePrompt?: boolean;
  /**
   * The slot to run in (llama.cpp's `id_slot`), in [0, nSlots); the request waits for that slot while
   * later ones take other free slots. Undefined or −1: any free slot.
   */
  slot?: number;
  /**
   * With `nProbs` > 0: report, for every generated token, the candidates the sampler chain left and their
   * probabilities (llama.cpp's `post_sampling_probs`) in {@link BatchToken.post}. Default false.
   */
  postSamplingProbs?: boolean;
  /**
   * Called when the request takes a slot (nothing evaluated yet) and after every decode step that evaluated
   * a chunk of its prompt (llama.cpp's `return_progress`).
   */
  onPromptProgress?: (p: PromptProgress) => void;
}

/** How far a request's prompt has been evaluated. */
export interface PromptProgress {
  /** Prompt tokens. */
  total: number;
  /** Prompt tokens found in the slot's cache (not evaluated). */
  cache: number;
  /** Prompt tokens in the cache now: `cache` plus those evaluated so far. */
  processed: number;
  /** Milliseconds since the request took its slot. */
  timeMs: number;
  /** The slot the request took (llama.cpp's `id_slot`). */
  slot: number;
}

/** A token and its log-probability under the model (log-softmax of the raw logits). */
export interface TokenLogprob {
  id: number;
  logprob: number;
}

/** One generated token of a batch request (id −1: text released at the end without a token). */
export interface BatchToken extends GeneratedToken {
  /** With `nProbs` > 0: the token's log-probability and the most likely alternatives, best first. */
  logprob?: number;
  top?: TokenLogprob[];
  /**
   * With `nProbs` > 0 and `postSamplingProbs`: the token's probability after the sampler chain and the
   * `nProbs` most likely candidates the chain left (probability > 0), best first.
   */
  post?: { prob: number; top: { id: number; p: number }[] };
}

/** Timings of a request; `promptMs`/`generateMs` are wall times while it was in the batch. */
export interface BatchTimings extends Timings {
  /** Time spent waiting for a slot. */
  queueMs: number;
  /** Time from submission to the first generated token (undefined when none came). */
  firstTokenMs?: number;
}

/** Counters of a {@link BatchScheduler} since it was created. */
export interface BatchMetrics {
  /** Graphs computed (decode steps). */
  decodeSteps: number;
  /** Sum over steps of the sequences in the step (÷ decodeSteps = mean sequences per step). */
  sequencesInSteps: number;
  /** Most sequences seen in one step. */
  maxSequencesPerStep: number;
  /** `stepsBySequences[n]` = steps that carried n sequences. */
  stepsBySequences: number[];
  /** Steps in which at least two sequences were generating (not only evaluating a prompt). */
  sharedDecodeSteps: number;
  /** Tokens (graph columns) computed. */
  tokensEvaluated: number;
  /** Milliseconds the backend computed. */
  computeMs: number;
  /** Prompt tokens evaluated and their summed per-request wall time. */
  promptTokens: number;
  /** Prompt tokens found in a slot's cache (not evaluated again). */
  promptTokensCached: number;
  promptMs: number;
  /** Tokens generated and their summed per-request wall time. */
  generatedTokens: number;
  generateMs: number;
  requestsSubmitted: number;
  requestsFinished: number;
  requestsAborted: number;
  /** Refused with QUEUE_FULL. */
  requestsRejected: number;
  requestsFailed: number;
  /** Largest number of positions any slot held. */
  nTokensMax: number;
}

/** A slot as {@link BatchScheduler.slots} reports it. */
export interface SlotInfo {
  id: number;
  nCtx: number;
  busy: boolean;
  /** The request in the slot, or −1. */
  requestId: number;
  /** "idle", "prompt" (evaluating the prompt) or "generate". */
  state: "idle" | "prompt" | "generate";
  /** Positions in the slot's cache (an idle slot keeps its last request's for prompt caching). */
  nPast: number;
  promptTokens: number;
  generatedTokens: number;
  /** Tokens left before `maxTokens` (−1 = no limit). */
  remaining: number;
  options?: BatchRequestOptions;
  /** The request in the slot, or else the last one it ran (undefined for a slot never used). */
  lastRequestId?: number;
  lastOptions?: BatchRequestOptions;
  /** Prompt tokens of that request found in the cache, and evaluated. */
  cachedTokens: number;
  processedTokens: number;
}

/** Length of the common prefix of two token lists. */
function commonPrefix(a: readonly number[], b: readonly number[]): number {
  const n = Math.min(a.length, b.length);
  let i = 0;
  while (i < n && a[i] === b[i]) i++;
  return i;
}

/** log-softmax of `logits` at `id`, and the `n` best tokens (ties → lower id). */
export function tokenLogprobs(logits: Float32Array, id: number, n: number): { logprob: number; top: TokenLogprob[] } {
  let max = -Infinity;
  for (let i = 0; i < logits.length; i++) if (logits[i]! > max) max = logits[i]!;
  let sum = 0;
  for (let i = 0; i < logits.length; i++) sum += Math.exp(logits[i]! - max);
  const lse = max + Math.log(sum);
  const top: TokenLogprob[] = [];
  if (n > 0) {
    // partial selection: keep the n best in a small sorted array
    for (let i = 0; i < logits.length; i++) {
      const v = logits[i]!;
      if (top.length === n && v <= top[n - 1]!.logprob) continue;
      let j = top.length < n ? top.length : n - 1;
      if (top.length < n) top.push({ id: i, logprob: v });
      while (j > 0 && top[j - 1]!.logprob < v) {
        top[j] = top[j - 1]!;
        j--;
      }
      top[j] = { id: i, logprob: v };
    }
    for (const t of top) t.logprob -= lse;
  }
  return { logprob: logits[id]! - lse, top };
}

/**
 * One request in a {@link BatchScheduler}: an async iterable of its tokens (iterate it once), plus its
 * outcome. Breaking out of the iteration cancels the request.
 */
export class BatchRequest implements AsyncIterable<BatchToken> {
  /** Slot it runs (or ran) in; −1 while queued. */
  slot = -1;
  stopReason?: StopReason;
  /** The stop string that ended it (stopReason "stop"). */
  stoppingWord?: string;
  /** Set when the request failed (the iteration throws it too). */
  error?: unknown;
  readonly timings: BatchTimings;
  /** Resolves when the request has finished, however it ended (never rejects). */
  readonly finished: Promise<void>;

  /** @internal */ gen: Generation;
  /** @internal */ promptPos = 0;
  /** Prompt tokens found in the slot's cache (not evaluated again). */
  cachedTokens = 0;
  /**
   * Positions in the slot's cache when the request ended (llama.cpp's `tokens_cached`: the prompt and every
   * generated token but the last, which was sampled and never evaluated).
   */
  nPast = 0;
  /** @internal */ pending = -1;
  /** @internal */ readonly submittedAt = performance.now();
  /** @internal */ startedAt = 0;
  /** @internal */ generateStartedAt = 0;
  private buffer: BatchToken[] = [];
  private wake?: () => void;
  private done = false;
  private resolveFinished!: () => void;
  private cancelled = false;

  /** @internal */
  constructor(
    readonly id: number,
    readonly promptIds: readonly number[],
    readonly options: BatchRequestOptions,
    model: Model,
    private readonly onCancel: (r: BatchRequest) => void,
  ) {
    this.gen = new Generation(model.tokenizer, promptIds, options);
    if (options.postSamplingProbs && (options.nProbs ?? 0) > 0) this.gen.sampler.keepCandidates = true;
    this.timings = {
      promptTokens: promptIds.length,
      promptMs: 0,
      generatedTokens: 0,
      generateMs: 0,
      queueMs: 0,
    };
    this.finished = new Promise((r) => {
      this.resolveFinished = r;
    });
  }

  /** True once cancelled or its signal aborted. */
  get aborted(): boolean {
    return this.cancelled || !!this.options.signal?.aborted;
  }

  /** True when it stopped because its slot's context was full (llama.cpp's `truncated`). */
  get truncated(): boolean {
    return this.stopReason === "context";
  }

  /** True once it has finished. */
  get isDone(): boolean {
    return this.done;
  }

  /** Stops the request; it leaves the batch (or the queue) at the next step. */
  cancel(): void {
    if (this.done || this.cancelled) return;
    this.cancelled = true;
    this.onCancel(this);
  }

  /** @internal */
  push(t: BatchToken): void {
    if (t.id >= 0 && this.timings.firstTokenMs === undefined)
      this.timings.firstTokenMs = performance.now() - this.submittedAt;
    this.buffer.push(t);
    this.wake?.();
  }

  /** @internal */
  finish(reason: StopReason, error?: unknown): void {
    if (this.done) return;
    const tail = error === undefined ? this.gen.flush() : "";
    if (tail) this.buffer.push({ id: -1, text: tail });
    this.done = true;
    this.stopReason = reason;
    this.error = error;
    const now = performance.now();
    if (this.generateStartedAt > 0) this.timings.generateMs = now - this.generateStartedAt;
    else if (this.startedAt > 0) this.timings.promptMs = now - this.startedAt;
    this.timings.generatedTokens = this.gen.generated;
    this.timings.stopReason = reason;
    this.wake?.();
    this.resolveFinished();
  }

  async *[Symbol.asyncIterator](): AsyncIterator<BatchToken> {
    try {
      for (;;) {
        if (this.buffer.length > 0) {
          yield this.buffer.shift()!;
          continue;
        }
        if (this.done) {
          if (this.error !== undefined) throw this.error;
          return;
        }
        await new Promise<void>((r) => {
          this.wake = r;
        });
        this.wake = undefined;
      }
    } finally {
      if (!this.done) this.cancel();
    }
  }

  /** Collects the whole output: text, tokens, and how it ended. @throws the request's error. */
  async collect(): Promise<{ text: string; tokens: BatchToken[]; stopReason: StopReason }> {
    let text = "";
    const tokens: BatchToken[] = [];
    for await (const t of this) {
      text += t.text;
      if (t.id >= 0) tokens.push(t);
    }
    return { text, tokens, stopReason: this.stopReason! };
  }
}

interface Slot {
  id: number;
  session: Session;
  req?: BatchRequest;
  /** The last request that ran in the slot (for {@link BatchScheduler.slots}). */
  last?: BatchRequest;
  /** The tokens in the slot's cache, positions 0..nPast−1 (kept after a request for prompt caching). */
  tokens: number[];
}

/**
 * Schedules requests over slots of one model with continuous batching. Each step's graph is computed off the
 * JavaScript thread ({@link Model.decodeBatchAsync}), so sockets, timers, new requests and aborts are handled
 * while it runs; sampling and the next step's graph are built on the event loop between computes.
 */
export class BatchScheduler {
  readonly nSlots: number;
  readonly nCtx: number;
  readonly nBatch: number;
  readonly queueLimit: number;
  readonly metrics: BatchMetrics = {
    decodeSteps: 0,
    sequencesInSteps: 0,
    maxSequencesPerStep: 0,
    stepsBySequences: [],
    sharedDecodeSteps: 0,
    tokensEvaluated: 0,
    computeMs: 0,
    promptTokens: 0,
    promptTokensCached: 0,
    promptMs: 0,
    generatedTokens: 0,
    generateMs: 0,
    requestsSubmitted: 0,
    requestsFinished: 0,
    requestsAborted: 0,
    requestsRejected: 0,
    requestsFailed: 0,
    nTokensMax: 0,
  };
  private readonly slotList: Slot[] = [];
  private readonly queue: BatchRequest[] = [];
  private nextId = 0;
  private running = false;
  private closed = false;

  /**
   * Allocates every slot's KV cache up front.
   * @throws EngineError 'BAD_INPUT' for a bad option, BackendError 'OUT_OF_MEMORY' when the caches do not fit.
   */
  constructor(
    readonly model: Model,
    opts: BatchSchedulerOptions = {},
  ) {
    this.nSlots = opts.slots ?? 1;
    this.nBatch = opts.nBatch ?? 512;
    this.queueLimit = opts.queueLimit ?? 64;
    const positive = (v: number, what: string, min = 1) => {
      if (!Number.isInteger(v) || v < min)
        throw new EngineError("BAD_INPUT", `${what} must be an integer ≥ ${min}, got ${v}`);
    };
    positive(this.nSlots, "slots");
    positive(this.nBatch, "nBatch");
    positive(this.queueLimit, "queueLimit", 0);
    try {
      for (let i = 0; i < this.nSlots; i++) {
        const session = model.createSession({ nCtx: opts.nCtx, kvType: opts.kvType, nBatch: this.nBatch });
        this.slotList.push({ id: i, session, tokens: [] });
        // each cache alone is checked by KvCache; all of them together are checked here, before the rest
        // are made (else many slots fill the memory one cache at a time)
        if (i === 0 && this.nSlots > 1) this.checkSlotsFit(session);
      }
    } catch (e) {
      for (const s of this.slotList) s.session.dispose();
      throw e;
    }
    this.nCtx = this.slotList[0]!.session.nCtx;
  }

  /**
   * Throws when nSlots KV caches like the first slot's (its layers on the model's main backend) exceed the
   * main backend's free memory (its device's `freeMemory`).
   * @throws BackendError 'OUT_OF_MEMORY' naming the slots, the bytes and the fix.
   */
  private checkSlotsFit(first: Session): void {
    const kv = first.kv;
    let bytes = 0;
    for (let l = 0; l < kv.k.length; l++) if (kv.owners[l] === this.model.backend) bytes += 2 * kv.k[l]!.byteLength;
    // (the backend's free memory as it was when the backend loaded, before any cache was made)
    const free = this.model.backend.devices[0]?.freeMemory;
    if (free !== undefined && free > 0 && bytes * this.nSlots > free) {
      throw new BackendError(
        "OUT_OF_MEMORY",
        `${this.nSlots} slots need KV caches of ${formatBytes(bytes * this.nSlots, 2)} (n_ctx ${kv.nCtx} each), ${this.model.backend.name} has ${formatBytes(free, 2)} free; use fewer slots (-np) or a smaller -c`,
      );
    }
  }

  /** Warnings of the slot sessions (e.g. a context beyond the trained one). */
  get warnings(): string[] {
    return this.slotList[0]?.session.warnings ?? [];
  }

  /** Requests waiting for a slot. */
  get queued(): number {
    return this.queue.length;
  }

  /** Slots holding a request. */
  get busy(): number {
    return this.slotList.filter((s) => s.req).length;
  }

  /**
   * Queues a request; it starts at the next step that has a free slot. A text prompt is tokenized with
   * `addSpecial` (default true) and `parseSpecial` (default false).
   * @throws EngineError 'BAD_INPUT' (empty prompt, bad token id), 'PROMPT_TOO_LONG' (more tokens than a
   *   slot's context), 'QUEUE_FULL' (every slot busy and `queueLimit` requests waiting), 'DISPOSED'.
   */
  submit(prompt: string | readonly number[], opts: BatchRequestOptions = {}): BatchRequest {
    if (this.closed) throw new EngineError("DISPOSED", "the scheduler is closed");
    const tok = this.model.tokenizer;
    const ids =
      typeof prompt === "string"
        ? tok.tokenize(prompt, { addSpecial: opts.addSpecial ?? true, parseSpecial: opts.parseSpecial ?? false })
        : [...prompt];
    if (ids.length === 0) throw new EngineError("BAD_INPUT", "empty prompt");
    const want = opts.slot;
    if (want !== undefined && want !== -1 && !(Number.isInteger(want) && want >= 0 && want < this.nSlots)) {
      throw new EngineError(
        "BAD_INPUT",
        `slot ${want} does not exist: there ${this.nSlots === 1 ? "is 1 slot (0)" : `are ${this.nSlots} slots (0–${this.nSlots - 1})`}; -1 = any free slot`,
      );
    }
    const nv = this.model.config.n_vocab;
    for (const t of ids) {
      if (!Number.isInteger(t) || t < 0 || t >= nv)
        throw new EngineError("BAD_INPUT", `token id ${t} outside [0, ${nv})`);
    }
    if (ids.length > this.nCtx) {
      throw new EngineError(
        "PROMPT_TOO_LONG",
        `prompt has ${ids.length} tokens, a slot's context has room for ${this.nCtx} (n_ctx ${this.nCtx})`,
      );
    }
    const free = this.slotList.filter((s) => !s.req).length;
    if (this.queue.length >= this.queueLimit + free) {
      this.metrics.requestsRejected++;
      throw new EngineError(
        "QUEUE_FULL",
        `server busy: all ${this.nSlots} slots are in use and ${this.queue.length - free} requests are waiting (limit ${this.queueLimit}); retry later`,
      );
    }
    const req = new BatchRequest(this.nextId++, ids, opts, this.model, (r) => this.onCancel(r));
    this.metrics.requestsSubmitted++;
    this.queue.push(req);
    opts.signal?.addEventListener("abort", () => this.onCancel(req), { once: true });
    this.kick();
    return req;
  }

  /** Every slot's state. */
  slots(): SlotInfo[] {
    return this.slotList.map((s) => {
      const r = s.req;
      const max = r?.options.maxTokens ?? -1;
      return {
        id: s.id,
        nCtx: s.session.nCtx,
        busy: !!r,
        requestId: r?.id ?? -1,
        state: !r ? "idle" : r.promptPos < r.promptIds.length || r.pending < 0 ? "prompt" : "generate",
        nPast: s.session.nPast,
        promptTokens: r?.promptIds.length ?? 0,
        generatedTokens: r?.gen.generated ?? 0,
        remaining: r && max >= 0 ? Math.max(0, max - r.gen.generated) : -1,
        options: r?.options,
        lastRequestId: (r ?? s.last)?.id,
        lastOptions: (r ?? s.last)?.options,
        cachedTokens: (r ?? s.last)?.cachedTokens ?? 0,
        processedTokens: r ? r.promptPos - r.cachedTokens : s.last ? s.last.promptPos - s.last.cachedTokens : 0,
      };
    });
  }

  /** Aborts every request, waits for the running step, and frees the slots' caches. */
  async close(): Promise<void> {
    if (this.closed) return;
    this.closed = true;
    for (const r of this.queue.splice(0)) this.end(r, "aborted");
    for (const s of this.slotList) if (s.req) this.release(s, "aborted");
    while (this.running) await new Promise((r) => setImmediate(r));
    for (const s of this.slotList) s.session.dispose();
  }

  private onCancel(r: BatchRequest): void {
    const i = this.queue.indexOf(r);
    if (i >= 0) {
      // never started: leave the queue now
      this.queue.splice(i, 1);
      this.end(r, "aborted");
    } else {
      this.kick(); // leaves its slot at the next step
    }
  }

  private kick(): void {
    if (this.running || this.closed) return;
    this.running = true;
    setImmediate(() => void this.loop());
  }

  private async loop(): Promise<void> {
    try {
      while (!this.closed && (this.queue.length > 0 || this.slotList.some((s) => s.req))) {
        // sockets, timers and new requests are handled while a step computes off the thread; a step that
        // computed nothing yields a macrotask turn instead
        if (!(await this.step())) await new Promise((r) => setImmediate(r));
      }
    } finally {
      this.running = false;
    }
  }

  /**
   * One decode step: admit, drop aborted, build the batch, compute (off the JS thread), sample.
   * @returns whether a graph was computed (the event loop ran meanwhile)
   */
  private async step(): Promise<boolean> {
    const now = performance.now();
    for (const s of this.slotList) {
      if (s.req?.aborted) this.release(s, "aborted");
    }
    for (let qi = 0; qi < this.queue.length; ) {
      const free = this.slotList.filter((s) => !s.req);
      if (free.length === 0) break;
      const r = this.queue[qi]!;
      // a request for one slot waits for it; the requests behind it may take the other free slots
      const want = r.options.slot;
      const candidates = want !== undefined && want >= 0 ? free.filter((s) => s.id === want) : free;
      if (candidates.length === 0) {
        qi++;
        continue;
      }
      this.queue.splice(qi, 1);
      // the free slot whose cache shares the longest prefix with the prompt (prompt caching)
      let best = candidates[0]!;
      let bestLen = -1;
      for (const s of candidates) {
        const n = r.options.cachePrompt === false ? 0 : commonPrefix(s.tokens, r.promptIds);
        if (n > bestLen) {
          best = s;
          bestLen = n;
        }
      }
      // at least the last prompt token is evaluated again: its logits are needed
      const reuse = Math.min(bestLen, r.promptIds.length - 1);
      best.req = r;
      best.last = r;
      best.tokens.length = reuse;
      best.session.nPast = reuse;
      r.slot = best.id;
      r.promptPos = reuse;
      r.cachedTokens = reuse;
      r.timings.promptTokens = r.promptIds.length - reuse;
      r.startedAt = now;
      r.timings.queueMs = now - r.submittedAt;
      this.progress(r, now);
    }
    const entries: BatchEntry[] = [];
    const members: Slot[] = [];
    let budget = this.nBatch;
    let generating = 0;
    for (const s of this.slotList) {
      const r = s.req;
      if (!r || r.pending < 0) continue;
      entries.push({ session: s.session, tokens: [r.pending], logits: "last" });
      s.tokens.push(r.pending);
      members.push(s);
      budget--;
      generating++;
    }
    // prompts in the room left, oldest request first
    const prompting = this.slotList
      .filter((s) => s.req && s.req.pending < 0 && s.req.promptPos < s.req.promptIds.length)
      .sort((a, b) => a.req!.id - b.req!.id);
    for (const s of prompting) {
      if (budget <= 0) break;
      const r = s.req!;
      const n = Math.min(budget, r.promptIds.length - r.promptPos);
      const last = r.promptPos + n === r.promptIds.length;
      const chunk = r.promptIds.slice(r.promptPos, r.promptPos + n);
      entries.push({ session: s.session, tokens: chunk, logits: last ? "last" : "none" });
      s.tokens.push(...chunk);
      members.push(s);
      r.promptPos += n;
      budget -= n;
    }
    if (entries.length === 0) return false;
    const running = members.map((s) => s.req);
    let result: Awaited<ReturnType<Model["decodeBatchAsync"]>>;
    try {
      result = await this.model.decodeBatchAsync(entries);
    } catch (e) {
      for (const s of members) {
        if (this.closed) break;
        // nothing was appended: forget the slot's cache rather than trust it
        s.tokens.length = 0;
        s.session.reset();
        this.release(s, "aborted", e);
      }
      return false;
    }
    const m = this.metrics;
    m.decodeSteps++;
    m.sequencesInSteps += entries.length;
    m.maxSequencesPerStep = Math.max(m.maxSequencesPerStep, entries.length);
    m.stepsBySequences[entries.length] = (m.stepsBySequences[entries.length] ?? 0) + 1;
    for (let i = 0; i < m.stepsBySequences.length; i++) m.stepsBySequences[i] ??= 0;
    if (generating >= 2) m.sharedDecodeSteps++;
    m.tokensEvaluated += result.tokens;
    m.computeMs += result.computeMs;
    const after = performance.now();
    members.forEach((s, i) => {
      m.nTokensMax = Math.max(m.nTokensMax, s.session.nPast);
      // a request released while the step computed (the scheduler closing) has left its slot
      if (this.closed || s.req !== running[i]) return;
      const r = s.req!;
      if (r.pending < 0) this.progress(r, after);
      const logits = result.logits[i];
      if (logits) this.onLogits(s, logits, after);
    });
    return true;
  }

  /** Reports how far the request's prompt has been evaluated (to its `onPromptProgress`). */
  private progress(r: BatchRequest, now: number): void {
    const cb = r.options.onPromptProgress;
    if (!cb) return;
    try {
      cb({
        total: r.promptIds.length,
        cache: r.cachedTokens,
        processed: r.promptPos,
        timeMs: now - r.startedAt,
        slot: r.slot,
      });
    } catch {
      // a listener's error is its own
    }
  }

  /** Samples the slot's next token; finishes the request when a stop condition holds. */
  private onLogits(s: Slot, logits: Float32Array, now: number): void {
    const r = s.req!;
    if (r.generateStartedAt === 0) {
      r.generateStartedAt = now;
      r.timings.promptMs = now - r.startedAt;
    }
    const reason = this.sample(s, r, logits);
    if (reason) this.release(s, reason);
  }

  /** Samples and emits one token; returns why the request ends, if it does. */
  private sample(s: Slot, r: BatchRequest, logits: Float32Array): StopReason | undefined {
    if (r.aborted) return "aborted";
    if (r.gen.exhausted) return "length";
    const t = r.gen.next(logits);
    const nProbs = r.options.nProbs ?? 0;
    const probs = nProbs > 0 ? tokenLogprobs(logits, t.id, nProbs) : undefined;
    const out: BatchToken = probs
      ? { id: t.id, text: t.text, logprob: probs.logprob, top: probs.top }
      : { id: t.id, text: t.text };
    if (probs && r.options.postSamplingProbs) {
      const cands = r.gen.sampler.lastCandidates ?? [];
      out.post = {
        prob: cands.find((c) => c.id === t.id)?.p ?? 0,
        top: cands.slice(0, nProbs).filter((c) => c.p > 0),
      };
    }
    if (t.stop === "eos") return "eos";
    if (t.stop === "stop") {
      if (t.text) r.push(out);
      r.stoppingWord = t.stopWord;
      return "stop";
    }
    r.push(out);
    // llama.cpp (no context shift): stop once the next token would leave no room, and say the output was
    // truncated; `nPast` holds the prompt and every generated token but this one
    if (s.session.nPast + 1 >= s.session.nCtx) return "context";
    // done now rather than after evaluating a token whose logits nobody reads
    if (r.gen.exhausted) return "length";
    r.pending = t.id;
    return undefined;
  }

  /** Ends the slot's request and frees the slot (its cache stays for a later prompt with the same prefix). */
  private release(s: Slot, reason: StopReason, error?: unknown): void {
    const r = s.req;
    s.req = undefined;
    if (r) {
      r.nPast = s.session.nPast;
      this.end(r, reason, error);
    }
  }

  private end(r: BatchRequest, reason: StopReason, error?: unknown): void {
    if (r.isDone) return;
    r.finish(reason, error);
    const m = this.metrics;
    if (error !== undefined) m.requestsFailed++;
    else if (reason === "aborted") m.requestsAborted++;
    else m.requestsFinished++;
    if (r.startedAt > 0) {
      m.promptTokens += r.promptPos - r.cachedTokens;
      m.promptTokensCached += r.cachedTokens;
      m.promptMs += r.timings.promptMs;
      m.generatedTokens += r.timings.generatedTokens;
      m.generateMs += r.timings.generateMs;
    }
  }
}
