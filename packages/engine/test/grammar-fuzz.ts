/**
 * Test helpers: random GBNF grammars, and an independent membership checker for them — a memoised
 * backtracking matcher over the generator's own tree, written apart from the incremental stack parser.
 */

/** A grammar node as the generator builds it. */
export type GNode =
  | { t: "lit"; text: string }
  | { t: "cls"; ranges: [number, number][]; neg: boolean }
  | { t: "any" }
  | { t: "ref"; rule: number }
  | { t: "seq"; items: GNode[] }
  | { t: "alt"; alts: GNode[] }
  | { t: "rep"; item: GNode; min: number; max: number };

export interface GenGrammar {
  rules: GNode[];
  gbnf: string;
}

export function rng(seed: number): () => number {
  let a = seed >>> 0;
  return () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
}

const ALPHABET = ["a", "b", "c", "e", "o", " ", ",", ".", "\n", '"', "1", "T", "é"];

function esc(ch: string): string {
  if (ch === '"') return '\\"';
  if (ch === "\\") return "\\\\";
  if (ch === "\n") return "\\n";
  if (ch === "]") return "\\]";
  if (ch === "[") return "\\[";
  if (ch === "-") return "\\-";
  if (ch === "^") return "\\^";
  return ch;
}

function render(n: GNode): string {
  switch (n.t) {
    case "lit":
      return `"${[...n.text].map(esc).join("")}"`;
    case "cls":
      return `[${n.neg ? "^" : ""}${n.ranges
        .map(([lo, hi]) =>
          lo === hi
            ? esc(String.fromCodePoint(lo))
            : `${esc(String.fromCodePoint(lo))}-${esc(String.fromCodePoint(hi))}`,
        )
        .join("")}]`;
    case "any":
      return ".";
    case "ref":
      return `r${n.rule}`;
    case "seq":
      return n.items.map((i) => (i.t === "alt" ? `(${render(i)})` : render(i))).join(" ");
    case "alt":
      return n.alts.map(render).join(" | ");
    case "rep": {
      const inner =
        n.item.t === "seq" || n.item.t === "alt" || n.item.t === "rep" ? `(${render(n.item)})` : render(n.item);
      if (n.min === 0 && n.max === 1) return `${inner}?`;
      if (n.min === 0 && n.max < 0) return `${inner}*`;
      if (n.min === 1 && n.max < 0) return `${inner}+`;
      if (n.max < 0) return `${inner}{${n.min},}`;
      if (n.min === n.max) return `${inner}{${n.min}}`;
      return n.min === 0 && n.max > 0 && n.max % 2 ? `${inner}{,${n.max}}` : `${inner}{${n.min},${n.max}}`;
    }
  }
}

/** Can the node match the empty string? (refs to later rules: assume they may) */
function nullable(n: GNode, rules: GNode[]): boolean {
  switch (n.t) {
    case "lit":
      return n.text.length === 0;
    case "cls":
    case "any":
      return false;
    case "ref":
      return nullable(rules[n.rule]!, rules);
    case "seq":
      return n.items.every((i) => nullable(i, rules));
    case "alt":
      return n.alts.some((a) => nullable(a, rules));
    case "rep":
      return n.min === 0 || nullable(n.item, rules);
  }
}

/**
 * A random grammar of 1–4 rules over a small alphabet: rule i refers only to later rules, or to itself
 * after a literal (no left recursion); unbounded repetitions repeat only non-empty items.
 */
export function randomGrammar(seed: number): GenGrammar {
  const r = rng(seed);
  const pick = <T>(xs: T[]) => xs[Math.floor(r() * xs.length)]!;
  const nRules = 1 + Math.floor(r() * 4);
  const rules: GNode[] = new Array(nRules);
  const terminal = (): GNode => {
    const k = r();
    if (k < 0.5) {
      const len = 1 + Math.floor(r() * 3);
      return { t: "lit", text: Array.from({ length: len }, () => pick(ALPHABET)).join("") };
    }
    if (k < 0.92) {
      const ranges: [number, number][] = [];
      const n = 1 + Math.floor(r() * 2);
      for (let i = 0; i < n; i++) {
        const a = pick(ALPHABET).codePointAt(0)!;
        const b = r() < 0.4 ? pick(ALPHABET).codePointAt(0)! : a;
        ranges.push([Math.min(a, b), Math.max(a, b)]);
      }
      return { t: "cls", ranges, neg: r() < 0.2 };
    }
    return { t: "any" };
  };
  const node = (rule: number, depth: number): GNode => {
    const k = r();
    if (depth > 2 || k < 0.35) {
      if (rule + 1 < nRules && r() < 0.3) return { t: "ref", rule: rule + 1 + Math.floor(r() * (nRules - rule - 1)) };
      return terminal();
    }
    if (k < 0.6)
      return { t: "seq", items: Array.from({ length: 2 + Math.floor(r() * 2) }, () => node(rule, depth + 1)) };
    if (k < 0.8)
      return { t: "alt", alts: Array.from({ length: 2 + Math.floor(r() * 2) }, () => node(rule, depth + 1)) };
    const op = pick(["?", "*", "+", "{m}", "{m,n}", "{m,}"]);
    if (op === "*" || op === "+" || op === "{m,}") {
      // unbounded: a non-empty item only (else it is left-recursive, which GBNF refuses)
      const item = terminal();
      return { t: "rep", item, min: op === "*" ? 0 : op === "+" ? 1 : Math.floor(r() * 3), max: -1 };
    }
    const item = node(rule, depth + 1);
    if (op === "?") return { t: "rep", item, min: 0, max: 1 };
    const m = Math.floor(r() * 3);
    return { t: "rep", item, min: m, max: op === "{m}" ? m : m + Math.floor(r() * 3) };
  };
  for (let i = nRules - 1; i >= 0; i--) {
    let body = node(i, 0);
    // sometimes recursive: X ::= body | "lit" X (recursion after a character)
    if (r() < 0.3) body = { t: "alt", alts: [body, { t: "seq", items: [terminal(), { t: "ref", rule: i }] }] };
    rules[i] = body;
  }
  // an unbounded repetition of a nullable thing cannot occur (terminals only), so no left recursion
  void nullable;
  const gbnf = rules
    .map((n, i) => `${i === 0 ? "root" : `r${i}`} ::= ${render(n)}`)
    .join("\n")
    .replace(/\br0\b/g, "root");
  return { rules, gbnf };
}

const INF = Number.POSITIVE_INFINITY;

/**
 * The membership of `text` in the language of `g`: "sentence", "prefix" (some continuation makes it a
 * sentence) or "no". End positions of each node from each position, memoised; INF stands for "ran out of
 * text inside this node".
 */
export function checkMembership(g: GenGrammar, text: string): "sentence" | "prefix" | "no" {
  const cps = [...text].map((c) => c.codePointAt(0)!);
  const len = cps.length;
  const memo = new Map<GNode, Map<number, Set<number>>>();
  const ends = (n: GNode, pos: number): Set<number> => {
    if (pos === INF) return new Set([INF]);
    let m = memo.get(n);
    if (!m) {
      m = new Map();
      memo.set(n, m);
    }
    const hit = m.get(pos);
    if (hit) return hit;
    const out = new Set<number>();
    m.set(pos, out); // recursion only after a character, so a re-entry at the same pos cannot happen
    const chars = (ok: (c: number) => boolean) => {
      if (pos >= len) out.add(INF);
      else if (ok(cps[pos]!)) out.add(pos + 1);
    };
    switch (n.t) {
      case "lit": {
        const lc = [...n.text].map((c) => c.codePointAt(0)!);
        let p = pos;
        let ok = true;
        for (const c of lc) {
          if (p >= len) {
            out.add(INF);
            ok = false;
            break;
          }
          if (cps[p] !== c) {
            ok = false;
            break;
          }
          p++;
        }
        if (ok) out.add(p);
        break;
      }
      case "cls":
        chars((c) => n.ranges.some(([lo, hi]) => c >= lo && c <= hi) !== n.neg);
        break;
      case "any":
        chars(() => true);
        break;
      case "ref":
        for (const e of ends(g.rules[n.rule]!, pos)) out.add(e);
        break;
      case "seq": {
        let ps = new Set([pos]);
        for (const it of n.items) {
          const next = new Set<number>();
          for (const p of ps) for (const e of ends(it, p)) next.add(e);
          ps = next;
        }
        for (const p of ps) out.add(p);
        break;
      }
      case "alt":
        for (const a of n.alts) for (const e of ends(a, pos)) out.add(e);
        break;
      case "rep": {
        // breadth-first over the count; positions seen at a count ≥ min are not revisited
        let ps = new Set([pos]);
        if (n.min === 0) out.add(pos);
        for (let k = 1; n.max < 0 || k <= n.max; k++) {
          const next = new Set<number>();
          for (const p of ps) for (const e of ends(n.item, p)) next.add(e);
          if (k >= n.min) {
            let fresh = false;
            for (const e of next) {
              if (!out.has(e)) fresh = true;
              out.add(e);
            }
            if (!fresh && n.max < 0) break;
          }
          if (next.size === 0) break;
          ps = next;
          if (n.max < 0 && k > len + 2) break;
        }
        break;
      }
    }
    return out;
  };
  const e = ends(g.rules[0]!, 0);
  if (e.has(len)) return "sentence";
  if (e.has(INF)) return "prefix";
  return "no";
}

/** A random sentence of the grammar (bounded depth), for acceptance tests. */
export function randomSentence(g: GenGrammar, seed: number): string | undefined {
  const r = rng(seed);
  let budget = 200;
  const gen = (n: GNode, depth: number): string | undefined => {
    if (--budget < 0 || depth > 30) return undefined;
    switch (n.t) {
      case "lit":
        return n.text;
      case "cls": {
        const pool = ALPHABET.map((c) => c.codePointAt(0)!).filter(
          (c) => n.ranges.some(([lo, hi]) => c >= lo && c <= hi) !== n.neg,
        );
        for (const [lo] of n.ranges) if (!n.neg) pool.push(lo);
        if (pool.length === 0 && n.neg) {
          const c = ["z", "~", "\u4e00"].find(
            (x) => !n.ranges.some(([lo, hi]) => x.codePointAt(0)! >= lo && x.codePointAt(0)! <= hi),
          );
          return c;
        }
        if (pool.length === 0) return undefined;
        return String.fromCodePoint(pool[Math.floor(r() * pool.length)]!);
      }
      case "any":
        return ALPHABET[Math.floor(r() * ALPHABET.length)]!;
      case "ref":
        return gen(g.rules[n.rule]!, depth + 1);
      case "seq": {
        let s = "";
        for (const i of n.items) {
          const x = gen(i, depth + 1);
          if (x === undefined) return undefined;
          s += x;
        }
        return s;
      }
      case "alt": {
        // prefer the first alternative deep down (the non-recursive one)
        const a = depth > 10 ? n.alts[0]! : n.alts[Math.floor(r() * n.alts.length)]!;
        return gen(a, depth + 1);
      }
      case "rep": {
        const max = n.max < 0 ? n.min + 3 : n.max;
        const k = n.min + Math.floor(r() * (max - n.min + 1));
        let s = "";
        for (let i = 0; i < k; i++) {
          const x = gen(n.item, depth + 1);
          if (x === undefined) return undefined;
          s += x;
        }
        return s;
      }
    }
  };
  return gen(g.rules[0]!, 0);
}
