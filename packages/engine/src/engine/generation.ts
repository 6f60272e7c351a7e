/**
 * What one generated sequence is: its options, the tokens and text it yields, and {@link Generation}, the
 * per-sequence sampling state that sessions, the batch scheduler and the server all drive.
 */
import { type Tokenizer, TokenDecoder } from "@powerinfer/tokenizer";
import { GrammarConstraint } from "../grammar/constraint.js";
import type { Grammar } from "../grammar/matcher.js";
import { Sampler, type SamplerOptions } from "./sampler.js";

/** Options of {@link Session.generate}. */
export interface GenerateOptions extends SamplerOptions {
  /** Tokens to generate; −1 = until EOS or the context is full. Default −1. */
  maxTokens?: number;
  /** Generation stops when the text ends with one of these; the stop string is not emitted. */
  stop?: string[];
  /** Keep generating after an end-of-generation token. Default false. */
  ignoreEos?: boolean;
  /**
   * Constrain the output to sentences of this grammar (GBNF; see {@link Grammar}): at each step only the
   * tokens whose text the grammar can consume are candidates, end-of-generation only once the text is a
   * sentence. Generation stops ("eos") when no token can follow.
   */
  grammar?: Grammar;
  /** Add BOS etc. when tokenizing a text prompt. Default true. */
  addSpecial?: boolean;
  /** Parse special-token text (e.g. "<s>") in the prompt. Default false. */
  parseSpecial?: boolean;
  signal?: AbortSignal;
}

export interface GeneratedToken {
  id: number;
  /** Text completed by this token (may be "" while a UTF-8 character is incomplete). */
  text: string;
}

export type StopReason = "eos" | "length" | "stop" | "context" | "aborted";

/** Timings in the units llama.cpp prints. */
export interface Timings {
  promptTokens: number;
  promptMs: number;
  generatedTokens: number;
  generateMs: number;
  /**
   * Single-token evaluations after the prompt (llama.cpp's "runs"): one per generated token but the last,
   * which is sampled and never evaluated. Absent where the generator does not count them.
   */
  decodes?: number;
  stopReason?: StopReason;
}

/** What {@link Generation.next} returns: the sampled token, the text it releases, and whether it ends. */
export interface GenerationStep extends GeneratedToken {
  /** "eos": an end-of-generation token (not part of the text); "stop": a stop string was reached. */
  stop?: "eos" | "stop";
  /** With stop "stop": the stop string found. */
  stopWord?: string;
}

/**
 * The per-sequence state of text generation: the sampler (fed the prompt for its penalties), the token
 * budget, stop strings, and the text decoded so far. {@link Session.generate} and the batch scheduler both
 * drive one per sequence, so a sequence yields the same tokens and text alone as in a batch.
 */
export class Generation {
  readonly sampler: Sampler;
  /** Tokens sampled so far (including an end-of-generation token). */
  generated = 0;
  private readonly max: number;
  private readonly stops: string[];
  private readonly decoder: TokenDecoder;
  private text = "";
  private emitted = 0;
  /** The grammar state of this sequence, with `options.grammar`. */
  readonly constraint?: GrammarConstraint;

  constructor(
    readonly tokenizer: Tokenizer,
    promptIds: readonly number[],
    readonly options: GenerateOptions = {},
  ) {
    this.sampler = new Sampler(options);
    for (const t of promptIds) this.sampler.accept(t);
    this.max = options.maxTokens ?? -1;
    this.stops = (options.stop ?? []).filter((s) => s.length > 0);
    this.decoder = new TokenDecoder(tokenizer);
    if (options.grammar) this.constraint = new GrammarConstraint(options.grammar, tokenizer);
  }

  /** True when `maxTokens` tokens have been sampled: the next call to {@link next} must not happen. */
  get exhausted(): boolean {
    return this.max >= 0 && this.generated >= this.max;
  }

  /**
   * Samples the next token from `logits` and returns it with the text it completes. A tail of the text that
   * is the start of a stop string, or an incomplete UTF-8 character, is held back until it is decided; the
   * rest is returned at once.
   */
  next(logits: Float32Array): GenerationStep {
    const id = this.sampler.sample(logits, this.constraint);
    if (id < 0) {
      // the grammar allows no token (not even end-of-generation): the sequence cannot go on
      return { id: -1, text: "", stop: "eos" };
    }
    this.constraint?.accept(id);
    this.sampler.accept(id);
    this.generated++;
    // under a grammar an end-of-generation token is chosen only when the text is complete: it ends even
    // with ignoreEos (nothing else could follow)
    if ((!this.options.ignoreEos || this.constraint) && this.tokenizer.isEog(id)) return { id, text: "", stop: "eos" };
    this.text += this.decoder.push(id);
    const stops = this.stops;
    if (stops.length === 0) {
      const out = this.text.slice(this.emitted);
      this.emitted = this.text.length;
      return { id, text: out };
    }
    const emitted = this.emitted;
    const hits = stops.map((s) => this.text.indexOf(s, Math.max(0, emitted - s.length))).filter((i) => i >= 0);
    if (hits.length) {
      const hit = Math.min(...hits);
      const word = stops.find((s) => this.text.indexOf(s, Math.max(0, emitted - s.length)) === hit)!;
      this.emitted = this.text.length;
      return { id, text: hit > emitted ? this.text.slice(emitted, hit) : "", stop: "stop", stopWord: word };
    }
    // hold back only a tail that is the start of a stop string (as llama.cpp's partial stop match)
    let hold = 0;
    for (const s of stops) {
      for (let k = Math.min(s.length - 1, this.text.length - emitted); k > hold; k--) {
        if (this.text.endsWith(s.slice(0, k))) {
          hold = k;
          break;
        }
      }
    }
    const safe = Math.max(emitted, this.text.length - hold);
    this.emitted = safe;
    return { id, text: this.text.slice(emitted, safe) };
  }

  /** The text still held back (a possible stop-string start, an incomplete character); call once at the end. */
  flush(): string {
    const tail = this.text.slice(this.emitted) + this.decoder.flush();
    this.emitted = this.text.length;
    return tail;
  }
}
