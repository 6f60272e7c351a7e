/**
 * JSON Schema → GBNF, with the semantics of llama.cpp's converter (common/json-schema-to-grammar.cpp):
 * required properties first in `properties` order, then the optional ones, each at most once and in order;
 * no properties beyond `properties` unless `additionalProperties` is `true` or a schema (llama.cpp's
 * default, stricter than JSON Schema's); whitespace `space ::= | " " | "\n"{1,2} [ \t]{0,20}` after `{`,
 * `[`, `:` and `,` and before `}` and `]`; numbers as JSON numbers of at most 16 integral and 16 decimal
 * digits.
 *
 * Supported: `type` (string, number, integer, boolean, null, object, array, or a list of them), `enum`,
 * `const`, `properties`, `required`, `additionalProperties`, `items`, `prefixItems`, `minItems`,
 * `maxItems`, `minLength`, `maxLength`, `anyOf`, `oneOf` (as anyOf), `allOf` of objects, local `$ref`
 * (`#/$defs/…`, `#/definitions/…`, `#`), `format: "uuid"`, `minimum`/`maximum`/`exclusiveMinimum`/
 * `exclusiveMaximum` on integers (bounds on numbers are ignored, as llama.cpp). Anything that would constrain the value further
 * and is not supported (`pattern`, other `format`s, `not`, …) is refused
 * with a {@link GrammarError} rather than silently ignored.
 */
import { GrammarError } from "./gbnf.js";

type Schema = Record<string, unknown> | boolean;

const SPACE = '| " " | "\\n"{1,2} [ \\t]{0,20}';

const PRIMITIVES: Record<string, [string, string[]]> = {
  boolean: ['("true" | "false")', []],
  "decimal-part": ["[0-9]{1,16}", []],
  "integral-part": ["[0] | [1-9] [0-9]{0,15}", []],
  number: ['("-"? integral-part) ("." decimal-part)? ([eE] [-+]? integral-part)?', ["integral-part", "decimal-part"]],
  integer: ['("-"? integral-part)', ["integral-part"]],
  value: [
    "object | array | string | number | boolean | null",
    ["object", "array", "string", "number", "boolean", "null"],
  ],
  object: ['"{" space ( string ":" space value ("," space string ":" space value)* )? space "}"', ["string", "value"]],
  array: ['"[" space ( value ("," space value)* )? space "]"', ["value"]],
  uuid: ['"\\"" [0-9a-fA-F]{8} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{4} "-" [0-9a-fA-F]{12} "\\""', []],
  char: ['[^"\\\\\\x7F\\x00-\\x1F] | [\\\\] (["\\\\bfnrt] | "u" [0-9a-fA-F]{4})', []],
  string: ['"\\"" char* "\\""', ["char"]],
  null: ['"null"', []],
};

/** Keywords that only annotate (ignored), or that this converter handles. */
const KNOWN = new Set([
  "$schema",
  "$id",
  "$comment",
  "$defs",
  "definitions",
  "title",
  "description",
  "default",
  "examples",
  "deprecated",
  "readOnly",
  "writeOnly",
  "type",
  "enum",
  "const",
  "properties",
  "required",
  "additionalProperties",
  "items",
  "prefixItems",
  "minItems",
  "maxItems",
  "minLength",
  "maxLength",
  "anyOf",
  "oneOf",
  "allOf",
  "$ref",
  "format",
  // numbers: llama.cpp ignores bounds on "number" too
  "minimum",
  "maximum",
  "exclusiveMinimum",
  "exclusiveMaximum",
]);

/** A JSON value as a GBNF literal ("\"a\"" for the string "a"). */
export function gbnfLiteral(text: string): string {
  let out = '"';
  for (const ch of text) {
    const c = ch.codePointAt(0)!;
    if (ch === '"') out += '\\"';
    else if (ch === "\\") out += "\\\\";
    else if (ch === "\n") out += "\\n";
    else if (ch === "\r") out += "\\r";
    else if (ch === "\t") out += "\\t";
    else if (c < 0x20 || c === 0x7f) out += `\\x${c.toString(16).padStart(2, "0")}`;
    else out += ch;
  }
  return `${out}"`;
}

/** llama.cpp's build_repetition: `item` min..max times (max −1: unbounded), separated by `sep`. */
function repetition(item: string, min: number, max: number, sep = ""): string {
  if (max === 0) return "";
  if (min === 0 && max === 1) return `${item}?`;
  if (!sep) {
    if (min === 1 && max < 0) return `${item}+`;
    if (min === 0 && max < 0) return `${item}*`;
    return `${item}{${min},${max < 0 ? "" : max}}`;
  }
  let r = `${item} ${repetition(`(${sep} ${item})`, min === 0 ? 0 : min - 1, max < 0 ? -1 : max - 1)}`;
  if (min === 0) r = `(${r})?`;
  return r;
}

/** The largest magnitude an integer range may name: 16 digits, as the integral part of llama.cpp's numbers. */
const MAX_INT = 10n ** 16n - 1n;

/** Decimal strings of one length, a ≤ x ≤ b digit by digit, as alternatives of char classes. */
function sameLength(a: string, b: string): string[] {
  if (a.length === 0) return [""];
  if (a === b) return [`"${a}"`];
  const rest = a.length - 1;
  const any = rest > 0 ? ` [0-9]{${rest}}` : "";
  if (a[0] === b[0]) return sameLength(a.slice(1), b.slice(1)).map((t) => `"${a[0]}"${t ? ` ${t}` : ""}`);
  const out: string[] = [];
  const a0 = Number(a[0]);
  const b0 = Number(b[0]);
  const nines = "9".repeat(rest);
  const zeros = "0".repeat(rest);
  // first digit a0: the rest from a's rest up; a full span collapses to any digits
  if (a.slice(1) === zeros) out.push(`"${a[0]}"${any}`);
  else out.push(...sameLength(a.slice(1), nines).map((t) => `"${a[0]}" ${t}`));
  if (b0 - a0 > 1) out.push(`[${a0 + 1}-${b0 - 1}]${any}`);
  if (b.slice(1) === nines) out.push(`"${b[0]}"${any}`);
  else out.push(...sameLength(zeros, b.slice(1)).map((t) => `"${b[0]}" ${t}`));
  return out;
}

/** Non-negative integers lo..hi without leading zeros, as GBNF alternatives. */
function natRange(lo: bigint, hi: bigint): string[] {
  const out: string[] = [];
  for (let len = String(lo).length; len <= String(hi).length; len++) {
    const floor = len === 1 ? 0n : 10n ** BigInt(len - 1);
    const from = lo > floor ? lo : floor;
    const ceil = 10n ** BigInt(len) - 1n;
    const to = hi < ceil ? hi : ceil;
    if (from <= to) out.push(...sameLength(String(from), String(to)));
  }
  return out;
}

/** Integers lo..hi (|lo|, |hi| ≤ 10¹⁶ − 1) as JSON numbers, as one GBNF alternation. */
function intRange(lo: bigint, hi: bigint): string {
  const alts: string[] = [];
  if (lo < 0n) {
    const top = hi < -1n ? hi : -1n;
    alts.push(...natRange(-top, -lo).map((t) => `"-" ${t}`));
  }
  if (hi >= 0n) alts.push(...natRange(lo > 0n ? lo : 0n, hi));
  return alts.join(" | ");
}

/** A character for a GBNF character class. */
function classChar(ch: string): string {
  const c = ch.codePointAt(0)!;
  if ('\\]-^["'.includes(ch)) return `\\${ch}`;
  if (c < 0x20 || c === 0x7f) return `\\x${c.toString(16).padStart(2, "0")}`;
  return ch;
}

/**
 * A JSON string (quotes included) that is none of `keys` (llama.cpp's `_not_strings`): a trie of the
 * keys; at each node the string may go on along a child, leave the trie with another character (then
 * anything), or close — unless the text so far is a key. `char` is the rule of one string character.
 */
function notStrings(keys: string[], char: string): string {
  interface TrieNode {
    end: boolean;
    kids: Map<string, TrieNode>;
  }
  const root: TrieNode = { end: false, kids: new Map() };
  for (const k of keys) {
    let n = root;
    // the key as JSON text writes it (escapes included)
    for (const ch of JSON.stringify(k).slice(1, -1)) {
      let next = n.kids.get(ch);
      if (!next) {
        next = { end: false, kids: new Map() };
        n.kids.set(ch, next);
      }
      n = next;
    }
    n.end = true;
  }
  const rest = (n: TrieNode): string => {
    const alts: string[] = [];
    for (const [ch, kid] of n.kids) alts.push(`${gbnfLiteral(ch)} ${rest(kid)}`);
    const others = [...n.kids.keys()].map(classChar).join("");
    // another plain character, or an escape sequence, leaves the trie (where a key goes on with an escape,
    // only along the key: other escapes are not offered there)
    const escapes = n.kids.has("\\") ? "" : ' | [\\\\] (["\\\\bfnrt] | "u" [0-9a-fA-F]{4})';
    alts.push(`([^"\\\\\\x7F\\x00-\\x1F${others}]${escapes}) ${char}* "\\""`);
    if (!n.end) alts.push('"\\""');
    return `(${alts.join(" | ")})`;
  };
  return `"\\"" ${rest(root)}`;
}

const isObj = (v: unknown): v is Record<string, unknown> => typeof v === "object" && v !== null && !Array.isArray(v);

class Converter {
  private readonly rules = new Map<string, string>();
  private readonly refs = new Map<string, string>();

  constructor(private readonly rootSchema: Schema) {
    this.rules.set("space", SPACE);
  }

  private fail(path: string, what: string): never {
    throw new GrammarError(`json_schema${path ? ` at ${path}` : ""}: ${what}`);
  }

  private addRule(name: string, body: string): string {
    let key = name.replace(/[^a-zA-Z0-9-]+/g, "-") || "root";
    // the primitives' names are taken (a property named "string" gets "string-")
    if (key === "space" || key in PRIMITIVES) key += "-";
    const existing = this.rules.get(key);
    if (existing === undefined || existing === body) {
      this.rules.set(key, body);
      return key;
    }
    let i = 0;
    while (this.rules.has(`${key}${i}`) && this.rules.get(`${key}${i}`) !== body) i++;
    this.rules.set(`${key}${i}`, body);
    return `${key}${i}`;
  }

  private primitive(name: string): string {
    const [body, deps] = PRIMITIVES[name]!;
    // set first: the primitives refer to each other (value → object → value)
    this.rules.set(name, body);
    for (const d of deps) if (!this.rules.has(d)) this.primitive(d);
    return name;
  }

  private resolve(ref: string, path: string): Schema {
    if (ref === "#") return this.rootSchema;
    const m = /^#\/(\$defs|definitions)\/(.+)$/.exec(ref);
    if (!m) this.fail(path, `only local references (#/$defs/NAME, #/definitions/NAME) are supported, got "${ref}"`);
    const defs = isObj(this.rootSchema) ? this.rootSchema[m[1]!] : undefined;
    const target = isObj(defs) ? defs[decodeURIComponent(m[2]!).replace(/~1/g, "/").replace(/~0/g, "~")] : undefined;
    if (target === undefined) this.fail(path, `reference "${ref}" points to nothing`);
    return target as Schema;
  }

  visit(schema: Schema, name: string, path: string): string {
    const ruleName = name || "root";
    if (schema === true || (isObj(schema) && Object.keys(schema).every((k) => !KNOWN.has(k) || k === "$schema"))) {
      if (isObj(schema)) this.checkKeys(schema, path);
      return this.addRule(ruleName, this.primitive("value"));
    }
    if (schema === false) this.fail(path, "the schema false matches nothing");
    if (!isObj(schema)) this.fail(path, `a schema must be an object or a boolean, got ${JSON.stringify(schema)}`);
    this.checkKeys(schema, path);
    const sub = name ? `${name}-` : "";
    if (typeof schema.$ref === "string") {
      const ref = schema.$ref;
      let rule = this.refs.get(ref);
      if (rule === undefined) {
        rule = this.addRule(`ref${ref.replace(/^#/, "")}`, "");
        this.refs.set(ref, rule);
        const body = this.visit(this.resolve(ref, path), `${rule}-def`, `${path}/$ref`);
        this.rules.set(rule, body);
      }
      return this.addRule(ruleName, rule);
    }
    const alts = (schema.anyOf ?? schema.oneOf) as unknown;
    if (alts !== undefined) {
      if (!Array.isArray(alts) || alts.length === 0) this.fail(path, "anyOf/oneOf must be a non-empty array");
      return this.addRule(
        ruleName,
        alts.map((a, i) => this.visit(a as Schema, `${sub}${i}`, `${path}/anyOf/${i}`)).join(" | "),
      );
    }
    if (schema.allOf !== undefined) return this.allOf(schema, ruleName, path);
    if (schema.const !== undefined) return this.addRule(ruleName, gbnfLiteral(JSON.stringify(schema.const)));
    if (schema.enum !== undefined) {
      if (!Array.isArray(schema.enum) || schema.enum.length === 0) this.fail(path, "enum must be a non-empty array");
      return this.addRule(ruleName, `(${schema.enum.map((v) => gbnfLiteral(JSON.stringify(v))).join(" | ")})`);
    }
    let type = schema.type;
    if (Array.isArray(type)) {
      if (type.length === 0) this.fail(path, "type must not be an empty list");
      if (type.length > 1) {
        return this.addRule(
          ruleName,
          type.map((t) => this.visit({ ...schema, type: t }, `${sub}${String(t)}`, path)).join(" | "),
        );
      }
      type = type[0];
    }
    if (type === undefined) {
      if (schema.properties !== undefined || schema.additionalProperties !== undefined) type = "object";
      else if (schema.items !== undefined || schema.prefixItems !== undefined) type = "array";
      else if (schema.minLength !== undefined || schema.maxLength !== undefined) type = "string";
      else return this.addRule(ruleName, this.primitive("value"));
    }
    switch (type) {
      case "object":
        return this.object(schema, name, ruleName, path);
      case "array":
        return this.array(schema, sub, ruleName, path);
      case "string": {
        if (schema.format !== undefined) {
          if (schema.format === "uuid") return this.addRule(ruleName, this.primitive("uuid"));
          this.fail(path, `string format "${String(schema.format)}" is not supported (supported: uuid)`);
        }
        const min = this.count(schema.minLength, "minLength", path) ?? 0;
        const max = this.count(schema.maxLength, "maxLength", path) ?? -1;
        if (max >= 0 && max < min) this.fail(path, `maxLength ${max} is below minLength ${min}`);
        if (min > 0 || max >= 0)
          return this.addRule(ruleName, `"\\"" ${repetition(this.primitive("char"), min, max)} "\\""`);
        return this.addRule(ruleName, this.primitive("string"));
      }
      case "integer": {
        const bound = (k: string, exclusive: string, dir: 1 | -1): bigint | undefined => {
          const v = schema[k];
          const x = schema[exclusive];
          let b: number | undefined;
          if (v !== undefined) {
            if (typeof v !== "number" || !Number.isFinite(v)) this.fail(path, `${k} must be a number`);
            b = dir > 0 ? Math.ceil(v) : Math.floor(v);
          }
          if (x !== undefined) {
            if (typeof x !== "number" || !Number.isFinite(x)) this.fail(path, `${exclusive} must be a number`);
            const e = dir > 0 ? Math.floor(x) + 1 : Math.ceil(x) - 1;
            b = b === undefined ? e : dir > 0 ? Math.max(b, e) : Math.min(b, e);
          }
          if (b === undefined) return undefined;
          if (!Number.isSafeInteger(b)) this.fail(path, `${k} beyond ±${Number.MAX_SAFE_INTEGER} is not supported`);
          return BigInt(b);
        };
        const lo = bound("minimum", "exclusiveMinimum", 1);
        const hi = bound("maximum", "exclusiveMaximum", -1);
        if (lo === undefined && hi === undefined) return this.addRule(ruleName, this.primitive("integer"));
        if (lo !== undefined && hi !== undefined && lo > hi) this.fail(path, `no integer lies in [${lo}, ${hi}]`);
        return this.addRule(ruleName, `(${intRange(lo ?? -MAX_INT, hi ?? MAX_INT)})`);
      }
      case "number":
      case "boolean":
      case "null":
        return this.addRule(ruleName, this.primitive(type));
      default:
        this.fail(path, `unknown type ${JSON.stringify(type)}`);
    }
  }

  private checkKeys(schema: Record<string, unknown>, path: string): void {
    for (const k of Object.keys(schema)) {
      if (!KNOWN.has(k)) {
        this.fail(path, `the keyword "${k}" is not supported (the grammar could not enforce it)`);
      }
    }
  }

  private count(v: unknown, what: string, path: string): number | undefined {
    if (v === undefined) return undefined;
    if (typeof v !== "number" || !Number.isInteger(v) || v < 0) this.fail(path, `${what} must be an integer ≥ 0`);
    if (v > 10000) this.fail(path, `${what} above 10000 is not supported`);
    return v;
  }

  private array(schema: Record<string, unknown>, sub: string, ruleName: string, path: string): string {
    const min = this.count(schema.minItems, "minItems", path) ?? 0;
    const max = this.count(schema.maxItems, "maxItems", path) ?? -1;
    if (max >= 0 && max < min) this.fail(path, `maxItems ${max} is below minItems ${min}`);
    const tuple = (schema.prefixItems ?? (Array.isArray(schema.items) ? schema.items : undefined)) as unknown;
    if (Array.isArray(tuple)) {
      const parts = tuple.map((s, i) => this.visit(s as Schema, `${sub}tuple-${i}`, `${path}/prefixItems/${i}`));
      return this.addRule(ruleName, `"[" space ${parts.join(' "," space ')} space "]"`);
    }
    const items = schema.items as Schema | undefined;
    if ((items === undefined || items === true) && min === 0 && max < 0) {
      return this.addRule(ruleName, this.primitive("array"));
    }
    const item = items === undefined ? this.primitive("value") : this.visit(items, `${sub}item`, `${path}/items`);
    return this.addRule(ruleName, `"[" space ${repetition(item, min, max, '"," space')} space "]"`);
  }

  private object(schema: Record<string, unknown>, name: string, ruleName: string, path: string): string {
    const props = schema.properties ?? {};
    if (!isObj(props)) this.fail(path, "properties must be an object");
    const required = schema.required ?? [];
    if (!Array.isArray(required) || required.some((r) => typeof r !== "string"))
      this.fail(path, "required must be an array of strings");
    const additional = schema.additionalProperties as Schema | undefined;
    if (
      Object.keys(props).length === 0 &&
      (additional === true || (isObj(additional) && Object.keys(additional).length === 0))
    ) {
      return this.addRule(ruleName, this.primitive("object"));
    }
    if (Object.keys(props).length === 0 && additional === undefined && schema.required === undefined) {
      // {"type": "object"} alone: any object, as llama.cpp
      return this.addRule(ruleName, this.primitive("object"));
    }
    return this.addRule(
      ruleName,
      this.objectRule(props as Record<string, Schema>, required as string[], name, additional, path),
    );
  }

  private objectRule(
    props: Record<string, Schema>,
    requiredList: string[],
    name: string,
    additional: Schema | undefined,
    path: string,
  ): string {
    const pre = name ? `${name}-` : "";
    const required = new Set(requiredList);
    for (const r of required) if (!(r in props)) this.fail(path, `required property "${r}" is not in properties`);
    const kv = new Map<string, string>();
    const req: string[] = [];
    const opt: string[] = [];
    for (const [k, s] of Object.entries(props)) {
      const value = this.visit(s, `${pre}${k}`, `${path}/properties/${k}`);
      kv.set(k, this.addRule(`${pre}${k}-kv`, `${gbnfLiteral(JSON.stringify(k))} space ":" space ${value}`));
      (required.has(k) ? req : opt).push(k);
    }
    if (additional === true || isObj(additional)) {
      const value =
        additional === true || Object.keys(additional).length === 0
          ? this.primitive("value")
          : this.visit(additional, `${pre}additional-value`, `${path}/additionalProperties`);
      // any other key: a string that is none of the named keys (as llama.cpp)
      const names = Object.keys(props);
      const key =
        names.length === 0
          ? this.primitive("string")
          : this.addRule(`${pre}additional-k`, notStrings(names, this.primitive("char")));
      kv.set("*", this.addRule(`${pre}additional-kv`, `${key} ":" space ${value}`));
      opt.push("*");
    }
    if (req.length === 0 && opt.length === 0) return '"{" space "}"';
    let rule = '"{" space ';
    rule += req.map((k) => kv.get(k)!).join(' "," space ');
    if (opt.length > 0) {
      rule += " (";
      if (req.length > 0) rule += ' "," space ( ';
      const rest = (ks: string[], firstOptional: boolean): string => {
        if (ks.length === 0) return "";
        const k = ks[0]!;
        const kvRule = kv.get(k)!;
        const comma = `( "," space ${kvRule} )`;
        let res = firstOptional ? comma + (k === "*" ? "*" : "?") : kvRule + (k === "*" ? ` ${comma}*` : "");
        if (ks.length > 1)
          res += ` ${this.addRule(`${pre}${k === "*" ? "additional" : k}-rest`, rest(ks.slice(1), true))}`;
        return res;
      };
      rule += opt.map((_, i) => rest(opt.slice(i), false)).join(" | ");
      if (req.length > 0) rule += " )";
      rule += " )?";
    }
    return `${rule} space "}"`;
  }

  private allOf(schema: Record<string, unknown>, ruleName: string, path: string): string {
    const parts = schema.allOf;
    if (!Array.isArray(parts) || parts.length === 0) this.fail(path, "allOf must be a non-empty array");
    const props: Record<string, Schema> = {};
    const required: string[] = [];
    const add = (s: Schema, p: string) => {
      let x = s;
      if (isObj(x) && typeof x.$ref === "string") x = this.resolve(x.$ref, p);
      if (!isObj(x) || !(x.type === "object" || x.properties !== undefined))
        this.fail(p, "allOf is supported only over object schemas");
      Object.assign(props, (x.properties ?? {}) as Record<string, Schema>);
      if (Array.isArray(x.required)) required.push(...(x.required as string[]));
    };
    parts.forEach((s, i) => {
      add(s as Schema, `${path}/allOf/${i}`);
    });
    return this.addRule(
      ruleName,
      this.objectRule(props, required, ruleName === "root" ? "" : ruleName, undefined, path),
    );
  }

  grammar(): string {
    return [...this.rules.entries()].map(([k, v]) => `${k} ::= ${v}`).join("\n");
  }
}

/**
 * Converts a JSON Schema to a GBNF grammar whose root matches exactly the JSON texts (with llama.cpp's
 * whitespace) that the schema accepts, within the supported subset.
 * @throws GrammarError naming the schema path and the unsupported or invalid keyword.
 */
export function jsonSchemaToGbnf(schema: unknown): string {
  if (typeof schema !== "boolean" && !isObj(schema)) {
    throw new GrammarError(`json_schema: a schema must be a JSON object, got ${JSON.stringify(schema) ?? "nothing"}`);
  }
  const c = new Converter(schema);
  c.visit(schema, "", "");
  return c.grammar();
}

/** The grammar of any JSON object (`response_format: {"type": "json_object"}` without a schema). */
export function jsonObjectGbnf(): string {
  return jsonSchemaToGbnf({ type: "object" });
}
