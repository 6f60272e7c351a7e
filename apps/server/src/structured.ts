/**
 * Structured output: `grammar` (GBNF), `json_schema`, `response_format`, and `tools` / `tool_choice` on
 * chat, turned into the grammar the slot's sampler is constrained by. Tool calls use the chat template's
 * own format where it has one (tool-dialects.ts), else llama.cpp's generic format (common/chat.cpp): the
 * model answers a JSON object, `{"tool_call": {"name", "arguments"}}` (`{"tool_calls": [...]}` with
 * `parallel_tool_calls`) or `{"response": "..."}`, which the server turns into OpenAI's `tool_calls` /
 * `content`.
 */
import { randomBytes } from "node:crypto";
import { Grammar, GrammarError, jsonSchemaToGbnf } from "@powerinfer/engine";
import { z } from "zod";
import { ApiError } from "./errors.js";
import { dialectGrammar, parseDialectAnswer, type ToolCall, type ToolDialect } from "./tool-dialects.js";

export type { ToolCall } from "./tool-dialects.js";

const jsonObject = z.record(z.string(), z.unknown(), { error: "a JSON object" });

/** Request fields of structured output shared by every generation endpoint (zod). */
export const structuredFields = {
  /** llama.cpp: a GBNF grammar. */
  grammar: z.string({ error: "a GBNF grammar (string)" }).nullish(),
  /** llama.cpp: a JSON schema the output must follow. */
  json_schema: z.union([jsonObject, z.boolean()], { error: "a JSON schema (object)" }).nullish(),
  /** OpenAI: {"type": "text" | "json_object" | "json_schema", …}. */
  response_format: z
    .object(
      {
        type: z.enum(["text", "json_object", "json_schema"], {
          error: 'one of "text", "json_object", "json_schema"',
        }),
        json_schema: z
          .object(
            { name: z.string().nullish(), schema: z.unknown().optional(), strict: z.boolean().nullish() },
            {
              error: 'an object {"name", "schema"}',
            },
          )
          .nullish(),
        schema: z.unknown().optional(),
      },
      { error: 'an object {"type": "text" | "json_object" | "json_schema"}' },
    )
    .nullish(),
};

const functionTool = z.object(
  {
    type: z.literal("function", { error: '"function"' }),
    function: z.object(
      {
        name: z.string({ error: "a string" }).regex(/^[a-zA-Z0-9_.-]{1,64}$/, {
          error: "a name of letters, digits, _ . - (at most 64)",
        }),
        description: z.string({ error: "a string" }).nullish(),
        parameters: z.union([jsonObject, z.boolean()]).nullish(),
        strict: z.boolean().nullish(),
      },
      { error: 'an object {"name", "description", "parameters"}' },
    ),
  },
  { error: 'a tool {"type": "function", "function": {...}}' },
);

/** Chat-only fields: tools. */
export const toolFields = {
  tools: z.array(functionTool, { error: "an array of tools" }).nullish(),
  tool_choice: z
    .union(
      [
        z.enum(["auto", "none", "required"]),
        z.object({ type: z.literal("function"), function: z.object({ name: z.string() }) }),
      ],
      { error: '"auto", "none", "required" or {"type": "function", "function": {"name": …}}' },
    )
    .nullish(),
  parallel_tool_calls: z.boolean({ error: "true or false" }).nullish(),
};

export interface StructuredBody {
  grammar?: string | null;
  json_schema?: Record<string, unknown> | boolean | null;
  response_format?: {
    type: "text" | "json_object" | "json_schema";
    json_schema?: { name?: string | null; schema?: unknown; strict?: boolean | null } | null;
    schema?: unknown;
  } | null;
}

export type ToolBody = {
  tools?: z.infer<typeof functionTool>[] | null;
  tool_choice?: "auto" | "none" | "required" | { type: "function"; function: { name: string } } | null;
  parallel_tool_calls?: boolean | null;
};

/** Compiled grammars by GBNF text (their transition caches stay warm across requests). */
const cache = new Map<string, Grammar>();
const CACHE_SIZE = 32;

/** Compiles GBNF from rule `root` (cached). @throws ApiError 400 naming the grammar error. */
export function compileGrammar(gbnf: string, field: string, root = "root"): Grammar {
  const key = root === "root" ? gbnf : `${root}\u0000${gbnf}`;
  let g = cache.get(key);
  // a grammar whose transition cache grew large (deeply nested outputs) starts afresh
  if (g && g.cachedStates > 100_000) {
    cache.delete(key);
    g = undefined;
  }
  if (g) {
    cache.delete(key);
    cache.set(key, g);
    return g;
  }
  try {
    g = Grammar.fromGbnf(gbnf, root);
  } catch (e) {
    throw invalid(e, field);
  }
  cache.set(key, g);
  if (cache.size > CACHE_SIZE) cache.delete(cache.keys().next().value!);
  return g;
}

function schemaGrammar(schema: unknown, field: string): string {
  try {
    return jsonSchemaToGbnf(schema);
  } catch (e) {
    throw invalid(e, field);
  }
}

/**
 * A grammar or schema the engine refuses, as a 400: its GrammarError (without the repeated "grammar: "
 * prefix), or a RangeError from nesting deeper than the parser's recursion allows.
 */
function invalid(e: unknown, field: string): unknown {
  if (e instanceof GrammarError) {
    // the engine's prefix ("grammar: ", "json_schema: ", "json_schema at /x: ") is not repeated after the
    // field's name
    const own = e.message.match(/^(grammar|json_schema)( at [^:]*)?: /);
    const rest = own ? e.message.slice(own[0].length) : e.message;
    const msg =
      own?.[1] === "grammar"
        ? `${field}: ${rest}`
        : own?.[1] === field
          ? `${field}${own[2] ?? ""}: ${rest}`
          : `${field}: ${e.message}`;
    return new ApiError(400, "invalid_request_error", msg, { param: field });
  }
  if (e instanceof RangeError)
    return new ApiError(400, "invalid_request_error", `${field}: nested too deeply (${e.message})`, { param: field });
  return e;
}

/**
 * The grammar a request's `grammar`, `json_schema` or `response_format` asks for (at most one of them).
 * @throws ApiError 400 for an invalid grammar or schema, or for more than one constraint.
 */
export function requestGrammar(b: StructuredBody): Grammar | undefined {
  const given: [string, string][] = [];
  // an empty grammar is none (llama.cpp's default "")
  if (typeof b.grammar === "string" && b.grammar.trim() !== "") given.push(["grammar", b.grammar]);
  if (b.json_schema !== undefined && b.json_schema !== null)
    given.push(["json_schema", schemaGrammar(b.json_schema, "json_schema")]);
  const rf = b.response_format;
  if (rf && rf.type !== "text") {
    const schema = rf.type === "json_schema" ? (rf.json_schema?.schema ?? rf.schema) : rf.schema;
    if (rf.type === "json_schema" && schema === undefined) {
      throw new ApiError(400, "invalid_request_error", 'response_format: type "json_schema" needs json_schema.schema', {
        param: "response_format.json_schema.schema",
      });
    }
    // json_object without a schema: any JSON object
    given.push(["response_format", schemaGrammar(schema ?? { type: "object" }, "response_format")]);
  }
  if (given.length > 1) {
    throw new ApiError(
      400,
      "invalid_request_error",
      `give only one of grammar, json_schema and response_format (got ${given.map((g) => g[0]).join(", ")})`,
    );
  }
  if (given.length === 0) return undefined;
  return compileGrammar(given[0]![1], given[0]![0]);
}

/** What the chat handler needs for tools: the prompt's system text, the grammar, and the output parser. */
export interface ToolPlan {
  /** The format the answer is constrained to and read in. */
  dialect: ToolDialect;
  /** Text added to the system message (the tools and the answer format); empty when the template renders the tools. */
  system: string;
  /** The tools for a template that takes a `tools` variable (OpenAI's shape). */
  tools: { type: "function"; function: { name: string; description?: string; parameters?: unknown } }[];
  grammar: Grammar;
  /** Parallel calls allowed (`tool_calls` list) or one (`tool_call`). */
  parallel: boolean;
}

/**
 * The tool plan of a chat request, or undefined when it has no tools or `tool_choice` is "none".
 * @param dialect the chat template's tool-call format; the generic format is used for every template
 *   without one, and with `response_format` (a structured response besides calls).
 * @param templateTakesTools the template renders a `tools` variable (else the tools go into the system
 *   message)
 * @throws ApiError 400 for a named tool that is not in `tools`, a bad parameters schema, or tools together
 *   with another constraint.
 */
export function toolPlan(
  b: ToolBody & StructuredBody,
  dialect: ToolDialect = "generic",
  templateTakesTools = false,
): ToolPlan | undefined {
  const tools = b.tools ?? [];
  const choice = b.tool_choice ?? "auto";
  if (tools.length === 0) {
    if (choice === "required" || typeof choice === "object")
      throw new ApiError(400, "invalid_request_error", "tool_choice needs tools", { param: "tool_choice" });
    return undefined;
  }
  if (choice === "none") return undefined;
  if (b.grammar || b.json_schema) {
    throw new ApiError(400, "invalid_request_error", "tools cannot be combined with grammar or json_schema", {
      param: "tools",
    });
  }
  let use = tools;
  if (typeof choice === "object") {
    use = tools.filter((t) => t.function.name === choice.function.name);
    if (use.length === 0) {
      throw new ApiError(
        400,
        "invalid_request_error",
        `tool_choice names "${choice.function.name}", which is not in tools`,
        {
          param: "tool_choice",
        },
      );
    }
  }
  const required = choice === "required" || typeof choice === "object";
  const parallel = b.parallel_tool_calls ?? false;
  const rf = b.response_format;
  const templateTools = use.map((t) => ({
    type: "function" as const,
    function: {
      name: t.function.name,
      ...(t.function.description ? { description: t.function.description } : {}),
      parameters: t.function.parameters ?? { type: "object", properties: {} },
    },
  }));
  if (dialect !== "generic" && !(rf && rf.type !== "text")) {
    const { gbnf, root } = dialectGrammar(
      dialect,
      use.map((t) => t.function),
      { required, parallel },
    );
    const grammar = compileGrammar(gbnf, "tools", root);
    const system = templateTakesTools
      ? ""
      : `You can call these tools:\n${JSON.stringify(templateTools, null, 2)}\n\n${DIALECT_HINT[dialect]}`;
    return { dialect, system, tools: templateTools, grammar, parallel };
  }
  const call = (t: (typeof tools)[number]) => ({
    type: "object",
    properties: {
      name: { const: t.function.name },
      arguments: t.function.parameters ?? { type: "object" },
    },
    required: ["name", "arguments"],
  });
  const calls = use.length === 1 ? call(use[0]!) : { anyOf: use.map(call) };
  const callSchema = parallel
    ? {
        type: "object",
        properties: { tool_calls: { type: "array", items: calls, minItems: 1 } },
        required: ["tool_calls"],
      }
    : { type: "object", properties: { tool_call: calls }, required: ["tool_call"] };
  const responseSchema =
    rf && rf.type !== "text"
      ? ((rf.type === "json_schema" ? (rf.json_schema?.schema ?? rf.schema) : rf.schema) ?? { type: "object" })
      : { type: "string" };
  const schema = required
    ? callSchema
    : { anyOf: [callSchema, { type: "object", properties: { response: responseSchema }, required: ["response"] }] };
  const grammar = compileGrammar(schemaGrammar(schema, "tools"), "tools");
  const list = JSON.stringify(
    use.map((t) => ({
      name: t.function.name,
      description: t.function.description ?? "",
      parameters: t.function.parameters ?? {},
    })),
    null,
    2,
  );
  const format = parallel
    ? '{"tool_calls": [{"name": …, "arguments": {…}}]}'
    : '{"tool_call": {"name": …, "arguments": {…}}}';
  const system =
    `You can call these tools:\n${list}\n\n` +
    (required
      ? `Respond in JSON format with a tool call: ${format}.`
      : `Respond in JSON format, either with a tool call: ${format}, or with a response to the user's request: {"response": …}.`);
  return { dialect: "generic", system, tools: templateTools, grammar, parallel };
}

/** How to call, for a template of a dialect that does not render the tools itself. */
const DIALECT_HINT: Record<Exclude<ToolDialect, "generic">, string> = {
  hermes: 'To call a tool, answer <tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>.',
  llama3: 'To call a tool, answer {"name": …, "parameters": {…}}.',
  "mistral-nemo": 'To call tools, answer [TOOL_CALLS][{"name": …, "arguments": {…}, "id": "<9 letters or digits>"}].',
};

/**
 * Reads the model's answer in the generic format.
 * @returns the tool calls, or the response text; undefined when the text is not a complete answer (cut by
 *   max_tokens): the caller returns it as plain content.
 */
export function parseToolAnswer(text: string): { toolCalls: ToolCall[] } | { content: unknown } | undefined {
  let v: unknown;
  try {
    v = JSON.parse(text);
  } catch {
    return undefined;
  }
  if (typeof v !== "object" || v === null) return undefined;
  const o = v as Record<string, unknown>;
  const toCall = (c: unknown): ToolCall => {
    const x = c as { name: string; arguments: unknown };
    return {
      id: `call_${randomBytes(12).toString("hex")}`,
      type: "function",
      function: { name: x.name, arguments: JSON.stringify(x.arguments) },
    };
  };
  if (o.tool_call) return { toolCalls: [toCall(o.tool_call)] };
  if (Array.isArray(o.tool_calls)) return { toolCalls: o.tool_calls.map(toCall) };
  if ("response" in o) return { content: typeof o.response === "string" ? o.response : JSON.stringify(o.response) };
  return undefined;
}

/**
 * A chat message's text in the generic format when it carries tool calls (an assistant turn that called
 * tools): the JSON object the model would have answered.
 */
export function assistantToolText(
  toolCalls: { function?: { name?: string; arguments?: string } }[],
  content: string,
): string {
  const calls = toolCalls.map((c) => {
    let args: unknown = c.function?.arguments ?? {};
    if (typeof args === "string") {
      try {
        args = JSON.parse(args);
      } catch {
        // keep the string as sent
      }
    }
    return { name: c.function?.name ?? "", arguments: args };
  });
  const obj = calls.length === 1 ? { tool_call: calls[0] } : { tool_calls: calls };
  return content ? `${content}\n${JSON.stringify(obj)}` : JSON.stringify(obj);
}

/** Puts the tool instructions into the conversation: appended to the first system message, or as one. */
export function addToolSystem(messages: { role: string; content: string }[], system: string): void {
  const first = messages[0];
  if (first && (first.role === "system" || first.role === "developer")) first.content = `${first.content}\n\n${system}`;
  else messages.unshift({ role: "system", content: system });
}

/**
 * A chat answer under a tool plan in OpenAI's shape: `tool_calls` (content null, finish_reason
 * "tool_calls"), or the response as content; an incomplete answer (cut by max_tokens) as raw content.
 */
export function toolAnswer(
  text: string,
  finish: string | null,
  dialect: ToolDialect = "generic",
): { message: { content: string | null; tool_calls?: ToolCall[] }; finish_reason: string | null } {
  if (dialect !== "generic") {
    const d = finish === "stop" ? parseDialectAnswer(dialect, text) : undefined;
    if (d && d.toolCalls.length > 0)
      return { message: { content: d.content, tool_calls: d.toolCalls }, finish_reason: "tool_calls" };
    return { message: { content: text }, finish_reason: finish };
  }
  const a = finish === "stop" ? parseToolAnswer(text) : undefined;
  if (a && "toolCalls" in a)
    return { message: { content: null, tool_calls: a.toolCalls }, finish_reason: "tool_calls" };
  if (a) return { message: { content: a.content as string }, finish_reason: finish };
  return { message: { content: text }, finish_reason: finish };
}

/** {@link toolAnswer} as a stream delta (tool calls carry their `index`). */
export function toolDelta(text: string, finish: string | null, dialect: ToolDialect = "generic") {
  const a = toolAnswer(text, finish, dialect);
  const delta = a.message.tool_calls
    ? {
        ...(a.message.content !== null ? { content: a.message.content } : {}),
        tool_calls: a.message.tool_calls.map((c, index) => ({ index, ...c })),
      }
    : { content: a.message.content };
  return { delta, finish_reason: a.finish_reason };
}
