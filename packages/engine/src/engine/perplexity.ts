/**
 * Perplexity over a token stream, in two protocols:
 * - "llama.cpp" (llama.cpp's `llama-perplexity`): chunks of n_ctx tokens, the first token of each
 *   chunk replaced by BOS when the vocabulary adds BOS, the second half of each chunk scored.
 * - "all-tokens" (`../shared/models/README-relu.md`): consecutive chunks of n_ctx − 1 tokens (trailing
 *   partial chunk dropped), each evaluated as [BOS] + chunk, every chunk token scored exactly once.
 * ppl = exp(mean negative log-likelihood), natural log.
 */
import type { Session } from "./engine.js";
import { EngineError } from "../errors.js";

export interface PerplexityResult {
  perplexity: number;
  /** Mean negative log-likelihood in nats per scored token. */
  meanNll: number;
  tokensScored: number;
  chunks: number;
}

function logSoftmaxAt(logits: Float32Array, offset: number, n: number, target: number): number {
  let max = Number.NEGATIVE_INFINITY;
  for (let i = 0; i < n; i++) max = Math.max(max, logits[offset + i]!);
  let sum = 0;
  for (let i = 0; i < n; i++) sum += Math.exp(logits[offset + i]! - max);
  return logits[offset + target]! - max - Math.log(sum);
}

/**
 * @param tokens the whole text tokenized once (with BOS for "llama.cpp" as llama.cpp does; without for "all-tokens")
 * @param onChunk progress callback (chunks done, chunks total, running perplexity)
 * @throws EngineError 'BAD_INPUT' when the text is shorter than one chunk.
 */
export function perplexity(
  session: Session,
  tokens: readonly number[],
  opts: {
    protocol: "llama.cpp" | "all-tokens";
    bosId: number | undefined;
    addBos: boolean;
    onChunk?: (done: number, total: number, ppl: number) => void;
  },
): PerplexityResult {
  const nCtx = session.nCtx;
  const nVocab = session.model.config.n_vocab;
  if (nCtx < 4) throw new EngineError("BAD_INPUT", `n_ctx ${nCtx} is too small for perplexity (at least 4)`);
  const chunkLen = opts.protocol === "all-tokens" ? nCtx - 1 : nCtx;
  const nChunks = Math.floor(tokens.length / chunkLen);
  if (nChunks < 1) {
    throw new EngineError(
      "BAD_INPUT",
      `text has ${tokens.length} token${tokens.length === 1 ? "" : "s"}, fewer than one chunk of ${chunkLen}`,
    );
  }
  const bos = opts.bosId;
  if (opts.protocol === "all-tokens" && bos === undefined) {
    throw new EngineError("BAD_INPUT", "the all-tokens protocol needs a BOS token, and this vocabulary has none");
  }
  let nll = 0;
  let scored = 0;
  for (let c = 0; c < nChunks; c++) {
    const chunk = tokens.slice(c * chunkLen, (c + 1) * chunkLen);
    let input: number[];
    let first: number;
    if (opts.protocol === "all-tokens") {
      input = [bos!, ...chunk];
      first = 0;
    } else {
      input = [...chunk];
      if (opts.addBos && bos !== undefined) input[0] = bos;
      first = Math.floor(nCtx / 2);
    }
    session.reset();
    const logits = session.evaluate(input, { allLogits: true });
    // logits of position j predict input[j + 1]
    for (let j = first; j < input.length - 1; j++) {
      nll -= logSoftmaxAt(logits, j * nVocab, nVocab, input[j + 1]!);
      scored++;
    }
    opts.onChunk?.(c + 1, nChunks, Math.exp(nll / scored));
  }
  return { perplexity: Math.exp(nll / scored), meanNll: nll / scored, tokensScored: scored, chunks: nChunks };
}
