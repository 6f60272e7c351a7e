/**
 * Structured output through the HTTP API on stories260K (a 260K-parameter story model that knows nothing
 * of JSON, so everything it writes in JSON is the grammar's doing): JSON-schema chat requests validated
 * with a JSON Schema validator (ajv), random GBNF grammars checked by an independent backtracking matcher,
 * tools in OpenAI's shape, and the 400s for invalid constraints.
 */
import { join } from "node:path";
import { cpuBackend } from "@powerinfer/backend-cpu-avx2";
import type { Backend } from "@powerinfer/core";
import { Model } from "@powerinfer/engine";
import { Ajv } from "ajv";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { checkMembership, randomGrammar } from "../../../packages/engine/test/grammar-fuzz.js";
import { createServer, type PowerinferServer } from "../src/index.js";
import { expectStreamedWeatherCall, weather } from "./tools-fixture.js";

const models = process.env.POWERINFER_TEST_MODELS!;
const probe = await cpuBackend.probe();

const str = (maxLength: number, minLength = 0) => ({ type: "string", minLength, maxLength });

/** 20 schemas: objects, arrays, enums, nesting; strings ≤ 16 characters, arrays ≤ 4 items. */
const SCHEMAS: Record<string, unknown>[] = [
  { type: "object", properties: { name: str(12) }, required: ["name"] },
  {
    type: "object",
    properties: { age: { type: "integer", minimum: 0, maximum: 120 }, ok: { type: "boolean" } },
    required: ["age", "ok"],
  },
  { type: "object", properties: { color: { enum: ["red", "green", "blue"] } }, required: ["color"] },
  { type: "array", items: { type: "integer" }, minItems: 1, maxItems: 4 },
  { type: "array", items: str(8), maxItems: 3 },
  {
    type: "object",
    properties: { title: str(16), tags: { type: "array", items: str(6), maxItems: 4 } },
    required: ["title", "tags"],
  },
  {
    type: "object",
    properties: {
      point: { type: "object", properties: { x: { type: "number" }, y: { type: "number" } }, required: ["x", "y"] },
    },
    required: ["point"],
  },
  { type: "object", properties: { a: str(5), b: str(5), c: str(5) }, required: ["b"] },
  { enum: ["yes", "no", 1, null] },
  { type: "object", properties: { kind: { const: "cat" }, lives: { type: "integer" } }, required: ["kind", "lives"] },
  { type: "object", properties: { v: { type: ["string", "null"], maxLength: 10 } }, required: ["v"] },
  { anyOf: [{ type: "integer" }, { type: "object", properties: { n: str(4) }, required: ["n"] }] },
  {
    type: "object",
    properties: {
      people: {
        type: "array",
        maxItems: 2,
        items: {
          type: "object",
          properties: { name: str(8), pet: { enum: ["dog", "cat"] } },
          required: ["name", "pet"],
        },
      },
    },
    required: ["people"],
  },
  { type: "object", properties: { flag: { type: "boolean" }, note: str(16) }, required: ["flag"] },
  { type: "array", prefixItems: [str(6), { type: "integer" }, { type: "boolean" }] },
  {
    $defs: { leaf: { type: "object", properties: { id: { type: "integer" } }, required: ["id"] } },
    type: "object",
    properties: { left: { $ref: "#/$defs/leaf" }, right: { $ref: "#/$defs/leaf" } },
    required: ["left", "right"],
  },
  { type: "object", properties: { word: str(16, 3) }, required: ["word"] },
  { type: "array", items: { enum: ["a", "b", "c"] }, minItems: 2, maxItems: 4 },
  {
    type: "object",
    properties: {
      meta: {
        type: "object",
        properties: { lang: { enum: ["en", "fr"] }, n: { type: "integer" } },
        required: ["lang"],
      },
    },
    required: ["meta"],
    additionalProperties: false,
  },
  {
    type: "object",
    properties: { x: { type: "null" }, y: { type: "number" }, z: str(3) },
    required: ["x", "y", "z"],
    additionalProperties: { type: "integer", minimum: -9, maximum: 9 },
  },
];

// biome-ignore lint/suspicious/noExplicitAny: response bodies are checked field by field
async function post(url: string, path: string, body: unknown): Promise<{ status: number; json: any }> {
  const res = await fetch(`${url}${path}`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify(body),
  });
  return { status: res.status, json: await res.json() };
}

describe.skipIf(!probe.usable)(`structured output (${probe.reason})`, () => {
  let backend: Backend;
  let model: Model;
  let server: PowerinferServer;
  let url: string;

  beforeAll(async () => {
    backend = await cpuBackend.load({ threads: 1 });
    model = await Model.load(join(models, "stories260K-ggml-org.gguf"), { backend });
    server = createServer({ model, slots: 4, ctxSize: 4 * 2048 });
    url = await server.listen({ host: "127.0.0.1", port: 0 });
  });
  afterAll(async () => {
    await server?.close();
    model?.dispose();
    backend?.dispose();
  });

  it("a JSON-schema chat request returns JSON that validates against the schema (20 schemas, ajv)", async () => {
    expect(SCHEMAS).toHaveLength(20);
    const ajv = new Ajv({ strict: false });
    const results = await Promise.all(
      SCHEMAS.map((schema, i) =>
        post(url, "/v1/chat/completions", {
          messages: [{ role: "user", content: "Tell me about the little dog." }],
          max_tokens: 256,
          seed: i,
          // three spellings of the same constraint
          ...(i % 3 === 0
            ? { response_format: { type: "json_schema", json_schema: { name: `s${i}`, schema } } }
            : i % 3 === 1
              ? { response_format: { type: "json_object", schema } }
              : { json_schema: schema }),
        }),
      ),
    );
    results.forEach(({ status, json }, i) => {
      expect(status, JSON.stringify(json)).toBe(200);
      const choice = json.choices[0];
      const text = choice.message.content as string;
      expect({ i, text, finish: choice.finish_reason }).toEqual({ i, text, finish: "stop" });
      const value = JSON.parse(text);
      const valid = ajv.validate(SCHEMAS[i]!, value);
      expect({ i, text, errors: ajv.errors ?? null }).toEqual({ i, text, errors: null });
      expect(valid).toBe(true);
    });
  });

  it('response_format {"type": "json_object"} gives a JSON object; /completion and /v1/completions take json_schema and grammar', async () => {
    const a = await post(url, "/v1/chat/completions", {
      messages: [{ role: "user", content: "Hi" }],
      max_tokens: 200,
      seed: 3,
      response_format: { type: "json_object" },
    });
    expect(a.status).toBe(200);
    const text = a.json.choices[0].message.content as string;
    if (a.json.choices[0].finish_reason === "stop") expect(typeof JSON.parse(text)).toBe("object");
    expect(text.startsWith("{")).toBe(true);

    const b = await post(url, "/completion", {
      prompt: "Once upon a time",
      n_predict: 64,
      seed: 1,
      json_schema: { type: "object", properties: { n: { type: "integer" } }, required: ["n"] },
    });
    expect(b.status).toBe(200);
    expect(b.json.stop_type).toBe("eos");
    expect(Object.keys(JSON.parse(b.json.content))).toEqual(["n"]);

    const c = await post(url, "/v1/completions", {
      prompt: "Once upon a time",
      max_tokens: 32,
      seed: 2,
      grammar: 'root ::= ("yes" | "no") "!"',
    });
    expect(c.status).toBe(200);
    expect(c.json.choices[0].text).toMatch(/^(yes|no)!$/);
    expect(c.json.choices[0].finish_reason).toBe("stop");

    // an empty grammar is no grammar (llama.cpp's default), as is response_format text
    const free = { prompt: "Once upon a time", max_tokens: 8, temperature: 0 };
    const plain = await post(url, "/v1/completions", free);
    const empty = await post(url, "/v1/completions", { ...free, grammar: "", response_format: { type: "text" } });
    expect(empty.status).toBe(200);
    expect(empty.json.choices[0].text).toBe(plain.json.choices[0].text);
  });

  it("a GBNF grammar's output is a sentence of its language, or with finish_reason length a prefix of one (50 grammars × 2 seeds)", async () => {
    // 50 grammars, each with two seeds
    const cases = Array.from({ length: 100 }, (_, k) => ({ k, g: randomGrammar(1000 + (k >> 1)) }));
    // in waves (the queue holds 64 requests)
    const out: Awaited<ReturnType<typeof post>>[] = [];
    for (let w = 0; w < cases.length; w += 25) {
      const wave = cases.slice(w, w + 25).map(({ k, g }) =>
        post(url, "/v1/completions", {
          prompt: "Once upon a time",
          max_tokens: 24,
          seed: k,
          // half with llama.cpp's default chain, half over the whole vocabulary (the full mask)
          ...((k >> 1) % 2 ? { temperature: 1.2, top_k: 0, top_p: 1, min_p: 0 } : {}),
          grammar: g.gbnf,
        }),
      );
      out.push(...(await Promise.all(wave)));
    }
    let sentences = 0;
    out.forEach(({ status, json }, i) => {
      const { g } = cases[i]!;
      expect(status, JSON.stringify(json)).toBe(200);
      const { text, finish_reason: finish } = json.choices[0];
      if (finish === "stop") {
        expect({ gbnf: g.gbnf, text, m: checkMembership(g, text) }).toEqual({ gbnf: g.gbnf, text, m: "sentence" });
        sentences++;
      } else {
        expect(finish).toBe("length");
        // an output cut inside a multi-byte character ends in U+FFFD (the incomplete bytes)
        const cut = text.endsWith("\uFFFD") ? text.slice(0, -1) : text;
        expect({ gbnf: g.gbnf, text, m: checkMembership(g, cut) }).not.toEqual({ gbnf: g.gbnf, text, m: "no" });
      }
    });
    expect(sentences).toBeGreaterThan(20);
  });

  const time = {
    type: "function",
    function: {
      name: "get_time",
      parameters: { type: "object", properties: { zone: { type: "string", maxLength: 8 } }, required: ["zone"] },
    },
  };

  it("tools with tool_choice required / a named function: tool_calls in OpenAI's shape, finish_reason tool_calls", async () => {
    const ajv = new Ajv({ strict: false });
    for (const [choice, names] of [
      ["required", ["get_weather", "get_time"]],
      [{ type: "function", function: { name: "get_time" } }, ["get_time"]],
    ] as const) {
      for (const seed of [1, 2]) {
        const r = await post(url, "/v1/chat/completions", {
          messages: [{ role: "user", content: "What is the weather in Paris?" }],
          tools: [weather, time],
          tool_choice: choice,
          max_tokens: 256,
          seed,
        });
        expect(r.status, JSON.stringify(r.json)).toBe(200);
        const c = r.json.choices[0];
        expect(c.finish_reason).toBe("tool_calls");
        expect(c.message.content).toBeNull();
        expect(c.message.tool_calls).toHaveLength(1);
        const call = c.message.tool_calls[0];
        expect(call.type).toBe("function");
        expect(call.id).toMatch(/^call_/);
        expect(names).toContain(call.function.name);
        const params = (call.function.name === "get_weather" ? weather : time).function.parameters;
        expect(ajv.validate(params, JSON.parse(call.function.arguments))).toBe(true);
      }
    }
  });

  it("tool_choice auto answers a tool call or a response; none leaves the text free; streaming sends the call as one delta", async () => {
    for (const seed of [1, 2, 3]) {
      const r = await post(url, "/v1/chat/completions", {
        messages: [{ role: "user", content: "Hello" }],
        tools: [weather],
        max_tokens: 256,
        seed,
      });
      expect(r.status).toBe(200);
      const c = r.json.choices[0];
      if (c.finish_reason === "tool_calls") expect(c.message.tool_calls[0].function.name).toBe("get_weather");
      else {
        expect(c.finish_reason).toBe("stop");
        expect(typeof c.message.content).toBe("string");
        expect(c.message.tool_calls).toBeUndefined();
      }
    }
    const none = await post(url, "/v1/chat/completions", {
      messages: [{ role: "user", content: "Hello" }],
      tools: [weather],
      tool_choice: "none",
      max_tokens: 8,
      temperature: 0,
    });
    const plain = await post(url, "/v1/chat/completions", {
      messages: [{ role: "user", content: "Hello" }],
      max_tokens: 8,
      temperature: 0,
    });
    expect(none.json.choices[0].message.content).toBe(plain.json.choices[0].message.content);

    await expectStreamedWeatherCall(url);
  });

  it("an assistant turn with tool_calls and a tool result are accepted in the conversation", async () => {
    const r = await post(url, "/v1/chat/completions", {
      messages: [
        { role: "user", content: "Weather in Paris?" },
        {
          role: "assistant",
          content: null,
          tool_calls: [
            {
              id: "call_1",
              type: "function",
              function: { name: "get_weather", arguments: '{"city":"Paris","unit":"c"}' },
            },
          ],
        },
        { role: "tool", tool_call_id: "call_1", content: "18 degrees" },
      ],
      tools: [weather],
      max_tokens: 64,
      seed: 1,
    });
    expect(r.status).toBe(200);
  });

  it.each([
    ["/completion", { prompt: "a", grammar: "root ::= nothing" }, /(?<!grammar: )grammar: undefined rule "nothing"/],
    [
      "/completion",
      { prompt: "a", grammar: `root ::= ${"(".repeat(5000)}"a"${")".repeat(5000)}` },
      /grammar: nested too deeply/,
    ],
    ["/completion", { prompt: "a", grammar: 'root ::= "a' }, /unterminated string literal at line 1/],
    ["/v1/completions", { prompt: "a", grammar: "root ::= root" }, /left recursion/],
    [
      "/v1/completions",
      { prompt: "a", json_schema: { type: "string", pattern: "a+" } },
      /^json_schema: (?!json_schema).*"pattern" is not supported/,
    ],
    ["/v1/completions", { prompt: "a", json_schema: { type: "foo" } }, /^json_schema: unknown type "foo"/],
    [
      "/v1/chat/completions",
      { messages: [{ role: "user", content: "a" }], response_format: { type: "xml" } },
      /"response_format.type"/,
    ],
    [
      "/v1/chat/completions",
      { messages: [{ role: "user", content: "a" }], response_format: { type: "json_schema" } },
      /needs json_schema.schema/,
    ],
    [
      "/v1/chat/completions",
      {
        messages: [{ role: "user", content: "a" }],
        response_format: { type: "json_schema", json_schema: { schema: { type: "wat" } } },
      },
      /response_format: json_schema: unknown type "wat"/,
    ],
    [
      "/v1/chat/completions",
      { messages: [{ role: "user", content: "a" }], response_format: "json" },
      /response_format/,
    ],
    [
      "/completion",
      { prompt: "a", grammar: 'root ::= "a"', json_schema: { type: "integer" } },
      /only one of grammar, json_schema/,
    ],
    [
      "/v1/chat/completions",
      {
        messages: [{ role: "user", content: "a" }],
        tools: [weather],
        tool_choice: { type: "function", function: { name: "nope" } },
      },
      /"nope", which is not in tools/,
    ],
    [
      "/v1/chat/completions",
      { messages: [{ role: "user", content: "a" }], tool_choice: "required" },
      /tool_choice needs tools/,
    ],
    [
      "/v1/chat/completions",
      { messages: [{ role: "user", content: "a" }], tools: [{ type: "function" }] },
      /tools\[0\]\.function/,
    ],
  ])("%s %j → 400 %s", async (path, body, msg) => {
    const r = await post(url, path, body);
    expect(r.status).toBe(400);
    expect(r.json.error.type).toBe("invalid_request_error");
    expect(r.json.error.message).toMatch(msg);
  });
});
