/**
 * Tool calls in the chat template's own format (Hermes 2 Pro / Qwen, Llama 3.x, Mistral Nemo) and the
 * generic fallback: detection from the template text, the parser on hand-written model outputs, the
 * grammar on them, and requests through the HTTP API on stories260K with the template overridden (the
 * model knows nothing of tools, so every well-formed call is the grammar's doing).
 */
import { join } from "node:path";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import type { Backend } from "@powerinfer/core";
import { Grammar, Model } from "@powerinfer/engine";
import { Ajv } from "ajv";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { createServer, type PowerinferServer } from "../src/index.js";
import { expectStreamedWeatherCall, weather } from "./tools-fixture.js";
import { detectToolDialect, dialectGrammar, parseDialectAnswer, type ToolDialect } from "../src/tool-dialects.js";

const models = process.env.POWERINFER_TEST_MODELS!;
const probe = await cpuBackend.probe();

/** Qwen 2.5-style (Hermes 2 Pro format): tools in the system turn inside <tools>, calls in <tool_call>. */
const HERMES_TEMPLATE = `{%- if tools %}
{{- "<|im_start|>system\\n" }}
{%- if messages[0].role == "system" %}{{- messages[0].content }}{%- else %}{{- "You are a helpful assistant." }}{%- endif %}
{{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- elif messages[0].role == "system" %}
{{- "<|im_start|>system\\n" + messages[0].content + "<|im_end|>\\n" }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == "user" or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
{{- "<|im_start|>" + message.role + "\\n" + message.content + "<|im_end|>\\n" }}
{%- elif message.role == "assistant" %}
{{- "<|im_start|>assistant" }}
{%- if message.content %}{{- "\\n" + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{{- "\\n<tool_call>\\n{\\"name\\": \\"" + tool_call.function.name + "\\", \\"arguments\\": " }}{{- tool_call.function.arguments | tojson }}{{- "}\\n</tool_call>" }}
{%- endfor %}
{{- "<|im_end|>\\n" }}
{%- elif message.role == "tool" %}
{{- "<|im_start|>user\\n<tool_response>\\n" + message.content + "\\n</tool_response><|im_end|>\\n" }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|im_start|>assistant\\n" }}{%- endif %}`;

/** Llama 3.1-style: an ipython role, tools as indented JSON in the first user turn. */
const LLAMA3_TEMPLATE = `{{- bos_token }}
{%- if messages[0].role == 'system' %}{%- set system_message = messages[0].content %}{%- set messages = messages[1:] %}{%- else %}{%- set system_message = "" %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- system_message }}{{- "<|eot_id|>" }}
{%- for message in messages %}
{%- if message.role == 'user' and tools and loop.first %}
{{- "<|start_header_id|>user<|end_header_id|>\\n\\n" }}
{{- "Given the following functions, please respond with a JSON for a function call with its proper arguments that best answers the given prompt.\\n\\n" }}
{{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.\\n\\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) }}{{- "\\n\\n" }}{%- endfor %}
{{- message.content }}{{- "<|eot_id|>" }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- "<|start_header_id|>assistant<|end_header_id|>\\n\\n" }}
{%- set tool_call = message.tool_calls[0].function %}
{{- '{"name": "' + tool_call.name + '", "parameters": ' }}{{- tool_call.arguments | tojson }}{{- "}<|eot_id|>" }}
{%- elif message.role == 'tool' or message.role == 'ipython' %}
{{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}{{- message.content }}{{- "<|eot_id|>" }}
{%- else %}
{{- "<|start_header_id|>" + message.role + "<|end_header_id|>\\n\\n" + message.content + "<|eot_id|>" }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- "<|start_header_id|>assistant<|end_header_id|>\\n\\n" }}{%- endif %}`;

/** Mistral Nemo-style: [AVAILABLE_TOOLS] before the last user turn, calls with 9-character ids. */
const MISTRAL_TEMPLATE = `{{- bos_token }}
{%- for message in messages %}
{%- if message.role == 'user' %}
{%- if tools and loop.last %}{{- "[AVAILABLE_TOOLS]" + (tools | tojson) + "[/AVAILABLE_TOOLS]" }}{%- endif %}
{{- "[INST]" + message.content + "[/INST]" }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- "[TOOL_CALLS][" }}
{%- for tool_call in message.tool_calls %}
{%- if not tool_call.id or tool_call.id | length != 9 %}{{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}{%- endif %}
{{- '{"name": "' + tool_call.function.name + '", "arguments": ' + (tool_call.function.arguments | tojson) + ', "id": "' + tool_call.id + '"}' }}
{%- if not loop.last %}{{- ", " }}{%- endif %}
{%- endfor %}
{{- "]" + eos_token }}
{%- elif message.role == 'assistant' %}{{- message.content + eos_token }}
{%- elif message.role == 'tool' %}
{{- '[TOOL_RESULTS]{"content": ' + (message.content | tojson) + ', "call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
{%- endif %}
{%- endfor %}`;

const time = {
  type: "function",
  function: {
    name: "get_time",
    parameters: { type: "object", properties: { zone: { type: "string", maxLength: 8 } }, required: ["zone"] },
  },
};

describe("tool dialects: detection, parser and grammar", () => {
  it("detects the dialect from the template text, generic otherwise", () => {
    expect(detectToolDialect(HERMES_TEMPLATE)).toBe("hermes");
    expect(detectToolDialect(LLAMA3_TEMPLATE)).toBe("llama3");
    expect(detectToolDialect(MISTRAL_TEMPLATE)).toBe("mistral-nemo");
    expect(detectToolDialect("{% for m in messages %}{{ m.content }}{% endfor %}")).toBe("generic");
    // Qwen3-Coder's XML calls are not the Hermes format (not implemented: generic)
    expect(detectToolDialect("{{ '<tool_call>\\n<function=' + name + '>\\n<parameter=' + k + '>' }}")).toBe("generic");
  });

  it("hermes: several calls, text around them, malformed → content", () => {
    const two =
      'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>\n' +
      '<tool_call>{"name":"get_time","arguments":{"zone":"CET"}}</tool_call>';
    const a = parseDialectAnswer("hermes", two);
    expect(a.content).toBe("Let me check.");
    expect(a.toolCalls.map((c) => [c.type, c.function.name, JSON.parse(c.function.arguments)])).toEqual([
      ["function", "get_weather", { city: "Paris", unit: "c" }],
      ["function", "get_time", { zone: "CET" }],
    ]);
    expect(a.toolCalls[0]!.id).toMatch(/^call_[0-9a-f]{24}$/);
    expect(a.toolCalls[0]!.id).not.toBe(a.toolCalls[1]!.id);
    const only = parseDialectAnswer("hermes", '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>');
    expect(only.content).toBeNull();
    expect(only.toolCalls[0]!.function).toEqual({ name: "f", arguments: "{}" });
    for (const bad of [
      '<tool_call>\n{"name": "f", "arguments": {\n</tool_call>',
      '<tool_call>{"arguments": {}}</tool_call>',
      '<tool_call>{"name": "f", "arguments": {}}',
      '<tool_call>{"name": "f", "arguments": 3}</tool_call>',
    ])
      expect(parseDialectAnswer("hermes", bad)).toEqual({ content: bad, toolCalls: [] });
    expect(parseDialectAnswer("hermes", "Just text.")).toEqual({ content: "Just text.", toolCalls: [] });
  });

  it("llama3: a call object (type, <|python_tag|>), several separated by ';', malformed → content", () => {
    const a = parseDialectAnswer("llama3", '{"name": "get_time", "parameters": {"zone": "UTC"}}');
    expect(a.content).toBeNull();
    expect(a.toolCalls.map((c) => [c.function.name, c.function.arguments])).toEqual([["get_time", '{"zone":"UTC"}']]);
    const b = parseDialectAnswer(
      "llama3",
      '<|python_tag|>{"type": "function", "name": "get_weather", "parameters": {"city": "Rome", "unit": "f"}}; {"name": "get_time", "parameters": {"zone": "a}b"}}',
    );
    expect(b.content).toBeNull();
    expect(b.toolCalls.map((c) => [c.function.name, JSON.parse(c.function.arguments)])).toEqual([
      ["get_weather", { city: "Rome", unit: "f" }],
      ["get_time", { zone: "a}b" }],
    ]);
    const c = parseDialectAnswer("llama3", 'Sure: {"name": "f", "parameters": {"x": 1}} done');
    expect(c.content).toBe("Sure:  done");
    expect(c.toolCalls[0]!.function).toEqual({ name: "f", arguments: '{"x":1}' });
    for (const bad of [
      '{"name": "f", "parameters": {"x": 1}',
      '{"name": "f", "parameters": [1]}',
      "The sky {is} blue.",
    ])
      expect(parseDialectAnswer("llama3", bad)).toEqual({ content: bad, toolCalls: [] });
  });

  it("mistral-nemo: a list of calls with their ids, text before, malformed → content", () => {
    const a = parseDialectAnswer(
      "mistral-nemo",
      'On it. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}, "id": "abcDEF123"}, {"name": "get_time", "arguments": {"zone": "[x]"}, "id": "zz9zz9zz9"}]',
    );
    expect(a.content).toBe("On it.");
    expect(a.toolCalls.map((c) => [c.id, c.function.name, JSON.parse(c.function.arguments)])).toEqual([
      ["abcDEF123", "get_weather", { city: "Oslo", unit: "c" }],
      ["zz9zz9zz9", "get_time", { zone: "[x]" }],
    ]);
    const noId = parseDialectAnswer("mistral-nemo", '[TOOL_CALLS] [{"name": "f", "arguments": {}}]');
    expect(noId.content).toBeNull();
    expect(noId.toolCalls[0]!.id).toMatch(/^call_/);
    for (const bad of [
      '[TOOL_CALLS][{"name": "f", "arguments": {}',
      "[TOOL_CALLS][]",
      '[TOOL_CALLS]{"name": "f", "arguments": {}}',
      '[TOOL_CALLS][{"name": 1, "arguments": {}}]',
    ])
      expect(parseDialectAnswer("mistral-nemo", bad)).toEqual({ content: bad, toolCalls: [] });
  });

  it("the grammar accepts the dialect's calls (and text with auto), and nothing else", () => {
    const fns = [weather.function, time.function];
    const g = (d: Exclude<ToolDialect, "generic">, required: boolean, parallel = false) => {
      const { gbnf, root } = dialectGrammar(d, fns, { required, parallel });
      return Grammar.fromGbnf(gbnf, root);
    };
    const hermesCall =
      '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>';
    expect(g("hermes", true).match(hermesCall)).toBe("sentence");
    expect(g("hermes", true).match(`${hermesCall}\n${hermesCall}`)).toBe("no");
    expect(g("hermes", true, true).match(`${hermesCall}\n${hermesCall}`)).toBe("sentence");
    expect(g("hermes", true).match('<tool_call>{"name": "nope", ')).toBe("no");
    expect(g("hermes", true).match('<tool_call>{"name": "get_time", "arguments": {"zone": "123456789"}}')).toBe("no");
    expect(g("hermes", true).match("Hello")).toBe("no");
    expect(g("hermes", false).match("Hello <tool and <tool_cal, no call")).toBe("sentence");
    expect(g("hermes", false).match(`Hello\n${hermesCall}`)).toBe("sentence");
    expect(g("hermes", false).match("Hello <tool_call>oops")).toBe("no");

    const llamaCall = '{"name": "get_time", "parameters": {"zone": "UTC"}}';
    expect(g("llama3", true).match(llamaCall)).toBe("sentence");
    expect(g("llama3", true).match('{"name": "get_time", "arguments": ')).toBe("no");
    expect(g("llama3", false).match(llamaCall)).toBe("sentence");
    expect(g("llama3", false).match("It is sunny {really}.")).toBe("sentence");
    expect(g("llama3", false).match('{"nam')).toBe("prefix");
    expect(g("llama3", false).match("{oops")).toBe("no");

    const mistralCall = '[TOOL_CALLS][{"name": "get_time", "arguments": {"zone": "UTC"}, "id": "a1b2c3d4e"}]';
    expect(g("mistral-nemo", true).match(mistralCall)).toBe("sentence");
    expect(g("mistral-nemo", true).match(mistralCall.replace("a1b2c3d4e", "a1b2c3d4"))).toBe("no");
    expect(g("mistral-nemo", true).match(mistralCall.replace("a1b2c3d4e", "a1b2c3d4_"))).toBe("no");
    const twoCalls = mistralCall.replace("}]", `}, ${mistralCall.slice("[TOOL_CALLS][".length)}`);
    expect(g("mistral-nemo", true).match(twoCalls)).toBe("no");
    expect(g("mistral-nemo", true, true).match(twoCalls)).toBe("sentence");
    expect(g("mistral-nemo", false).match(`Sure [TOOL_CALLS.${mistralCall}`)).toBe("sentence");
    expect(g("mistral-nemo", false).match("[TOOL_CALLS] hi")).toBe("no");
  });
});

// biome-ignore lint/suspicious/noExplicitAny: response bodies are checked field by field
async function post(url: string, path: string, body: unknown): Promise<{ status: number; json: any }> {
  const res = await fetch(`${url}${path}`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify(body),
  });
  return { status: res.status, json: await res.json() };
}

/** What each dialect's template renders of the weather tool, and the id a call gets. */
const CASES: { dialect: string; template: string; rendered: string[]; id: RegExp }[] = [
  {
    dialect: "hermes",
    template: HERMES_TEMPLATE,
    rendered: [
      '<tools>\n{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"]}}}\n',
      '{"name": <function-name>, "arguments": <args-json-object>}',
    ],
    id: /^call_/,
  },
  {
    dialect: "llama3",
    template: LLAMA3_TEMPLATE,
    rendered: [
      "Environment: ipython\n",
      '{\n    "type": "function",\n    "function": {\n        "name": "get_weather",\n        "description": "The weather in a city",',
    ],
    id: /^call_/,
  },
  {
    dialect: "mistral-nemo",
    template: MISTRAL_TEMPLATE,
    rendered: [
      '[AVAILABLE_TOOLS][{"type": "function", "function": {"name": "get_weather", "description": "The weather',
    ],
    id: /^[a-zA-Z0-9]{9}$/,
  },
];

describe.skipIf(!probe.usable)(`tool dialects over HTTP on stories260K (${probe.reason})`, () => {
  let backend: Backend;
  let model: Model;
  const servers: Record<string, { server: PowerinferServer; url: string }> = {};

  beforeAll(async () => {
    backend = await cpuBackend.load({ threads: 1 });
    model = await Model.load(join(models, "stories260K-ggml-org.gguf"), { backend });
    for (const c of CASES) {
      const server = createServer({ model, slots: 2, ctxSize: 2 * 2048, chatTemplate: c.template });
      servers[c.dialect] = { server, url: await server.listen({ host: "127.0.0.1", port: 0 }) };
    }
  });
  afterAll(async () => {
    for (const s of Object.values(servers)) await s.server.close();
    model?.dispose();
    backend?.dispose();
  });

  it("a template that does not parse is refused when the server is created", () => {
    expect(() => createServer({ model, chatTemplate: "{% for m in messages %}" })).toThrow(/chat template/);
    expect(() => createServer({ model, chatTemplate: " " })).toThrow(/chatTemplate is empty/);
  });

  it.each(CASES)("$dialect: the template renders the tools; required / named → valid tool_calls", async (c) => {
    const { url } = servers[c.dialect]!;
    const ajv = new Ajv({ strict: false });
    const messages = [{ role: "user", content: "What is the weather in Paris?" }];
    const shown = await post(url, "/apply-template", { messages, tools: [weather, time], tool_choice: "required" });
    expect(shown.status, JSON.stringify(shown.json)).toBe(200);
    for (const r of c.rendered) expect(shown.json.prompt).toContain(r);
    expect(shown.json.prompt).toContain('"name": "get_time"');
    // the generic format's instructions are not added
    expect(shown.json.prompt).not.toContain("Respond in JSON format");

    for (const [choice, names] of [
      ["required", ["get_weather", "get_time"]],
      [{ type: "function", function: { name: "get_weather" } }, ["get_weather"]],
    ] as const) {
      for (const seed of [1, 2, 3]) {
        const r = await post(url, "/v1/chat/completions", {
          messages,
          tools: [weather, time],
          tool_choice: choice,
          max_tokens: 256,
          seed,
          verbose: true,
        });
        expect(r.status, JSON.stringify(r.json)).toBe(200);
        const ch = r.json.choices[0];
        const raw = r.json.__verbose.content as string;
        // the prompt generated from is the template's, with the tools in it
        expect(r.json.__verbose.prompt).toContain('"name": "get_weather"');
        expect({ seed, raw, finish: ch.finish_reason }).toEqual({ seed, raw, finish: "tool_calls" });
        expect(ch.message.content).toBeNull();
        expect(ch.message.tool_calls).toHaveLength(1);
        const call = ch.message.tool_calls[0];
        expect(call.type).toBe("function");
        expect(call.id).toMatch(c.id);
        expect(names).toContain(call.function.name);
        const params = (call.function.name === "get_weather" ? weather : time).function.parameters;
        expect(ajv.validate(params, JSON.parse(call.function.arguments)), raw).toBe(true);
        // the raw output is the dialect's syntax
        if (c.dialect === "hermes") expect(raw).toMatch(/^<tool_call>\n?\{[\s\S]*\}\n?<\/tool_call>$/);
        if (c.dialect === "llama3") expect(raw).toMatch(/^\{\s*"name"/);
        if (c.dialect === "mistral-nemo") expect(raw.startsWith("[TOOL_CALLS][")).toBe(true);
        if (c.dialect === "mistral-nemo") expect(JSON.parse(raw.slice("[TOOL_CALLS]".length))[0].id).toBe(call.id);
      }
    }
  });

  it.each(CASES)("$dialect: auto answers text or a call; history with calls renders in the template", async (c) => {
    const { url } = servers[c.dialect]!;
    for (const seed of [1, 2]) {
      const r = await post(url, "/v1/chat/completions", {
        messages: [{ role: "user", content: "Hello" }],
        tools: [weather],
        max_tokens: 48,
        seed,
      });
      expect(r.status).toBe(200);
      const ch = r.json.choices[0];
      if (ch.finish_reason === "tool_calls") expect(ch.message.tool_calls[0].function.name).toBe("get_weather");
      else {
        expect(typeof ch.message.content).toBe("string");
        expect(ch.message.tool_calls).toBeUndefined();
        // plain text under the auto grammar never holds a call marker
        if (c.dialect === "hermes") expect(ch.message.content).not.toContain("<tool_call>");
        if (c.dialect === "mistral-nemo") expect(ch.message.content).not.toContain("[TOOL_CALLS]");
        if (c.dialect === "llama3") expect(ch.message.content.startsWith("{")).toBe(false);
      }
    }
    const history = {
      messages: [
        { role: "user", content: "Weather in Paris?" },
        {
          role: "assistant",
          content: null,
          tool_calls: [
            {
              id: "abcDEF123",
              type: "function",
              function: { name: "get_weather", arguments: '{"city":"Paris","unit":"c"}' },
            },
          ],
        },
        { role: "tool", tool_call_id: "abcDEF123", content: "18 degrees" },
      ],
      tools: [weather],
    };
    const shown = await post(url, "/apply-template", history);
    expect(shown.status, JSON.stringify(shown.json)).toBe(200);
    const p = shown.json.prompt as string;
    expect(p).toContain("18 degrees");
    if (c.dialect === "hermes")
      expect(p).toContain(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
      );
    if (c.dialect === "llama3")
      expect(p).toContain('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}');
    if (c.dialect === "mistral-nemo") {
      expect(p).toContain(
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}, "id": "abcDEF123"}]',
      );
      expect(p).toContain('[TOOL_RESULTS]{"content": "18 degrees", "call_id": "abcDEF123"}');
    }
    const r = await post(url, "/v1/chat/completions", { ...history, max_tokens: 16, seed: 1 });
    expect(r.status).toBe(200);
  });

  it("mistral-nemo: the template's own check of the call id is a 400", async () => {
    const r = await post(servers["mistral-nemo"]!.url, "/v1/chat/completions", {
      messages: [
        { role: "user", content: "a" },
        {
          role: "assistant",
          tool_calls: [{ id: "short", type: "function", function: { name: "get_weather", arguments: "{}" } }],
        },
        { role: "tool", tool_call_id: "short", content: "x" },
      ],
      tools: [weather],
    });
    expect(r.status).toBe(400);
    expect(r.json.error.message).toMatch(/Tool call IDs should be alphanumeric strings with length 9/);
  });

  it("a template without a tool-call format of its own gets the generic format", async () => {
    const plain = "{% for m in messages %}{{ m.role + ': ' + m.content + '\\n' }}{% endfor %}assistant: ";
    expect(detectToolDialect(plain)).toBe("generic");
    const server = createServer({ model, chatTemplate: plain });
    const url = await server.listen({ host: "127.0.0.1", port: 0 });
    try {
      const body = { messages: [{ role: "user", content: "Time?" }], tools: [time], tool_choice: "required" };
      const shown = await post(url, "/apply-template", body);
      expect(shown.json.prompt).toMatch(/^system: You can call these tools:\n[\s\S]*"name": "get_time"/);
      expect(shown.json.prompt).toContain('Respond in JSON format with a tool call: {"tool_call"');
      const r = await post(url, "/v1/chat/completions", { ...body, max_tokens: 128, seed: 4, verbose: true });
      expect(r.status).toBe(200);
      expect(JSON.parse(r.json.__verbose.content).tool_call.name).toBe("get_time");
      expect(r.json.choices[0].finish_reason).toBe("tool_calls");
      expect(r.json.choices[0].message.tool_calls[0].function.name).toBe("get_time");
    } finally {
      await server.close();
    }
  });

  it("streaming sends the parsed calls with the finish chunk", async () => {
    await expectStreamedWeatherCall(servers.hermes!.url);
  });
});
