/**
 * Tokenization that keeps the event loop free: short texts are tokenized at once, long ones on a worker
 * thread holding its own copy of the tokenizer (the same code and vocabulary, so the same ids). A prompt
 * that cannot fit a slot is refused before any of it is tokenized, from a lower bound on its token count.
 */
import { existsSync } from "node:fs";
import { Worker } from "node:worker_threads";
import type { Tokenizer } from "@powerinfer/tokenizer";

/** Texts up to this many UTF-16 units are tokenized on the event loop (well under a millisecond per 100). */
export const SYNC_TOKENIZE_CHARS = 2048;

interface Pending {
  resolve(ids: number[]): void;
  reject(e: Error): void;
}

/** The compiled worker: next to this module (dist), or in dist when this module runs from its source. */
function workerUrl(): URL | undefined {
  for (const rel of ["./tokenize-worker.js", "../dist/tokenize-worker.js"]) {
    try {
      const u = new URL(rel, import.meta.url);
      if (u.protocol === "file:" && existsSync(u)) return u;
    } catch {
      // not a file URL (a bundle): tokenize on the event loop
    }
  }
  return undefined;
}

export class TokenizerService {
  /**
   * The most input bytes one token can stand for: the longest vocabulary text in UTF-8 bytes. A token's text
   * is never shorter than the input it covers (SPM writes a space as the 3-byte "▁", byte-level BPE a byte as
   * a 1- or 2-byte character, a byte-fallback token is "<0xAB>"), so a text of B bytes has at least
   * ⌈B / maxTokenBytes⌉ tokens.
   */
  readonly maxTokenBytes: number;
  private worker?: Worker;
  private workerFailed = false;
  private nextId = 0;
  private readonly pending = new Map<number, Pending>();

  constructor(readonly tokenizer: Tokenizer) {
    let max = 1;
    for (let i = 0; i < tokenizer.nVocab; i++) max = Math.max(max, Buffer.byteLength(tokenizer.tokenText(i), "utf8"));
    this.maxTokenBytes = max;
  }

  /** A lower bound on the tokens of `text` (BOS and other added tokens not counted). */
  minTokens(text: string): number {
    if (text.length === 0) return 0;
    return Math.ceil(Buffer.byteLength(text, "utf8") / this.maxTokenBytes);
  }

  /** Tokenizes like `Tokenizer.tokenize`, off the event loop when the text is long. */
  async tokenize(text: string, opts: { addSpecial: boolean; parseSpecial: boolean }): Promise<number[]> {
    if (text.length > SYNC_TOKENIZE_CHARS) {
      const w = this.getWorker();
      if (w) {
        const id = this.nextId++;
        return new Promise<number[]>((resolve, reject) => {
          this.pending.set(id, { resolve, reject });
          w.postMessage({ id, text, addSpecial: opts.addSpecial, parseSpecial: opts.parseSpecial });
        });
      }
    }
    const ids = this.tokenizer.tokenize(text, opts);
    // many short texts in one request (an array of prompts) still let the loop turn between them
    if (text.length > 256) await new Promise((r) => setImmediate(r));
    return ids;
  }

  /** Stops the worker (pending tokenizations are rejected). */
  close(): void {
    const w = this.worker;
    this.worker = undefined;
    this.failAll(new Error("the server is closing"));
    void w?.terminate();
  }

  private getWorker(): Worker | undefined {
    if (this.worker || this.workerFailed) return this.worker;
    const url = workerUrl();
    if (!url) {
      this.workerFailed = true;
      return undefined;
    }
    try {
      const w = new Worker(url, { workerData: { vocab: this.tokenizer.vocab } });
      w.unref(); // a tokenizer thread never keeps the process alive
      w.on("message", (m: { id: number; ids?: Int32Array; error?: string }) => {
        const p = this.pending.get(m.id);
        if (!p) return;
        this.pending.delete(m.id);
        if (m.ids) p.resolve(Array.from(m.ids));
        else p.reject(new Error(m.error ?? "tokenization failed"));
      });
      w.on("error", (e) => {
        // the thread is gone: what it had is refused, later texts are tokenized here
        this.workerFailed = true;
        this.worker = undefined;
        this.failAll(e instanceof Error ? e : new Error(String(e)));
      });
      this.worker = w;
      return w;
    } catch {
      this.workerFailed = true;
      return undefined;
    }
  }

  private failAll(e: Error): void {
    for (const p of this.pending.values()) p.reject(e);
    this.pending.clear();
  }
}
