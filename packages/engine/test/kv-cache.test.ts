// A KV cache larger than the backend's free memory is refused before anything is allocated, with both
// amounts in a unit that shows them (a small device budget once printed "0.00 GiB").
import { type Backend, createReferenceBackend } from "@powerinfer/core";
import { describe, expect, it } from "vitest";
import { KvCache } from "../src/model/kv-cache.js";

describe("KvCache against the backend's free memory", () => {
  it("names what it needs and what is free, in KiB/MiB/GiB as they show", () => {
    const ref = createReferenceBackend();
    const small = Object.create(ref, {
      name: { value: "tiny" },
      devices: { value: [{ ...ref.devices[0], freeMemory: 1_000_000 }] },
    }) as Backend;
    // 2 (K, V) · 2 layers · 64 · 8192 positions · 2 bytes (f16) = 4 MiB
    expect(() => new KvCache(small, 2, 64, 8192)).toThrow(
      "a KV cache for n_ctx 8192 needs 4.00 MiB, tiny has 976.56 KiB free; use a smaller -c",
    );
    expect(ref.allocatedBytes()).toBe(0);
    const kv = new KvCache(small, 2, 64, 1024); // 512 KiB fits
    expect(kv.k.length).toBe(2);
    kv.dispose();
    ref.dispose();
  });
});
