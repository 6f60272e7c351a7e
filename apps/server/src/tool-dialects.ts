/**
 * Tool-call dialects of chat templates: which format a model was trained to call tools in, detected from
 * its chat template's text as llama.cpp's common/chat.cpp does (before its template-diffing auto-parser),
 * the grammar that constrains generation to that format, and the parser that reads the calls back into
 * OpenAI's `tool_calls`.
 *
 * - `hermes` (Hermes 2 Pro, Qwen 2.5, Qwen3; the template mentions `<tool_call>`): each call is
 *   `<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>`, text may come before.
 * - `llama3` (Llama 3.1/3.2/3.3; the template has an `ipython` header): one JSON object
 *   `{"name": …, "parameters": {…}}` (optionally `"type": "function"` first, `<|python_tag|>` before).
 * - `mistral-nemo` (the template mentions `[TOOL_CALLS]`): `[TOOL_CALLS]` and a JSON array of
 *   `{"name": …, "arguments": {…}, "id": "<9 letters or digits>"}`.
 * - `generic`: every other template; llama.cpp's generic JSON format (see structured.ts).
 */
import { randomBytes } from "node:crypto";
import { GrammarError, gbnfLiteral, jsonSchemaToGbnf } from "@powerinfer/engine";
import { ApiError } from "./errors.js";

export type ToolDialect = "generic" | "hermes" | "llama3" | "mistral-nemo";

/** The dialect of a chat template's source (the checks and their order follow llama.cpp's). */
export function detectToolDialect(templateSource: string): ToolDialect {
  // Qwen3-Coder's XML calls (<tool_call><function=…><parameter=…>) are another format: not Hermes'
  const xml = templateSource.includes("<function=") && templateSource.includes("<parameter=");
  if (templateSource.includes("<tool_call>")) return xml ? "generic" : "hermes";
  if (templateSource.includes("<|start_header_id|>ipython<|end_header_id|>")) return "llama3";
  if (templateSource.includes("[TOOL_CALLS]")) return "mistral-nemo";
  return "generic";
}

/** A function tool as the request gives it. */
export interface FunctionSpec {
  name: string;
  description?: string | null;
  parameters?: unknown;
}

/** OpenAI's `tool_calls` entry. */
export interface ToolCall {
  id: string;
  type: "function";
  function: { name: string; arguments: string };
}

/** The text that starts a call in a dialect (the trigger of llama.cpp's lazy grammar). */
const TRIGGER: Record<Exclude<ToolDialect, "generic" | "llama3">, string> = {
  hermes: "<tool_call>",
  "mistral-nemo": "[TOOL_CALLS]",
};

/** Stands for Mistral's call id in the schema; replaced by a rule of 9 letters or digits. */
const ID_MARK = "powerinfer-call-id-6d0c1f";

/** A code point as a GBNF class member. */
const classChar = (c: string) => `\\x${c.charCodeAt(0).toString(16).padStart(2, "0")}`;

/**
 * GBNF rules `<p>-s0` … for the texts that do not contain `t` (a matcher of `t` as right-recursive rules,
 * one per matched prefix length). `t`'s first character must not occur again in it (true of the
 * triggers), so a mismatch falls back to the start or, on that character, to one matched.
 */
function textWithout(t: string, p: string): string {
  if (t.slice(1).includes(t[0]!)) throw new Error(`trigger ${t}: first character repeats`);
  const first = classChar(t[0]!);
  const rules: string[] = [];
  for (let k = 0; k < t.length; k++) {
    const alts = ['""'];
    const c = t[k]!;
    if (k > 0) alts.push(`${gbnfLiteral(t[0]!)} ${p}-s1`);
    if (k + 1 < t.length) alts.push(`${gbnfLiteral(c)} ${p}-s${k + 1}`);
    alts.push(k === 0 ? `[^${first}] ${p}-s0` : `[^${classChar(c)}${first}] ${p}-s0`);
    rules.push(`${p}-s${k} ::= ${alts.join(" | ")}`);
  }
  return rules.join("\n");
}

/** The JSON schema of one call object in a dialect. */
function callSchema(d: Exclude<ToolDialect, "generic">, f: FunctionSpec): Record<string, unknown> {
  const params = f.parameters ?? { type: "object" };
  const name = { const: f.name };
  if (d === "llama3")
    return { type: "object", properties: { name, parameters: params }, required: ["name", "parameters"] };
  if (d === "mistral-nemo") {
    return {
      type: "object",
      properties: { name, arguments: params, id: { const: ID_MARK } },
      required: ["name", "arguments", "id"],
    };
  }
  return { type: "object", properties: { name, arguments: params }, required: ["name", "arguments"] };
}

/**
 * The GBNF grammar (and its root rule) of a dialect's answer: with `required` only calls, else plain text
 * or calls (Hermes and Mistral: text that does not contain the trigger, then optionally the calls; Llama
 * 3.x: a call, or text that does not start with `{`).
 * @throws ApiError 400 when a tool's parameters schema cannot be converted.
 */
export function dialectGrammar(
  d: Exclude<ToolDialect, "generic">,
  tools: FunctionSpec[],
  o: { required: boolean; parallel: boolean },
): { gbnf: string; root: string } {
  const one = tools.length === 1 ? callSchema(d, tools[0]!) : { anyOf: tools.map((t) => callSchema(d, t)) };
  const value =
    d === "mistral-nemo" ? { type: "array", items: one, minItems: 1, ...(o.parallel ? {} : { maxItems: 1 }) } : one;
  let json: string;
  try {
    json = jsonSchemaToGbnf(value);
  } catch (e) {
    if (e instanceof GrammarError)
      throw new ApiError(400, "invalid_request_error", `tools: ${e.message}`, { param: "tools" });
    throw e;
  }
  if (d === "mistral-nemo") json = json.split(gbnfLiteral(JSON.stringify(ID_MARK))).join('"\\"" [a-zA-Z0-9]{9} "\\""');
  // a prefix no rule of the schema's grammar starts with
  let p = "tc";
  for (let i = 0; new RegExp(`^${p}-`, "m").test(json); i++) p = `tc${i}`;
  const rules: string[] = [json];
  let calls: string;
  if (d === "llama3") {
    calls = "root";
    if (!o.required) rules.push(`${p}-text ::= "" | [^{] ${p}-any`, `${p}-any ::= [^\\x00]*`);
    rules.push(`${p}-root ::= ${o.required ? calls : `${calls} | ${p}-text`}`);
    return { gbnf: rules.join("\n"), root: `${p}-root` };
  }
  if (d === "hermes") {
    rules.push(`${p}-call ::= ${gbnfLiteral("<tool_call>")} "\\n"? root "\\n"? ${gbnfLiteral("</tool_call>")}`);
    rules.push(`${p}-calls ::= ${o.parallel ? `${p}-call ("\\n"? ${p}-call)*` : `${p}-call`}`);
  } else {
    rules.push(`${p}-calls ::= ${gbnfLiteral("[TOOL_CALLS]")} root`);
  }
  if (!o.required) rules.push(textWithout(TRIGGER[d], p));
  rules.push(`${p}-root ::= ${o.required ? `${p}-calls` : `${p}-s0 ${p}-calls | ${p}-s0`}`);
  return { gbnf: rules.join("\n"), root: `${p}-root` };
}

/** The end of the JSON value (object or array) starting at `i`, string-aware; -1 when it does not close. */
function jsonEnd(text: string, i: number): number {
  let depth = 0;
  let inString = false;
  for (let j = i; j < text.length; j++) {
    const c = text[j];
    if (inString) {
      if (c === "\\") j++;
      else if (c === '"') inString = false;
    } else if (c === '"') inString = true;
    else if (c === "{" || c === "[") depth++;
    else if (c === "}" || c === "]") {
      depth--;
      if (depth === 0) return j + 1;
    }
  }
  return -1;
}

const parseJson = (s: string): unknown => {
  try {
    return JSON.parse(s);
  } catch {
    return undefined;
  }
};

const isObject = (v: unknown): v is Record<string, unknown> => typeof v === "object" && v !== null && !Array.isArray(v);

/** A call object's name and arguments → OpenAI's shape; undefined when it is not a call. */
function toCall(v: unknown, argsKey: "arguments" | "parameters", id?: unknown): ToolCall | undefined {
  if (!isObject(v) || typeof v.name !== "string") return undefined;
  const args = v[argsKey] ?? (argsKey === "parameters" ? v.arguments : undefined);
  let text: string;
  if (typeof args === "string") {
    // arguments given as JSON text
    if (!isObject(parseJson(args))) return undefined;
    text = args;
  } else if (isObject(args)) text = JSON.stringify(args);
  else return undefined;
  return {
    id: typeof id === "string" && id !== "" ? id : `call_${randomBytes(12).toString("hex")}`,
    type: "function",
    function: { name: v.name, arguments: text },
  };
}

/** Text around calls as content: trimmed, null when nothing is left. */
const contentOf = (parts: string[]): string | null => {
  const t = parts.join("").trim();
  return t === "" ? null : t;
};

/**
 * Reads a dialect's answer: the calls and the text around them. A call that does not parse (bad JSON, no
 * name, arguments not an object) makes the whole answer plain content, as the model wrote it.
 */
export function parseDialectAnswer(
  d: Exclude<ToolDialect, "generic">,
  text: string,
): { content: string | null; toolCalls: ToolCall[] } {
  const asContent = { content: text, toolCalls: [] };
  const calls: ToolCall[] = [];
  const rest: string[] = [];
  if (d === "hermes") {
    const open = "<tool_call>";
    const close = "</tool_call>";
    let at = 0;
    for (;;) {
      const i = text.indexOf(open, at);
      if (i < 0) break;
      const j = text.indexOf(close, i + open.length);
      if (j < 0) return asContent;
      const c = toCall(parseJson(text.slice(i + open.length, j).trim()), "arguments");
      if (!c) return asContent;
      calls.push(c);
      rest.push(text.slice(at, i));
      at = j + close.length;
    }
    rest.push(text.slice(at));
  } else if (d === "mistral-nemo") {
    const mark = "[TOOL_CALLS]";
    let at = 0;
    for (;;) {
      const i = text.indexOf(mark, at);
      if (i < 0) break;
      rest.push(text.slice(at, i));
      let k = i + mark.length;
      while (/\s/.test(text[k] ?? "")) k++;
      const end = text[k] === "[" ? jsonEnd(text, k) : -1;
      const list = end < 0 ? undefined : parseJson(text.slice(k, end));
      if (!Array.isArray(list) || list.length === 0) return asContent;
      for (const v of list) {
        const c = toCall(v, "arguments", isObject(v) ? v.id : undefined);
        if (!c) return asContent;
        calls.push(c);
      }
      at = end;
    }
    rest.push(text.slice(at));
  } else {
    // Llama 3.x: JSON call objects wherever they start (llama.cpp's pattern), <|python_tag|> dropped
    const body = text.replace(/^\s*<\|python_tag\|>/, "");
    const start = /\{\s*(?:"type"\s*:\s*"function"\s*,\s*)?"name"\s*:/g;
    let at = 0;
    for (let m = start.exec(body); m; m = start.exec(body)) {
      const end = jsonEnd(body, m.index);
      const c = end < 0 ? undefined : toCall(parseJson(body.slice(m.index, end)), "parameters");
      if (!c) return asContent;
      calls.push(c);
      rest.push(body.slice(at, m.index));
      at = end;
      start.lastIndex = end;
    }
    rest.push(body.slice(at));
    // calls separated by ";" (as Llama 3.x writes several)
    if (calls.length > 1) for (let i = 1; i < rest.length - 1; i++) rest[i] = rest[i]!.replace(/^\s*;\s*$/, "");
  }
  if (calls.length === 0) return asContent;
  return { content: contentOf(rest), toolCalls: calls };
}

/**
 * A request's tool calls for a template that takes tools (OpenAI's shape, arguments parsed to an object
 * when they are JSON text, as llama.cpp hands them to templates).
 */
export function templateToolCalls(
  toolCalls: { id?: string | null; function?: { name?: string; arguments?: string } }[],
): { id?: string; type: "function"; function: { name: string; arguments: unknown } }[] {
  return toolCalls.map((c) => {
    const raw = c.function?.arguments ?? "{}";
    const parsed = parseJson(raw);
    return {
      ...(c.id ? { id: c.id } : {}),
      type: "function",
      function: { name: c.function?.name ?? "", arguments: parsed === undefined ? raw : parsed },
    };
  });
}
