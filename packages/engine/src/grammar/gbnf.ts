/**
 * GBNF, llama.cpp's grammar language (grammars/README.md of llama.cpp): parsed into rules of
 * alternatives of elements (a character class or a rule reference). Repetition operators are rewritten
 * into helper rules as llama.cpp does (`x*` → `r ::= x r |`, `x{m,n}` → m copies then nested optionals).
 *
 * Syntax: `name ::= alternatives` (one rule per line; newlines are allowed after `|` and inside
 * parentheses), `"literal"`, `[a-z0-9_]`, `[^"\\]`, `.` (any character), rule names `[a-zA-Z0-9_-]+`,
 * `( … )`, postfix `?` `*` `+` `{m}` `{m,}` `{m,n}` `{,n}`, comments `# …`. Escapes in literals and
 * classes: `\n \r \t \\ \" \[ \] \- \xHH \uHHHH \UHHHHHHHH`. The start rule is `root`.
 */

/** A grammar that could not be parsed or compiled; the message names the problem and where. */
export class GrammarError extends Error {
  constructor(message: string) {
    super(message);
    this.name = "GrammarError";
  }
}

/** A character class: sorted, merged inclusive code point ranges [lo0, hi0, lo1, hi1, …]. */
export type CharRanges = Int32Array;

/** One element of an alternative. */
export type GrammarElement = { kind: "char"; ranges: CharRanges } | { kind: "ref"; rule: number };

/** A parsed, compiled grammar: rules by index, each a list of alternatives (sequences of elements). */
export interface GrammarRules {
  names: string[];
  rules: GrammarElement[][][];
  root: number;
}

const MAX_CP = 0x10ffff;

/** Normalises ranges: sorts, merges, optionally negates over [0, 0x10FFFF]. */
function normalise(pairs: [number, number][], negate: boolean): CharRanges {
  pairs.sort((a, b) => a[0] - b[0]);
  const merged: [number, number][] = [];
  for (const [lo, hi] of pairs) {
    const last = merged[merged.length - 1];
    if (last && lo <= last[1] + 1) last[1] = Math.max(last[1], hi);
    else merged.push([lo, hi]);
  }
  let out = merged;
  if (negate) {
    out = [];
    let next = 0;
    for (const [lo, hi] of merged) {
      if (lo > next) out.push([next, lo - 1]);
      next = hi + 1;
    }
    if (next <= MAX_CP) out.push([next, MAX_CP]);
  }
  return Int32Array.from(out.flat());
}

/** Does the class contain code point c? */
export function classHas(r: CharRanges, c: number): boolean {
  for (let i = 0; i < r.length; i += 2) {
    if (c < r[i]!) return false;
    if (c <= r[i + 1]!) return true;
  }
  return false;
}

/** Does the class contain any code point in [lo, hi]? */
export function classMeets(r: CharRanges, lo: number, hi: number): boolean {
  for (let i = 0; i < r.length; i += 2) if (r[i]! <= hi && r[i + 1]! >= lo) return true;
  return false;
}

type Node =
  | { t: "char"; ranges: CharRanges }
  | { t: "ref"; name: string; at: number }
  | { t: "seq"; items: Node[] }
  | { t: "alt"; alts: Node[] }
  | { t: "rep"; item: Node; min: number; max: number };

const isWord = (c: string) => /[a-zA-Z0-9_-]/.test(c);

class Parser {
  private i = 0;
  readonly defs = new Map<string, Node>();
  readonly order: string[] = [];

  constructor(private readonly src: string) {}

  private where(at = this.i): string {
    const before = this.src.slice(0, at);
    const line = before.split("\n").length;
    const col = at - before.lastIndexOf("\n");
    const near = this.src.slice(at, at + 20).split("\n")[0];
    return `line ${line}, column ${col}${near ? ` (near "${near}")` : " (at the end)"}`;
  }

  private fail(what: string, at = this.i): never {
    throw new GrammarError(`grammar: ${what} at ${this.where(at)}`);
  }

  /** Skips spaces, tabs, comments and (when `newlines`) line breaks. */
  private space(newlines: boolean): void {
    const s = this.src;
    while (this.i < s.length) {
      const c = s[this.i]!;
      if (c === " " || c === "\t") this.i++;
      else if (c === "#") {
        while (this.i < s.length && s[this.i] !== "\n" && s[this.i] !== "\r") this.i++;
      } else if (newlines && (c === "\n" || c === "\r")) this.i++;
      else break;
    }
  }

  private name(): string {
    const start = this.i;
    while (this.i < this.src.length && isWord(this.src[this.i]!)) this.i++;
    if (this.i === start) this.fail("expected a rule name");
    return this.src.slice(start, this.i);
  }

  private int(): number {
    const start = this.i;
    while (this.i < this.src.length && /[0-9]/.test(this.src[this.i]!)) this.i++;
    if (this.i === start) this.fail("expected a number");
    return Number(this.src.slice(start, this.i));
  }

  /** One (possibly escaped) character of a literal or class; returns its code point. */
  private char(): number {
    const s = this.src;
    if (this.i >= s.length) this.fail("unexpected end of grammar");
    if (s[this.i] === "\\") {
      const e = s[this.i + 1];
      this.i += 2;
      const hex = (n: number) => {
        const h = s.slice(this.i, this.i + n);
        if (h.length !== n || !/^[0-9a-fA-F]+$/.test(h)) this.fail(`expected ${n} hex digits after \\${e}`);
        this.i += n;
        const v = Number.parseInt(h, 16);
        if (v > MAX_CP) this.fail(`code point ${h} is outside Unicode`);
        return v;
      };
      switch (e) {
        case "x":
          return hex(2);
        case "u":
          return hex(4);
        case "U":
          return hex(8);
        case "t":
          return 9;
        case "r":
          return 13;
        case "n":
          return 10;
        case "\\":
        case '"':
        case "[":
        case "]":
        case "-":
        case "^":
          return e.codePointAt(0)!;
        default:
          this.fail(`unknown escape \\${e ?? ""}`, this.i - 2);
      }
    }
    const cp = s.codePointAt(this.i)!;
    this.i += cp > 0xffff ? 2 : 1;
    return cp;
  }

  parse(): void {
    const s = this.src;
    this.space(true);
    while (this.i < s.length) {
      const at = this.i;
      const name = this.name();
      this.space(false);
      if (!s.startsWith("::=", this.i)) this.fail(`expected "::=" after rule name "${name}"`);
      this.i += 3;
      this.space(true);
      const body = this.alternatives(false);
      if (this.defs.has(name)) this.fail(`rule "${name}" is defined twice`, at);
      this.defs.set(name, body);
      this.order.push(name);
      // a rule ends at a line break (or the end)
      if (this.i < s.length && s[this.i] !== "\n" && s[this.i] !== "\r") this.fail("expected the end of the line");
      this.space(true);
    }
  }

  private alternatives(nested: boolean): Node {
    const alts: Node[] = [this.sequence(nested)];
    while (this.src[this.i] === "|") {
      this.i++;
      this.space(true);
      alts.push(this.sequence(nested));
    }
    return alts.length === 1 ? alts[0]! : { t: "alt", alts };
  }

  private sequence(nested: boolean): Node {
    const s = this.src;
    const items: Node[] = [];
    for (;;) {
      const c = s[this.i];
      if (c === undefined || c === "|" || c === ")" || c === "\n" || c === "\r") break;
      let item: Node;
      if (c === '"') {
        this.i++;
        const chars: Node[] = [];
        while (s[this.i] !== '"') {
          if (this.i >= s.length || s[this.i] === "\n") this.fail("unterminated string literal");
          const cp = this.char();
          chars.push({ t: "char", ranges: Int32Array.of(cp, cp) });
        }
        this.i++;
        item = { t: "seq", items: chars };
      } else if (c === "[") {
        const start = this.i;
        this.i++;
        const negate = s[this.i] === "^";
        if (negate) this.i++;
        const pairs: [number, number][] = [];
        while (s[this.i] !== "]") {
          if (this.i >= s.length || s[this.i] === "\n") this.fail("unterminated character class", start);
          const lo = this.char();
          let hi = lo;
          if (s[this.i] === "-" && s[this.i + 1] !== "]" && this.i + 1 < s.length) {
            this.i++;
            hi = this.char();
            if (hi < lo) this.fail(`empty range in character class (${lo} > ${hi})`);
          }
          pairs.push([lo, hi]);
        }
        this.i++;
        item = { t: "char", ranges: normalise(pairs, negate) };
      } else if (c === ".") {
        this.i++;
        item = { t: "char", ranges: Int32Array.of(0, MAX_CP) };
      } else if (c === "(") {
        this.i++;
        this.space(true);
        item = this.alternatives(true);
        if (s[this.i] !== ")") this.fail('expected ")"');
        this.i++;
      } else if (isWord(c)) {
        const at = this.i;
        item = { t: "ref", name: this.name(), at };
      } else if (c === "<") {
        this.fail("token references (<...>) are not supported");
      } else {
        this.fail(`unexpected "${c}"`);
      }
      this.space(nested);
      // postfix operators
      for (;;) {
        const op = s[this.i];
        if (op === "*" || op === "+" || op === "?") {
          this.i++;
          item = { t: "rep", item, min: op === "+" ? 1 : 0, max: op === "?" ? 1 : -1 };
        } else if (op === "{") {
          this.i++;
          this.space(false);
          let min = 0;
          let max: number;
          if (s[this.i] === ",") {
            this.i++;
            this.space(false);
            max = this.int();
          } else {
            min = this.int();
            this.space(false);
            if (s[this.i] === ",") {
              this.i++;
              this.space(false);
              max = s[this.i] === "}" ? -1 : this.int();
            } else max = min;
          }
          this.space(false);
          if (s[this.i] !== "}") this.fail('expected "}" closing a repetition');
          this.i++;
          if (max >= 0 && max < min) this.fail(`repetition {${min},${max}}: the maximum is below the minimum`);
          if (min > 10000 || max > 10000) this.fail("repetition counts above 10000 are not supported");
          item = { t: "rep", item, min, max };
        } else break;
        this.space(nested);
      }
      items.push(item);
    }
    return items.length === 1 ? items[0]! : { t: "seq", items };
  }
}

/** Builds the flat rule table from the parse tree. */
class Compiler {
  readonly names: string[] = [];
  readonly rules: GrammarElement[][][] = [];
  private readonly ids = new Map<string, number>();

  constructor(private readonly p: Parser) {
    for (const n of p.order) this.id(n);
    p.order.forEach((n) => {
      this.rules[this.ids.get(n)!] = this.alts(p.defs.get(n)!, n);
    });
  }

  private id(name: string): number {
    let id = this.ids.get(name);
    if (id === undefined) {
      id = this.names.length;
      this.ids.set(name, id);
      this.names.push(name);
      this.rules.push([]);
    }
    return id;
  }

  private fresh(base: string, alts: GrammarElement[][]): number {
    let k = this.names.length;
    while (this.ids.has(`${base}_${k}`)) k++;
    const id = this.id(`${base}_${k}`);
    this.rules[id] = alts;
    return id;
  }

  private alts(n: Node, base: string): GrammarElement[][] {
    if (n.t === "alt") return n.alts.map((a) => this.seq(a, base));
    return [this.seq(n, base)];
  }

  private seq(n: Node, base: string): GrammarElement[] {
    const out: GrammarElement[] = [];
    this.emit(n, base, out);
    return out;
  }

  private emit(n: Node, base: string, out: GrammarElement[]): void {
    switch (n.t) {
      case "char":
        out.push({ kind: "char", ranges: n.ranges });
        return;
      case "ref": {
        if (!this.p.defs.has(n.name)) {
          throw new GrammarError(`grammar: undefined rule "${n.name}"`);
        }
        out.push({ kind: "ref", rule: this.ids.get(n.name)! });
        return;
      }
      case "seq":
        for (const i of n.items) this.emit(i, base, out);
        return;
      case "alt":
        out.push({ kind: "ref", rule: this.fresh(base, this.alts(n, base)) });
        return;
      case "rep": {
        const item = this.seq(n.item, base);
        for (let k = 0; k < n.min; k++) out.push(...item);
        if (n.max < 0) {
          // r ::= item r |
          const id = this.fresh(base, []);
          this.rules[id] = [[...item, { kind: "ref", rule: id }], []];
          out.push({ kind: "ref", rule: id });
        } else if (n.max > n.min) {
          // (item (item (item)?)?)? for max − min optional items
          let inner: number | undefined;
          for (let k = 0; k < n.max - n.min; k++) {
            const body: GrammarElement[] = [...item];
            if (inner !== undefined) body.push({ kind: "ref", rule: inner });
            inner = this.fresh(base, [body, []]);
          }
          out.push({ kind: "ref", rule: inner! });
        }
        return;
      }
    }
  }
}

/** Rules that can match the empty string. */
function nullableRules(rules: GrammarElement[][][]): boolean[] {
  const nullable = rules.map(() => false);
  let changed = true;
  while (changed) {
    changed = false;
    rules.forEach((alts, r) => {
      if (nullable[r]) return;
      if (alts.some((a) => a.every((e) => e.kind === "ref" && nullable[e.rule]))) {
        nullable[r] = true;
        changed = true;
      }
    });
  }
  return nullable;
}

/**
 * Refuses left recursion (a rule that can reach itself without consuming a character), which the stack
 * matcher cannot run — llama.cpp refuses it too.
 */
function checkLeftRecursion(g: GrammarRules): void {
  const nullable = nullableRules(g.rules);
  // edges: r → rules that can start r
  const starts = g.rules.map((alts) => {
    const s = new Set<number>();
    for (const a of alts) {
      for (const e of a) {
        if (e.kind === "char") break;
        s.add(e.rule);
        if (!nullable[e.rule]) break;
      }
    }
    return s;
  });
  const state = new Uint8Array(g.rules.length); // 0 new, 1 on path, 2 done
  const visit = (r: number, path: number[]): void => {
    if (state[r] === 2) return;
    if (state[r] === 1) {
      const cycle = path.slice(path.indexOf(r)).map((i) => g.names[i]);
      throw new GrammarError(`grammar: left recursion (${[...cycle, g.names[r]].join(" → ")}) is not supported`);
    }
    state[r] = 1;
    path.push(r);
    for (const n of starts[r]!) visit(n, path);
    path.pop();
    state[r] = 2;
  };
  for (let r = 0; r < g.rules.length; r++) visit(r, []);
}

/**
 * Parses and compiles a GBNF grammar.
 * @param root the start rule (default "root")
 * @throws GrammarError for a syntax error (with line and column), an undefined rule, a missing start
 *   rule, or left recursion.
 */
export function parseGbnf(src: string, root = "root"): GrammarRules {
  if (typeof src !== "string" || src.trim() === "") throw new GrammarError("grammar: the grammar is empty");
  const p = new Parser(src);
  p.parse();
  if (!p.defs.has(root)) throw new GrammarError(`grammar: no "${root}" rule (the start rule)`);
  const c = new Compiler(p);
  const g: GrammarRules = { names: c.names, rules: c.rules, root: c.names.indexOf(root) };
  checkLeftRecursion(g);
  return g;
}
