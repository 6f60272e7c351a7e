/** Generation's stop strings: text is held back only while its tail is the start of a stop string. */
import { join } from "node:path";
import { openGguf } from "@powerinfer/gguf";
import { describe, expect, it } from "vitest";
import { tokenizerFromGguf } from "@powerinfer/tokenizer";
import { Generation } from "../src/index.js";

const tok = tokenizerFromGguf(openGguf(join(process.env.POWERINFER_TEST_MODELS!, "stories260K.gguf")));
const TEXT = "Once upon a time there was";

/** Feeds TEXT's tokens one by one (greedy on one-hot logits); returns each step's result and the final flush. */
function steps(stop: string[]) {
  const ids = tok.tokenize(TEXT, { addSpecial: false });
  const g = new Generation(tok, [], { temperature: 0, stop, ignoreEos: true });
  const out = ids.map((id) => {
    const logits = new Float32Array(tok.nVocab).fill(-1);
    logits[id] = 1;
    return g.next(logits);
  });
  return { out, flushed: g.flush() };
}

const plain = steps([]).out.map((s) => s.text);

describe("stop strings", () => {
  it("releases every token's text at once when no tail starts a stop string", () => {
    expect(plain.join("")).toMatch(/Once upon a time there was$/);
    // nothing in the text ends with "<": each step releases what it decoded (was: the last 9 characters held)
    const { out, flushed } = steps(["<|im_end|>"]);
    expect(out.map((s) => s.text)).toEqual(plain);
    expect(flushed).toBe("");
  });

  it("holds back exactly the tail that starts a stop string, and releases it once it stops matching", () => {
    const { out, flushed } = steps(["time to go"]);
    const texts = out.map((s) => s.text);
    const at = plain.findIndex((t) => t.endsWith("time"));
    expect(at).toBeGreaterThan(0);
    expect(texts[at]).toBe(plain[at]!.slice(0, -"time".length)); // "time" held: it starts "time to go"
    expect(texts.slice(0, at)).toEqual(plain.slice(0, at));
    expect(texts.join("") + flushed).toBe(plain.join("")); // " there" rules the stop out: released
    expect(texts[at + 1]!.startsWith("time")).toBe(true);
    expect(out.every((s) => s.stop === undefined)).toBe(true);
  });

  it("stops at a stop string and returns the text before it", () => {
    const { out } = steps(["a time"]);
    const last = out.findIndex((s) => s.stop === "stop");
    expect(last).toBeGreaterThan(0);
    expect(out[last]!.stopWord).toBe("a time");
    expect(
      out
        .slice(0, last + 1)
        .map((s) => s.text)
        .join(""),
    ).toMatch(/Once upon $/);
  });
});
