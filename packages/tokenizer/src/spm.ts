/**
 * SentencePiece-style tokenizer (`tokenizer.ggml.model = llama`), the algorithm of llama.cpp's
 * `llm_tokenizer_spm_session`: start from single characters, repeatedly merge the adjacent pair whose
 * concatenation is a vocabulary token with the highest score (ties: the leftmost pair), then emit each
 * symbol as its token, re-splitting symbols that are not tokens along the recorded merges, and
 * falling back to byte tokens `<0xXX>` for what is left.
 */

import { Heap } from "./heap.js";

/** What the SPM session needs from the vocabulary. */
export interface SpmVocab {
  textToToken(text: string): number | undefined;
  score(id: number): number;
  /** Token for one byte (llama.cpp `byte_to_token`). */
  byteToken(byte: number): number;
}

interface Bigram {
  left: number;
  right: number;
  score: number;
  /** Length of the merged text (UTF-16 units; any additive unit works for the staleness check). */
  size: number;
}

const spmBefore = (a: Bigram, b: Bigram) => a.score > b.score || (a.score === b.score && a.left < b.left);

/**
 * Tokenizes `text` (spaces already escaped to U+2581 by the caller) and appends the ids to `out`.
 */
export function spmTokenize(vocab: SpmVocab, text: string, out: number[]): void {
  // symbols: one per code point
  const start: number[] = [];
  const len: number[] = [];
  const prev: number[] = [];
  const next: number[] = [];
  for (let i = 0; i < text.length; ) {
    const cp = text.codePointAt(i)!;
    const n = cp > 0xffff ? 2 : 1;
    const idx = start.length;
    start.push(i);
    len.push(n);
    prev.push(idx - 1);
    i += n;
    next.push(i === text.length ? -1 : idx + 1);
  }
  if (start.length === 0) return;

  const queue = new Heap<Bigram>(spmBefore);
  const revMerge = new Map<string, [number, number]>();

  const tryAddBigram = (left: number, right: number) => {
    if (left === -1 || right === -1) return;
    const s = text.substr(start[left], len[left] + len[right]);
    const id = vocab.textToToken(s);
    if (id === undefined) return;
    queue.push({ left, right, score: vocab.score(id), size: s.length });
    revMerge.set(s, [left, right]);
  };

  for (let i = 1; i < start.length; i++) tryAddBigram(i - 1, i);

  for (let bigram = queue.pop(); bigram !== undefined; bigram = queue.pop()) {
    const { left, right } = bigram;
    if (len[left] === 0 || len[right] === 0 || len[left] + len[right] !== bigram.size) continue;
    // merge the right symbol into the left one
    len[left] += len[right];
    len[right] = 0;
    next[left] = next[right];
    if (next[right] >= 0) prev[next[right]] = left;
    tryAddBigram(prev[left], left);
    tryAddBigram(left, next[left]);
  }

  const encoder = new TextEncoder();
  const resegment = (sym: number) => {
    const s = text.substr(start[sym], len[sym]);
    const id = vocab.textToToken(s);
    if (id !== undefined) {
      out.push(id);
      return;
    }
    const p = revMerge.get(s);
    if (p === undefined) {
      for (const b of encoder.encode(s)) out.push(vocab.byteToken(b));
      return;
    }
    resegment(p[0]);
    resegment(p[1]);
  };
  for (let i = 0; i !== -1; i = next[i]) resegment(i);
}
