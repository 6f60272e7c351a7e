/**
 * Grammar-constrained decoding over a vocabulary: which tokens may come next in a sequence.
 *
 * As llama.cpp's grammar sampler: a token is allowed iff its text (the bytes generation outputs for it)
 * can be consumed from the current parser state; an end-of-generation token iff the text so far is a
 * sentence; a token whose text is empty never (it would not advance the grammar). The full mask walks a
 * trie of every token's bytes once, pruning a subtree at the first byte no stack accepts; a single token
 * can also be checked on its own, which is what the sampler does first for its best candidates.
 */
import type { Tokenizer } from "@powerinfer/tokenizer";
import { type ByteState, GRAMMAR_DEAD, GRAMMAR_UNKNOWN, type Grammar, stepByte } from "./matcher.js";

/** A byte trie of a vocabulary's token texts (end-of-generation and empty tokens left out). */
export class TokenTrie {
  /** Per node: first edge index and edge count. */
  readonly edgeStart: Int32Array;
  readonly edgeCount: Int32Array;
  readonly edgeByte: Uint8Array;
  readonly edgeChild: Int32Array;
  /** Per node: tokens whose text ends there, as a range of `tokens`. */
  readonly tokStart: Int32Array;
  readonly tokCount: Int32Array;
  readonly tokens: Int32Array;
  /** Each token's bytes (as the output decoder renders them). */
  readonly pieces: Uint8Array[];
  /** End-of-generation tokens. */
  readonly eog: Uint8Array;
  readonly nVocab: number;

  private static cache = new WeakMap<Tokenizer, TokenTrie>();

  /** The trie of a tokenizer's vocabulary (built once per tokenizer, ~50 ms for 32k tokens). */
  static of(tokenizer: Tokenizer): TokenTrie {
    let t = TokenTrie.cache.get(tokenizer);
    if (!t) {
      t = new TokenTrie(tokenizer);
      TokenTrie.cache.set(tokenizer, t);
    }
    return t;
  }

  private constructor(tokenizer: Tokenizer) {
    const n = tokenizer.nVocab;
    this.nVocab = n;
    this.pieces = new Array(n);
    this.eog = new Uint8Array(n);
    // build with maps, then flatten
    const children: Map<number, number>[] = [new Map()];
    const ends: number[][] = [[]];
    for (let id = 0; id < n; id++) {
      const p = tokenizer.tokenToPiece(id, { special: false });
      this.pieces[id] = p;
      if (tokenizer.isEog(id)) {
        this.eog[id] = 1;
        continue;
      }
      if (p.length === 0 || p[0] === 0) continue;
      let node = 0;
      for (const b of p) {
        let c = children[node]!.get(b);
        if (c === undefined) {
          c = children.length;
          children.push(new Map());
          ends.push([]);
          children[node]!.set(b, c);
        }
        node = c;
      }
      ends[node]!.push(id);
    }
    // number the nodes in depth-first preorder (children by byte), so that the mask's walk reads the
    // arrays front to back
    const nn = children.length;
    const order: number[] = [];
    const todo = [0];
    while (todo.length > 0) {
      const node = todo.pop()!;
      order.push(node);
      const kids = [...children[node]!.entries()].sort((a, b) => b[0] - a[0]);
      for (const [, c] of kids) todo.push(c);
    }
    const newId = new Int32Array(nn);
    order.forEach((old, i) => {
      newId[old] = i;
    });
    this.edgeStart = new Int32Array(nn);
    this.edgeCount = new Int32Array(nn);
    this.tokStart = new Int32Array(nn);
    this.tokCount = new Int32Array(nn);
    const nEdges = nn - 1;
    this.edgeByte = new Uint8Array(nEdges);
    this.edgeChild = new Int32Array(nEdges);
    const toks: number[] = [];
    let e = 0;
    for (let i = 0; i < nn; i++) {
      const old = order[i]!;
      const m = [...children[old]!.entries()].sort((a, b) => a[0] - b[0]);
      this.edgeStart[i] = e;
      this.edgeCount[i] = m.length;
      for (const [b, c] of m) {
        this.edgeByte[e] = b;
        this.edgeChild[e] = newId[c]!;
        e++;
      }
      this.tokStart[i] = toks.length;
      this.tokCount[i] = ends[old]!.length;
      toks.push(...ends[old]!);
    }
    this.tokens = Int32Array.from(toks);
  }
}

/**
 * The grammar state of one sequence and the tokens it allows. Create one per generated sequence; call
 * {@link accept} with every token the sampler picks.
 */
export class GrammarConstraint {
  readonly trie: TokenTrie;
  private st: ByteState;
  private readonly tmp: ByteState = { state: 0, value: 0, remain: 0, min: 0 };
  /** Scratch for the trie walk. */
  private walkNode = new Int32Array(256);
  private walkState = new Int32Array(256);
  private walkValue = new Int32Array(256);
  private walkRemain = new Int32Array(256);
  private walkMin = new Int32Array(256);

  constructor(
    readonly grammar: Grammar,
    tokenizer: Tokenizer,
  ) {
    this.trie = TokenTrie.of(tokenizer);
    this.st = { state: grammar.start, value: 0, remain: 0, min: 0 };
  }

  /** The text so far is a sentence (an end-of-generation token is allowed). */
  get complete(): boolean {
    return this.st.remain === 0 && this.grammar.isComplete(this.st.state);
  }

  /** No token can follow (not even end-of-generation). */
  get dead(): boolean {
    return this.st.state === GRAMMAR_DEAD;
  }

  /** May token `id` come next? */
  allows(id: number): boolean {
    const t = this.trie;
    if (t.eog[id]) return this.complete;
    const p = t.pieces[id]!;
    if (p.length === 0 || p[0] === 0) return false;
    const s = this.tmp;
    s.state = this.st.state;
    s.value = this.st.value;
    s.remain = this.st.remain;
    s.min = this.st.min;
    for (let i = 0; i < p.length; i++) if (!stepByte(this.grammar, s, p[i]!)) return false;
    return true;
  }

  /**
   * Every allowed token: `out[id]` = 1 when allowed, else 0. One depth-first walk of the token trie from
   * the current state; a subtree is left at the first byte no stack accepts.
   * @returns the number of allowed tokens.
   */
  mask(out: Uint8Array): number {
    out.fill(0);
    const t = this.trie;
    let n = 0;
    if (this.complete) {
      for (let id = 0; id < t.nVocab; id++)
        if (t.eog[id]) {
          out[id] = 1;
          n++;
        }
    }
    if (this.st.state === GRAMMAR_DEAD) return n;
    const g = this.grammar;
    const { edgeStart, edgeCount, edgeByte, edgeChild, tokStart, tokCount, tokens } = t;
    let nodeS = this.walkNode;
    let stateS = this.walkState;
    let valueS = this.walkValue;
    let remainS = this.walkRemain;
    let minS = this.walkMin;
    const s = this.tmp;
    nodeS[0] = 0;
    stateS[0] = this.st.state;
    valueS[0] = this.st.value;
    remainS[0] = this.st.remain;
    minS[0] = this.st.min;
    let sp = 1;
    while (sp > 0) {
      sp--;
      const node = nodeS[sp]!;
      const state = stateS[sp]!;
      const value = valueS[sp]!;
      const remain = remainS[sp]!;
      const min = minS[sp]!;
      const tc = tokCount[node]!;
      if (tc > 0 && node !== 0) {
        const ts = tokStart[node]!;
        for (let k = 0; k < tc; k++) out[tokens[ts + k]!] = 1;
        n += tc;
      }
      const es = edgeStart[node]!;
      const ee = es + edgeCount[node]!;
      if (ee === es) continue;
      if (sp + (ee - es) > nodeS.length) {
        const size = Math.max(2 * nodeS.length, sp + (ee - es));
        const grow = (a: Int32Array) => {
          const b = new Int32Array(size);
          b.set(a);
          return b;
        };
        this.walkNode = nodeS = grow(nodeS);
        this.walkState = stateS = grow(stateS);
        this.walkValue = valueS = grow(valueS);
        this.walkRemain = remainS = grow(remainS);
        this.walkMin = minS = grow(minS);
      }
      const row = remain === 0 ? g.asciiRow(state) : undefined;
      // last edge first: the first child is popped next (preorder, the arrays' order)
      for (let e = ee - 1; e >= es; e--) {
        const b = edgeByte[e]!;
        if (row !== undefined && b < 0x80) {
          // the common case: an ASCII byte from a whole-character state, a cached transition
          let next = row[b]!;
          if (next === GRAMMAR_UNKNOWN) next = g.step(state, b);
          if (next >= 0) {
            nodeS[sp] = edgeChild[e]!;
            stateS[sp] = next;
            remainS[sp] = 0;
            sp++;
          }
          continue;
        }
        s.state = state;
        s.value = value;
        s.remain = remain;
        s.min = min;
        if (stepByte(g, s, b)) {
          nodeS[sp] = edgeChild[e]!;
          stateS[sp] = s.state;
          valueS[sp] = s.value;
          remainS[sp] = s.remain;
          minS[sp] = s.min;
          sp++;
        }
      }
    }
    return n;
  }

  /**
   * Advances past token `id` (an end-of-generation token leaves the state as it is).
   * @throws Error when the grammar does not allow the token.
   */
  accept(id: number): void {
    if (this.trie.eog[id]) return;
    if (!this.allows(id)) throw new Error(`grammar: token ${id} is not allowed here`);
    this.st = { ...this.tmp };
  }
}
