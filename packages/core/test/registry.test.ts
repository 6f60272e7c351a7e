import { describe, expect, it } from "vitest";
import { BACKEND_API_VERSION, type BackendDescriptor, BackendError, BackendRegistry } from "../src/index.js";

function fake(name: string, usable: boolean, score: number, extra: Partial<BackendDescriptor> = {}): BackendDescriptor {
  return {
    name,
    apiVersion: BACKEND_API_VERSION,
    probe: () => ({ usable, score, reason: usable ? "ok" : "unavailable: no device", devices: [] }),
    load: async () => {
      throw new Error(`load ${name}`);
    },
    ...extra,
  };
}

describe("BackendRegistry", () => {
  it("auto picks the best usable backend and logs every skipped candidate with its reason", async () => {
    const r = new BackendRegistry();
    r.register(fake("cpu", true, 10));
    r.register(fake("cuda", false, 100));
    r.register(fake("slow", true, 5));
    const log: string[] = [];
    const s = await r.select({ log: (l) => log.push(l), env: {} });
    expect(s.descriptor.name).toBe("cpu");
    expect(log).toEqual(["cuda: unavailable: no device"]);
  });

  it("priority breaks score ties", async () => {
    const r = new BackendRegistry();
    r.register(fake("a", true, 10), 0);
    r.register(fake("b", true, 10), 5);
    expect((await r.select({ env: {} })).descriptor.name).toBe("b");
  });

  it("honours an explicit ordered list, exclude, and the environment override", async () => {
    const r = new BackendRegistry();
    r.register(fake("cpu", true, 10));
    r.register(fake("other", true, 50));
    expect((await r.select({ prefer: ["cpu", "other"], env: {} })).descriptor.name).toBe("cpu");
    expect((await r.select({ exclude: ["other"], env: {} })).descriptor.name).toBe("cpu");
    expect((await r.select({ prefer: ["other"], env: { POWERINFER_BACKEND: "cpu" } })).descriptor.name).toBe("cpu");
    const s = await r.select({ prefer: ["nope", "cpu"], env: {} });
    expect(s.skipped[0]).toMatch(/^nope: not registered/);
  });

  it("reports a throwing probe or a wrong API version as unavailable, and throws a typed error when nothing is usable", async () => {
    const r = new BackendRegistry();
    r.register(
      fake("boom", true, 10, {
        probe: () => {
          throw new Error("addon missing");
        },
      }),
    );
    r.register(fake("old", true, 10, { apiVersion: BACKEND_API_VERSION + 1 }));
    const list = await r.list();
    expect(list.map((b) => b.probe.usable)).toEqual([false, false]);
    expect(list.find((b) => b.name === "boom")!.probe.reason).toBe("unavailable: probe failed: addon missing");
    const err = await r.select({ env: {} }).catch((e) => e);
    expect(err).toBeInstanceOf(BackendError);
    expect(err.code).toBe("UNAVAILABLE");
    expect(err.message).toMatch(/boom: unavailable: probe failed: addon missing/);
    expect(err.message).toMatch(/old: unavailable: implements backend API v2/);
  });

  it("a malformed probe result or a non-Error throw is 'unavailable' with the reason; load() failures name the backend", async () => {
    const r = new BackendRegistry();
    r.register(fake("undef", true, 1, { probe: () => undefined as never }));
    r.register(fake("strings", true, 1, { probe: () => ({ usable: "yes", score: "high" }) as never }));
    r.register(fake("nan", true, 1, { probe: () => ({ usable: true, score: Number.NaN, reason: "", devices: [] }) }));
    r.register(
      fake("throwsstr", true, 1, {
        probe: () => {
          throw "string thrown";
        },
      }),
    );
    r.register(fake("empty", true, 1, { load: async () => ({}) as never }));
    const reasons = Object.fromEntries((await r.list()).map((b) => [b.name, b.probe.reason]));
    expect(reasons["undef"]).toBe("unavailable: probe result is malformed: returned undefined");
    expect(reasons["strings"]).toMatch(/^unavailable: probe result is malformed: "usable" is "yes", not a boolean/);
    expect(reasons["nan"]).toMatch(/"score" is not a finite number/);
    expect(reasons["throwsstr"]).toBe("unavailable: probe failed: string thrown");
    await expect(r.load({ prefer: ["empty"], env: {} })).rejects.toThrow(
      /^empty: load\(\) did not return a Backend \(missing createTensor, mapTensor/,
    );
    r.register(fake("boom", true, 1));
    await expect(r.load({ prefer: ["boom"], env: {} })).rejects.toMatchObject({
      code: "UNAVAILABLE",
      message: "boom: load failed: load boom",
    });
  });

  it("a POWERINFER_BACKEND that names nothing is refused", async () => {
    const r = new BackendRegistry();
    r.register(fake("cpu", true, 10));
    await expect(r.select({ env: { POWERINFER_BACKEND: "," } })).rejects.toMatchObject({ code: "BAD_CONFIG" });
  });
});
