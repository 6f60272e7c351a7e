/** The sampler: logit bias (first in the chain, as llama.cpp's), and seeded draws as llama.cpp's. */
import { describe, expect, it } from "vitest";
import { EngineError, Mt19937, Sampler } from "../src/index.js";

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

  it("top_p 0 keeps only the most likely token, as llama.cpp's top-p; outside [0, 1] is refused", () => {
    const s = new Sampler({ temperature: 1.5, topK: 0, topP: 0, minP: 0, seed: 11 });
    for (let i = 0; i < 100; i++) expect(s.sample(logits)).toBe(1);
    // (with top_p 1 the same seed draws the others too)
    const open = new Sampler({ temperature: 1.5, topK: 0, topP: 1, minP: 0, seed: 11 });
    expect(new Set(Array.from({ length: 100 }, () => open.sample(logits))).size).toBeGreaterThan(1);
    expect(() => new Sampler({ topP: -0.1 })).toThrow(/top_p must be in \[0, 1\], got -0.1/);
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

describe("seeded draws as llama.cpp's", () => {
  it("Mt19937 is std::mt19937 and canonical() is uniform_real_distribution<double>(0, 1) (libstdc++ values)", () => {
    const g = new Mt19937(5489);
    let v = 0;
    for (let i = 0; i < 10_000; i++) v = g.next();
    expect(v).toBe(4123659995); // the C++ standard's check value for the 10000th draw
    expect(new Mt19937(4294967295).next()).toBe(419326371);
    // printed by a g++ 12 program: std::mt19937 r(42); std::uniform_real_distribution<double> d(0.0f, 1.0f)
    const r = new Mt19937(42);
    expect([r.canonical(), r.canonical(), r.canonical()]).toEqual([
      0.796542984287846,
      0.18343478789336848,
      0.7796909976126613, // %.17g: 0.79654298428784598, …, 0.77969099761266125
    ]);
  });

  it("draws the first candidate whose running sum reaches u × the total, over top-k in order", () => {
    // 3 tokens kept by top-k; probabilities ∝ exp(logit): [e², e¹, e⁰] → shares 0.665, 0.245, 0.090
    const logits = Float32Array.from([1, 2, 0, -50]);
    const u = new Mt19937(42).canonical(); // 0.7965…: past 0.665, within 0.665 + 0.245
    expect(u).toBeGreaterThan(0.665);
    expect(u).toBeLessThan(0.91);
    const s = new Sampler({ seed: 42, temperature: 1, topK: 3, topP: 1, minP: 0 });
    expect(s.sample(logits)).toBe(0); // sorted order: 1 (e²), then 0 (e¹)
  });
});
