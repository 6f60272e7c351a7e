/**
 * Unicode helpers shared by the tokenizers: code point categories as llama.cpp's `unicode.cpp` sees
 * them (its tables are generated from Python's `regex` module: \p{L}, \p{N}, ... and \s = the Unicode
 * White_Space property), UTF-8 helpers, and the GPT-2 byte <-> unicode mapping.
 */

/** Code point category group (one per code point, as in llama.cpp's collapsed-regex representation). */
export const Cat = { Other: 1, Number: 2, Letter: 3, Punctuation: 4, Mark: 5, Symbol: 6 } as const;
export type Cat = (typeof Cat)[keyof typeof Cat];

const WHITESPACE_BIT = 0x80;
const RE_L = /\p{L}/u;
const RE_N = /\p{N}/u;
const RE_P = /\p{P}/u;
const RE_M = /\p{M}/u;
const RE_S = /\p{S}/u;

/** Unicode White_Space (llama.cpp `unicode_set_whitespace`). JS `\s` differs: it adds U+FEFF, lacks U+0085. */
export function isWhitespaceCpt(cp: number): boolean {
  return (
    (cp >= 0x09 && cp <= 0x0d) ||
    cp === 0x20 ||
    cp === 0x85 ||
    cp === 0xa0 ||
    cp === 0x1680 ||
    (cp >= 0x2000 && cp <= 0x200a) ||
    cp === 0x2028 ||
    cp === 0x2029 ||
    cp === 0x202f ||
    cp === 0x205f ||
    cp === 0x3000
  );
}

let flagCache: Uint8Array | undefined;

function cptFlags(cp: number): number {
  if (flagCache === undefined) flagCache = new Uint8Array(0x110000);
  let f = flagCache[cp];
  if (f === 0) {
    const ch = String.fromCodePoint(cp);
    let cat: number = Cat.Other;
    if (RE_L.test(ch)) cat = Cat.Letter;
    else if (RE_N.test(ch)) cat = Cat.Number;
    else if (RE_P.test(ch)) cat = Cat.Punctuation;
    else if (RE_M.test(ch)) cat = Cat.Mark;
    else if (RE_S.test(ch)) cat = Cat.Symbol;
    f = cat | (isWhitespaceCpt(cp) ? WHITESPACE_BIT : 0);
    flagCache[cp] = f;
  }
  return f;
}

/** The general category group of a code point (L, N, P, M, S, or other). */
export function cptCategory(cp: number): Cat {
  return (cptFlags(cp) & 0x7f) as Cat;
}

/** Replaces lone surrogates by U+FFFD, as UTF-8 encoding would. */
export function toWellFormed(text: string): string {
  const s = text as string & { toWellFormed?: () => string };
  if (typeof s.toWellFormed === "function") return s.toWellFormed();
  return text.replace(/[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/g, "\uFFFD");
}

/** The code points of a (well-formed) string. */
export function codePoints(text: string): number[] {
  const out: number[] = [];
  for (let i = 0; i < text.length; i++) {
    const c = text.codePointAt(i)!;
    out.push(c);
    if (c > 0xffff) i++;
  }
  return out;
}

const encoder = new TextEncoder();

/** UTF-8 bytes of a string (lone surrogates become EF BF BD). */
export function utf8Encode(text: string): Uint8Array {
  return encoder.encode(text);
}

/** Number of UTF-8 bytes of a string. */
export function utf8Length(text: string): number {
  let n = 0;
  for (let i = 0; i < text.length; i++) {
    const c = text.charCodeAt(i);
    if (c < 0x80) n += 1;
    else if (c < 0x800) n += 2;
    else if (c >= 0xd800 && c <= 0xdbff && i + 1 < text.length) {
      const d = text.charCodeAt(i + 1);
      if (d >= 0xdc00 && d <= 0xdfff) {
        n += 4;
        i++;
      } else n += 3;
    } else n += 3;
  }
  return n;
}

/** Decodes UTF-8 to a string; invalid sequences become U+FFFD and a leading BOM is kept. */
export function utf8Decode(bytes: Uint8Array): string {
  return new TextDecoder("utf-8", { ignoreBOM: true }).decode(bytes);
}

/**
 * GPT-2 byte-level BPE mapping (`bytes_to_unicode` in OpenAI's encoder.py, llama.cpp
 * `unicode_byte_to_utf8_map`): printable bytes map to themselves, the rest to U+0100 upwards.
 */
export const BYTE_TO_UNICODE: readonly string[] = (() => {
  const map: string[] = new Array(256);
  const keep = (b: number) => (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
  let n = 0;
  for (let b = 0; b < 256; b++) map[b] = keep(b) ? String.fromCharCode(b) : String.fromCharCode(256 + n++);
  return map;
})();

/** Inverse of {@link BYTE_TO_UNICODE}: code point -> byte. */
export const UNICODE_TO_BYTE: ReadonlyMap<number, number> = new Map(
  BYTE_TO_UNICODE.map((ch, b) => [ch.charCodeAt(0), b] as [number, number]),
);
