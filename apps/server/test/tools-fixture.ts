/** What the structured-output and tool-dialect tests share: a tool, and the streamed call it must give. */
import { expect } from "vitest";

/** A tool with a required string (≤ 12 characters) and an enum. */
export const weather = {
  type: "function",
  function: {
    name: "get_weather",
    description: "The weather in a city",
    parameters: {
      type: "object",
      properties: { city: { type: "string", maxLength: 12 }, unit: { enum: ["c", "f"] } },
      required: ["city", "unit"],
    },
  },
};

/**
 * Streams a chat request that must call {@link weather} from the server at `url` and checks that the parsed
 * call arrives with the finish chunk (finish_reason "tool_calls", OpenAI's delta shape, JSON arguments).
 */
export async function expectStreamedWeatherCall(url: string): Promise<void> {
  const res = await fetch(`${url}/v1/chat/completions`, {
    method: "POST",
    headers: { "content-type": "application/json" },
    body: JSON.stringify({
      messages: [{ role: "user", content: "Weather?" }],
      tools: [weather],
      tool_choice: "required",
      max_tokens: 256,
      seed: 5,
      stream: true,
    }),
  });
  const events = (await res.text())
    .split("\n\n")
    .filter((e) => e.startsWith("data: ") && !e.includes("[DONE]"))
    .map((e) => JSON.parse(e.slice(6)));
  const last = events[events.length - 1].choices[0];
  expect(last.finish_reason).toBe("tool_calls");
  expect(last.delta.tool_calls[0]).toMatchObject({ index: 0, type: "function", function: { name: "get_weather" } });
  expect(JSON.parse(last.delta.tool_calls[0].function.arguments)).toHaveProperty("city");
}
