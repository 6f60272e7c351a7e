/** The sampler's logit bias (first in the chain, as llama.cpp's): values, bans, validation. */
import { describe, expect, it } from "vitest";
import { EngineError, Sampler } from "../src/index.js";

describe("logit bias", () => {
  const logits = Float32Array.of(0.5, 3, 2.9, -1);

  it("is added before greedy selection; −Infinity bans a token; the input is not modified", () => {
    expect(new Sampler({ temperature: 0 }).sample(logits)).toBe(1);
    expect(new Sampler({ temperature: 0, logitBias: new Map([[1, -0.2]]) }).sample(logits)).toBe(2);
    expect(new Sampler({ temperature: 0, logitBias: new Map([[3, 5]]) }).sample(logits)).toBe(3);
    const banned = new Sampler({ temperature: 0, logitBias: new Map([[1, Number.NEGATIVE_INFINITY]]) });
    expect(banned.sample(logits)).toBe(2);
    expect(Array.from(logits)).toEqual([0.5, 3, Math.fround(2.9), -1]);
  });

  it("a banned token is never drawn when sampling", () => {
    const s = new Sampler({
      temperature: 1,
      topK: 0,
      topP: 1,
      minP: 0,
      seed: 7,
      logitBias: new Map([[1, Number.NEGATIVE_INFINITY]]),
    });
    for (let i = 0; i < 200; i++) expect(s.sample(logits)).not.toBe(1);
  });

  it("ids out of the vocabulary are ignored; bad entries are typed errors", () => {
    expect(new Sampler({ temperature: 0, logitBias: new Map([[99, 100]]) }).sample(logits)).toBe(1);
    expect(() => new Sampler({ logitBias: new Map([[-1, 1]]) })).toThrow(EngineError);
    expect(() => new Sampler({ logitBias: new Map([[2, Number.NaN]]) })).toThrow(/logit bias of token 2/);
  });
});
