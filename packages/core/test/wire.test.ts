// The TypeScript side of the wire format equals native/include/powerinfer/wire.h, the header every native
// backend includes: op codes, dtype codes and block layouts, tensor kinds, record strides, RoPE modes and
// error codes, read from the header's text.
import { readFileSync } from "node:fs";
import { describe, expect, it } from "vitest";
import {
  BackendError,
  type BackendErrorCode,
  DTYPE_CODES,
  DTYPE_LAYOUT,
  type DType,
  MAX_SRC,
  NODE_STRIDE,
  OP_CODES,
  ROPE_NEOX,
  ROPE_NORMAL,
  TENSOR_KIND,
  TENSOR_STRIDE,
  toBackendError,
} from "../src/index.js";

const header = readFileSync(new URL("../native/include/powerinfer/wire.h", import.meta.url), "utf8");

/** NAME = value pairs of a C++ enum body. */
function enumValues(name: string): Map<string, number> {
  const m = header.match(new RegExp(`enum ${name} : int \\{([^}]*)\\}`));
  expect(m, `enum ${name} in wire.h`).not.toBeNull();
  const out = new Map<string, number>();
  for (const [, k, v] of m![1]!.matchAll(/([A-Z0-9_]+) = (\d+)/g)) out.set(k!, Number(v));
  return out;
}

const constant = (name: string) => {
  const m = header.match(new RegExp(`constexpr int ${name} = (\\d+);`));
  expect(m, name).not.toBeNull();
  return Number(m![1]);
};

describe("wire.h equals core's TypeScript constants", () => {
  it("op codes", () => {
    const ops = enumValues("Op");
    const fromHeader = Object.fromEntries(
      [...ops].filter(([k]) => k !== "OP_COUNT").map(([k, v]) => [k.slice(3).toLowerCase(), v]),
    );
    expect(fromHeader).toEqual({ ...OP_CODES });
    expect(ops.get("OP_COUNT")).toBe(Math.max(...Object.values(OP_CODES)) + 1);
  });

  it("dtype codes and block layouts", () => {
    const dts = enumValues("DType");
    const name = (k: string) => k.slice(3).toLowerCase().replace(/_k$/, "_K") as DType;
    expect(Object.fromEntries([...dts].map(([k, v]) => [name(k), v]))).toEqual({ ...DTYPE_CODES });
    const body = header.slice(header.indexOf("dtype_layout(int dt)"));
    for (const [k] of dts) {
      const m = body.match(new RegExp(`case ${k}: return \\{(\\d+), (\\d+)\\};`));
      expect(m, `layout of ${k}`).not.toBeNull();
      expect({ blockSize: Number(m![1]), typeSize: Number(m![2]) }, k).toEqual(DTYPE_LAYOUT[name(k)]);
    }
  });

  it("tensor kinds, strides and RoPE modes", () => {
    const kinds = enumValues("TensorKind");
    expect({
      intermediate: kinds.get("KIND_INTERMEDIATE"),
      input: kinds.get("KIND_INPUT"),
      handle: kinds.get("KIND_HANDLE"),
    }).toEqual({ ...TENSOR_KIND });
    expect(constant("kTensorWords")).toBe(TENSOR_STRIDE);
    expect(constant("kNodeWords")).toBe(NODE_STRIDE);
    expect(constant("kMaxSrc")).toBe(MAX_SRC);
    expect(constant("kRopeNormal")).toBe(ROPE_NORMAL);
    expect(constant("kRopeNeox")).toBe(ROPE_NEOX);
  });

  it("every error code of the header is a BackendErrorCode core keeps", () => {
    const codes = [...header.matchAll(/constexpr const char\* kErr\w+ = "([A-Z_]+)";/g)].map((m) => m[1]!);
    expect(codes.length).toBeGreaterThanOrEqual(7);
    for (const c of codes) {
      const e = toBackendError("native", Object.assign(new Error("x"), { code: c }), "API_VERSION");
      expect(e).toBeInstanceOf(BackendError);
      expect(e.code as BackendErrorCode).toBe(c);
    }
  });
});
