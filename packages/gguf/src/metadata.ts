/**
 * Typed accessors for GGUF metadata. Each throws a {@link GgufError} naming the key:
 * `MISSING_KEY` when a required key is absent, `BAD_VALUE` when the stored value has the wrong type.
 */

import { GgufError } from "./errors.js";
import type { GgufFile } from "./reader.js";
import type { GgufValue } from "./values.js";

type Meta = Pick<GgufFile, "metadata" | "path">;

function missing(file: Meta, key: string): never {
  throw new GgufError("MISSING_KEY", `required metadata key "${key}" is missing`, { path: file.path });
}

function bad(file: Meta, key: string, expected: string, v: unknown): never {
  const found = Array.isArray(v) || ArrayBuffer.isView(v) ? "an array" : `${typeof v} ${String(v)}`;
  throw new GgufError("BAD_VALUE", `metadata "${key}": expected ${expected}, found ${found}`, { path: file.path });
}

function asNumber(file: Meta, key: string, v: GgufValue): number {
  if (typeof v === "number") return v;
  if (typeof v === "bigint") {
    if (v > BigInt(Number.MAX_SAFE_INTEGER) || v < -BigInt(Number.MAX_SAFE_INTEGER)) {
      bad(file, key, "a number within ±(2^53-1)", v);
    }
    return Number(v);
  }
  return bad(file, key, "a number", v);
}

/** A string value. @throws GgufError `MISSING_KEY` / `BAD_VALUE` */
export function getString(file: Meta, key: string): string {
  const v = file.metadata.get(key);
  if (v === undefined) missing(file, key);
  if (typeof v !== "string") bad(file, key, "a string", v);
  return v;
}

/** A string value, or undefined when absent. @throws GgufError `BAD_VALUE` when not a string */
export function getOptionalString(file: Meta, key: string): string | undefined {
  return file.metadata.has(key) ? getString(file, key) : undefined;
}

/**
 * A numeric value of any stored type (u8…f64; u64/i64 bigints within ±(2^53-1) are converted).
 * @throws GgufError `MISSING_KEY` / `BAD_VALUE`
 */
export function getNumber(file: Meta, key: string): number {
  const v = file.metadata.get(key);
  if (v === undefined) missing(file, key);
  return asNumber(file, key, v);
}

/** Like {@link getNumber}, or undefined when absent. */
export function getOptionalNumber(file: Meta, key: string): number | undefined {
  return file.metadata.has(key) ? getNumber(file, key) : undefined;
}

/** A boolean value, or undefined when absent. @throws GgufError `BAD_VALUE` when not a bool */
export function getOptionalBool(file: Meta, key: string): boolean | undefined {
  const v = file.metadata.get(key);
  if (v === undefined) return undefined;
  if (typeof v !== "boolean") bad(file, key, "a bool", v);
  return v;
}

/** An array value (typed array, `string[]`, `boolean[]` or nested). @throws GgufError `MISSING_KEY` / `BAD_VALUE` */
export function getArray(file: Meta, key: string): Exclude<GgufValue, number | bigint | boolean | string> {
  const v = file.metadata.get(key);
  if (v === undefined) missing(file, key);
  if (!Array.isArray(v) && !ArrayBuffer.isView(v)) bad(file, key, "an array", v);
  return v as Exclude<GgufValue, number | bigint | boolean | string>;
}

/** An array value, or undefined when absent. */
export function getOptionalArray(
  file: Meta,
  key: string,
): Exclude<GgufValue, number | bigint | boolean | string> | undefined {
  return file.metadata.has(key) ? getArray(file, key) : undefined;
}
