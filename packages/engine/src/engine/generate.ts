/**
 * Text generation over anything that evaluates tokens into logits (a single-backend Session, a hybrid
 * device + CPU session): tokenize, evaluate the prompt, then sample with a {@link Generation} until a
 * stop condition, yielding text as it is decided.
 */
import type { Tokenizer } from "@powerinfer/tokenizer";
import { type GeneratedToken, type GenerateOptions, Generation, type StopReason, type Timings } from "./generation.js";
import { EngineError } from "../errors.js";

/** What generation needs from a session. */
export interface TokenEvaluator {
  readonly nCtx: number;
  readonly nPast: number;
  /** Appends tokens and returns the logits after the last one. */
  evaluate(tokens: readonly number[]): Float32Array | Promise<Float32Array>;
}

/**
 * @param timings filled in as generation proceeds (prompt and generation times, stop reason)
 * @throws EngineError 'BAD_INPUT' (empty prompt) or 'PROMPT_TOO_LONG'.
 */
export async function* generateTokens(
  session: TokenEvaluator,
  tokenizer: Tokenizer,
  prompt: string | readonly number[],
  opts: GenerateOptions,
  timings: Timings,
): AsyncGenerator<GeneratedToken> {
  const ids =
    typeof prompt === "string"
      ? tokenizer.tokenize(prompt, { addSpecial: opts.addSpecial ?? true, parseSpecial: opts.parseSpecial ?? false })
      : [...prompt];
  if (ids.length === 0) throw new EngineError("BAD_INPUT", "empty prompt");
  if (session.nPast + ids.length > session.nCtx) {
    throw new EngineError(
      "PROMPT_TOO_LONG",
      `prompt has ${ids.length} tokens, context has room for ${session.nCtx - session.nPast} (n_ctx ${session.nCtx})`,
    );
  }
  const gen = new Generation(tokenizer, ids, opts);
  Object.assign(timings, { promptTokens: ids.length, promptMs: 0, generatedTokens: 0, generateMs: 0, decodes: 0 });
  let t0 = performance.now();
  let logits = await session.evaluate(ids);
  timings.promptMs = performance.now() - t0;
  let reason: StopReason;
  t0 = performance.now();
  for (;;) {
    if (opts.signal?.aborted) {
      reason = "aborted";
      break;
    }
    if (gen.exhausted) {
      reason = "length";
      break;
    }
    const t = gen.next(logits);
    timings.generatedTokens = gen.generated;
    if (t.stop === "eos") {
      reason = "eos";
      break;
    }
    if (t.stop === "stop") {
      if (t.text) yield { id: t.id, text: t.text };
      reason = "stop";
      break;
    }
    yield { id: t.id, text: t.text };
    // the last token allowed is not evaluated: nothing would read its logits (llama.cpp's main loop stops there too)
    if (gen.exhausted) {
      reason = "length";
      break;
    }
    if (session.nPast >= session.nCtx) {
      reason = "context";
      break;
    }
    logits = await session.evaluate([t.id]);
    timings.decodes!++;
    timings.generateMs = performance.now() - t0;
    // let the event loop breathe between tokens (abort signals, streaming consumers)
    await new Promise((r) => setImmediate(r));
  }
  timings.generateMs = performance.now() - t0;
  timings.stopReason = reason;
  const tail = gen.flush();
  if (tail) yield { id: -1, text: tail };
}
