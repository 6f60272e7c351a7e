/**
 * Byte-level BPE (`tokenizer.ggml.model = gpt2`), the algorithm of llama.cpp's `llm_tokenizer_bpe_session`:
 * the pre-tokenizer splits the text into words, each word's UTF-8 bytes are mapped to the GPT-2 unicode
 * alphabet, and within a word the adjacent pair with the lowest merge rank is merged first (ties: the
 * leftmost pair) until no listed merge applies.
 */

import { Heap } from "./heap.js";
import type { PreTokenizer } from "./pretokenizer.js";
import { BYTE_TO_UNICODE } from "./unicode.js";

/** What the BPE session needs from the vocabulary. */
export interface BpeVocab {
  textToToken(text: string): number | undefined;
  /** Rank of the merge `left right`, or undefined when it is not listed. */
  mergeRank(left: string, right: string): number | undefined;
  /** Words that are whole tokens skip the merges. */
  readonly ignoreMerges: boolean;
}

interface Bigram {
  left: number;
  right: number;
  text: string;
  rank: number;
}

const bpeBefore = (a: Bigram, b: Bigram) => a.rank < b.rank || (a.rank === b.rank && a.left < b.left);

/** GPT-2 byte encoding of code points `cps[from, to)`: UTF-8 bytes, each mapped to its unicode stand-in. */
export function byteEncode(cps: readonly number[], from: number, to: number): string {
  let s = "";
  for (let i = from; i < to; i++) {
    const cp = cps[i];
    if (cp < 0x80) s += BYTE_TO_UNICODE[cp];
    else if (cp < 0x800) s += BYTE_TO_UNICODE[0xc0 | (cp >> 6)] + BYTE_TO_UNICODE[0x80 | (cp & 0x3f)];
    else if (cp < 0x10000)
      s +=
        BYTE_TO_UNICODE[0xe0 | (cp >> 12)] +
        BYTE_TO_UNICODE[0x80 | ((cp >> 6) & 0x3f)] +
        BYTE_TO_UNICODE[0x80 | (cp & 0x3f)];
    else
      s +=
        BYTE_TO_UNICODE[0xf0 | (cp >> 18)] +
        BYTE_TO_UNICODE[0x80 | ((cp >> 12) & 0x3f)] +
        BYTE_TO_UNICODE[0x80 | ((cp >> 6) & 0x3f)] +
        BYTE_TO_UNICODE[0x80 | (cp & 0x3f)];
  }
  return s;
}

/** Merges one byte-encoded word (every character is one UTF-16 unit) and appends its ids to `out`. */
function bpeWord(vocab: BpeVocab, word: string, out: number[]): void {
  if (vocab.ignoreMerges) {
    const id = vocab.textToToken(word);
    if (id !== undefined) {
      out.push(id);
      return;
    }
  }
  const n = word.length;
  const start = new Int32Array(n);
  const len = new Int32Array(n);
  const prev = new Int32Array(n);
  const next = new Int32Array(n);
  for (let i = 0; i < n; i++) {
    start[i] = i;
    len[i] = 1;
    prev[i] = i - 1;
    next[i] = i + 1 === n ? -1 : i + 1;
  }
  const queue = new Heap<Bigram>(bpeBefore);
  const addBigram = (left: number, right: number) => {
    if (left === -1 || right === -1) return;
    const l = word.substr(start[left], len[left]);
    const r = word.substr(start[right], len[right]);
    const rank = vocab.mergeRank(l, r);
    if (rank === undefined) return;
    queue.push({ left, right, text: l + r, rank });
  };
  for (let i = 1; i < n; i++) addBigram(i - 1, i);

  for (let b = queue.pop(); b !== undefined; b = queue.pop()) {
    const { left, right } = b;
    if (len[left] === 0 || len[right] === 0) continue;
    if (word.substr(start[left], len[left] + len[right]) !== b.text || start[right] !== start[left] + len[left]) {
      continue; // outdated
    }
    len[left] += len[right];
    len[right] = 0;
    next[left] = next[right];
    if (next[right] >= 0) prev[next[right]] = left;
    addBigram(prev[left], left);
    addBigram(left, next[left]);
  }

  for (let i = 0; i < n; i++) {
    if (len[i] === 0) continue;
    const s = word.substr(start[i], len[i]);
    const id = vocab.textToToken(s);
    if (id !== undefined) {
      out.push(id);
      continue;
    }
    // llama.cpp looks each byte of the UTF-8 text up as a one-byte string: only ASCII can match
    for (const ch of s) {
      const c = ch.codePointAt(0)!;
      if (c < 0x80) {
        const t = vocab.textToToken(ch);
        if (t !== undefined) out.push(t);
      }
    }
  }
}

/** Tokenizes `text` with the given pre-tokenizer and appends the ids to `out`. */
export function bpeTokenize(vocab: BpeVocab, pre: PreTokenizer, cps: readonly number[], out: number[]): void {
  const lengths = pre.splitLengths(cps);
  let at = 0;
  for (const n of lengths) {
    if (n > 0) bpeWord(vocab, byteEncode(cps, at, at + n), out);
    at += n;
  }
}
