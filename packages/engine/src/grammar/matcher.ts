/**
 * Incremental matching of a GBNF grammar, as llama.cpp's grammar sampler (llama-grammar.cpp) does it: the
 * parser state is the set of stacks of grammar positions still to match, every top a character class (or
 * the empty stack: the text so far is a sentence). A code point advances every stack whose top class
 * contains it; rule references on top are expanded into their alternatives. Text is consumed as UTF-8
 * bytes, so a token that ends inside a multi-byte character is allowed when some stack's top class has a
 * character starting with those bytes (llama.cpp's partial UTF-8 rule).
 *
 * Stacks are interned linked lists (shared tails, one id per distinct stack) and stack sets are interned
 * too, so a transition (set, code point) → set is computed once per grammar and then looked up: walking
 * the vocabulary's token trie over the cached transitions is a lazily built DFA.
 */
import { type CharRanges, classHas, classMeets, type GrammarRules, parseGbnf } from "./gbnf.js";

const END = 0;
const CHAR = 1;
const REF = 2;
/** A transition not computed yet (in {@link Grammar.asciiRow}). */
export const GRAMMAR_UNKNOWN = -2;
const UNKNOWN = GRAMMAR_UNKNOWN;
/** The dead state: no stack can go on. */
export const GRAMMAR_DEAD = -1;

interface StackSet {
  /** Stack ids, ascending; 0 is the empty stack. */
  stacks: Int32Array;
  /** Contains the empty stack: the text so far is a sentence. */
  complete: boolean;
  /** Transitions on ASCII code points (UNKNOWN until computed). */
  ascii: Int32Array;
  /** Transitions on other code points. */
  other: Map<number, number>;
}

/**
 * A compiled grammar with its transition caches; share it between the sequences that use the same grammar
 * (each sequence has its own {@link GrammarMatcher}). Not thread-safe (JavaScript is single-threaded).
 */
export class Grammar {
  /** Element kind per position (END, CHAR, REF). */
  private readonly kind: Uint8Array;
  /** Class index (CHAR) or rule id (REF) per position. */
  private readonly arg: Int32Array;
  private readonly classes: CharRanges[] = [];
  /** Per rule: the first position of each alternative. */
  private readonly ruleAlts: Int32Array[];
  // interned stacks: id → (pos, parent); id 0 = the empty stack
  private readonly stackPos: number[] = [-1];
  private readonly stackParent: number[] = [-1];
  private readonly stackIds = new Map<number, number>();
  private readonly expanded: (Int32Array | undefined)[] = [];
  private readonly sets: StackSet[] = [];
  private readonly setIds = new Map<string, number>();
  /** The state before any text. */
  readonly start: number;

  constructor(
    readonly rules: GrammarRules,
    /** The GBNF text the grammar came from, when it came from text. */
    readonly source?: string,
  ) {
    const kind: number[] = [];
    const arg: number[] = [];
    const classKey = new Map<string, number>();
    this.ruleAlts = rules.rules.map((alts) =>
      Int32Array.from(
        alts.map((seq) => {
          const startPos = kind.length;
          for (const e of seq) {
            if (e.kind === "char") {
              const key = e.ranges.join(",");
              let ci = classKey.get(key);
              if (ci === undefined) {
                ci = this.classes.length;
                this.classes.push(e.ranges);
                classKey.set(key, ci);
              }
              kind.push(CHAR);
              arg.push(ci);
            } else {
              kind.push(REF);
              arg.push(e.rule);
            }
          }
          kind.push(END);
          arg.push(0);
          return startPos;
        }),
      ),
    );
    this.kind = Uint8Array.from(kind);
    this.arg = Int32Array.from(arg);
    // the start: root's alternatives on an empty stack
    const out = new Set<number>();
    for (const a of this.ruleAlts[rules.root]!) {
      const s = this.kind[a] === END ? 0 : this.push(a, 0);
      for (const x of this.expand(s)) out.add(x);
    }
    this.start = this.internSet([...out]);
  }

  /** Parses GBNF text. @throws GrammarError (see {@link parseGbnf}). */
  static fromGbnf(src: string, root = "root"): Grammar {
    return new Grammar(parseGbnf(src, root), src);
  }

  /** Distinct stack sets built so far (a measure of the cache). */
  get cachedStates(): number {
    return this.sets.length;
  }

  private push(pos: number, parent: number): number {
    const key = parent * this.kind.length + pos;
    let id = this.stackIds.get(key);
    if (id === undefined) {
      id = this.stackPos.length;
      this.stackPos.push(pos);
      this.stackParent.push(parent);
      this.stackIds.set(key, id);
    }
    return id;
  }

  /** The stacks a stack stands for once rule references on top are expanded (tops: classes or empty). */
  private expand(s: number): Int32Array {
    const memo = this.expanded[s];
    if (memo) return memo;
    const out = new Set<number>();
    const pos = this.stackPos[s]!;
    if (s === 0 || this.kind[pos] === CHAR) out.add(s);
    else {
      // a reference on top: replace it by each alternative, its continuation below
      const parent = this.stackParent[s]!;
      const cont = this.kind[pos + 1] === END ? parent : this.push(pos + 1, parent);
      for (const a of this.ruleAlts[this.arg[pos]!]!) {
        const t = this.kind[a] === END ? cont : this.push(a, cont);
        for (const x of this.expand(t)) out.add(x);
      }
    }
    const r = Int32Array.from(out).sort();
    this.expanded[s] = r;
    return r;
  }

  private internSet(stacks: number[]): number {
    if (stacks.length === 0) return GRAMMAR_DEAD;
    stacks.sort((a, b) => a - b);
    const key = stacks.join(",");
    let id = this.setIds.get(key);
    if (id === undefined) {
      id = this.sets.length;
      this.sets.push({
        stacks: Int32Array.from(stacks),
        complete: stacks[0] === 0,
        ascii: new Int32Array(128).fill(UNKNOWN),
        other: new Map(),
      });
      this.setIds.set(key, id);
    }
    return id;
  }

  /** True when the text that led to `state` is a sentence of the grammar. */
  isComplete(state: number): boolean {
    return state >= 0 && this.sets[state]!.complete;
  }

  /**
   * The cached transitions of a (live) state on ASCII code points: next state, GRAMMAR_DEAD, or
   * GRAMMAR_UNKNOWN where {@link step} has not been asked yet.
   */
  asciiRow(state: number): Int32Array {
    return this.sets[state]!.ascii;
  }

  /** The state after code point `cp` (GRAMMAR_DEAD when no stack accepts it). */
  step(state: number, cp: number): number {
    if (state < 0) return GRAMMAR_DEAD;
    const set = this.sets[state]!;
    if (cp < 128) {
      const t = set.ascii[cp]!;
      if (t !== UNKNOWN) return t;
    } else {
      const t = set.other.get(cp);
      if (t !== undefined) return t;
    }
    const out = new Set<number>();
    for (const s of set.stacks) {
      if (s === 0) continue;
      const pos = this.stackPos[s]!;
      if (!classHas(this.classes[this.arg[pos]!]!, cp)) continue;
      const parent = this.stackParent[s]!;
      const next = this.kind[pos + 1] === END ? parent : this.push(pos + 1, parent);
      for (const x of this.expand(next)) out.add(x);
    }
    const t = this.internSet([...out]);
    if (cp < 128) set.ascii[cp] = t;
    else set.other.set(cp, t);
    return t;
  }

  /** Can some stack of `state` take a code point in [lo, hi]? (the partial UTF-8 check) */
  admits(state: number, lo: number, hi: number): boolean {
    if (state < 0) return false;
    for (const s of this.sets[state]!.stacks) {
      if (s !== 0 && classMeets(this.classes[this.arg[this.stackPos[s]!]!]!, lo, hi)) return true;
    }
    return false;
  }

  /**
   * Matches a whole text from the start.
   * @returns "sentence" (the text is in the language), "prefix" (it can be continued into a sentence) or
   *   "no".
   */
  match(text: string): "sentence" | "prefix" | "no" {
    let st = this.start;
    for (const ch of text) {
      st = this.step(st, ch.codePointAt(0)!);
      if (st < 0) return "no";
    }
    return this.isComplete(st) ? "sentence" : "prefix";
  }
}

/**
 * A position in the text as UTF-8 bytes: a grammar state plus the start of a multi-byte character
 * (`remain` continuation bytes still to come, the bits so far in `value`).
 */
export interface ByteState {
  state: number;
  value: number;
  remain: number;
  /** The smallest code point the started character may be (0x80, 0x800, 0x10000: no overlong forms). */
  min: number;
}

/**
 * Advances a byte state by one byte; returns false (and leaves `s` unusable) when the byte cannot follow:
 * no stack accepts the character, or the bytes are not UTF-8 (a stray continuation byte, an overlong form,
 * a surrogate, a byte C0, C1, F5–FF, past U+10FFFF).
 */
export function stepByte(g: Grammar, s: ByteState, b: number): boolean {
  if (s.remain === 0) {
    if (b < 0x80) {
      s.state = g.step(s.state, b);
      return s.state >= 0;
    }
    if (b >= 0xc2 && b <= 0xdf) {
      s.value = b & 0x1f;
      s.remain = 1;
      s.min = 0x80;
    } else if (b >= 0xe0 && b <= 0xef) {
      s.value = b & 0x0f;
      s.remain = 2;
      s.min = 0x800;
    } else if (b >= 0xf0 && b <= 0xf4) {
      s.value = b & 0x07;
      s.remain = 3;
      s.min = 0x10000;
    } else return false;
  } else {
    if ((b & 0xc0) !== 0x80) return false;
    s.value = (s.value << 6) | (b & 0x3f);
    s.remain--;
    if (s.remain === 0) {
      const cp = s.value;
      if (cp < s.min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
      s.state = g.step(s.state, cp);
      s.value = 0;
      return s.state >= 0;
    }
  }
  // a started character: can some stack take a character beginning with these bytes?
  const shift = 6 * s.remain;
  const lo = Math.max(s.value * 2 ** shift, s.min);
  const hi = Math.min(s.value * 2 ** shift + 2 ** shift - 1, 0x10ffff);
  return lo <= hi && g.admits(s.state, lo, hi);
}
