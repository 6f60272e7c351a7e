/**
 * The part of vitest's API that the shared GPU suite (`packages/backend-cuda/test/gpu-suite.ts`) uses,
 * so that the kit can run that suite with plain `node` on a machine without node_modules. The kit's
 * bundler maps the module name "vitest" to this file. Tests are registered by `describe`/`it` and run
 * one after another by {@link runRegistered}; a matcher the suite does not use throws, naming itself,
 * so a new matcher in the suite fails loudly here instead of passing silently.
 */

type TestFn = () => unknown | Promise<unknown>;

interface Registered {
  title: string;
  fn: TestFn;
  skip: boolean;
}

const registered: Registered[] = [];
const prefix: string[] = [];

export function describe(label: string, fn: () => void): void {
  prefix.push(label);
  try {
    fn();
  } finally {
    prefix.pop();
  }
}

function register(title: string, fn: TestFn, skip: boolean): void {
  registered.push({ title: [...prefix, title].join(" › "), fn, skip });
}

interface ItFn {
  (title: string, fn: TestFn): void;
  skip(title: string, fn: TestFn): void;
  skipIf(cond: boolean): (title: string, fn: TestFn) => void;
}

export const it: ItFn = Object.assign((title: string, fn: TestFn) => register(title, fn, false), {
  skip: (title: string, fn: TestFn) => register(title, fn, true),
  skipIf: (cond: boolean) => (title: string, fn: TestFn) => register(title, fn, cond),
});
export const test = it;

/** Thrown by a failed expectation. */
export class AssertionError extends Error {
  override name = "AssertionError";
}

const OBJECT_CONTAINING = Symbol("objectContaining");
interface ObjectContaining {
  [OBJECT_CONTAINING]: Record<string, unknown>;
}

function show(v: unknown): string {
  if (typeof v === "string") return JSON.stringify(v);
  if (v instanceof Error) return `${v.name}: ${v.message}`;
  try {
    return JSON.stringify(v) ?? String(v);
  } catch {
    return String(v);
  }
}

function deepEqual(a: unknown, b: unknown): boolean {
  if (Object.is(a, b)) return true;
  if (typeof a !== "object" || typeof b !== "object" || a === null || b === null) return false;
  if (ArrayBuffer.isView(a) && ArrayBuffer.isView(b)) {
    const x = a as unknown as ArrayLike<unknown>;
    const y = b as unknown as ArrayLike<unknown>;
    return x.length === y.length && Array.from(x).every((v, i) => Object.is(v, y[i]));
  }
  if (Array.isArray(a) !== Array.isArray(b)) return false;
  const ka = Object.keys(a);
  const kb = Object.keys(b);
  return (
    ka.length === kb.length &&
    ka.every((k) => deepEqual((a as Record<string, unknown>)[k], (b as Record<string, unknown>)[k]))
  );
}

function matches(value: unknown, want: unknown): boolean {
  if (want && typeof want === "object" && OBJECT_CONTAINING in want) {
    const fields = (want as ObjectContaining)[OBJECT_CONTAINING];
    return (
      typeof value === "object" &&
      value !== null &&
      Object.entries(fields).every(([k, v]) => deepEqual((value as Record<string, unknown>)[k], v))
    );
  }
  return deepEqual(value, want);
}

function matchers(value: unknown, message: string | undefined) {
  const fail = (what: string): never => {
    throw new AssertionError(message ? `${message}: ${what}` : what);
  };
  return {
    toBe(want: unknown) {
      if (!Object.is(value, want)) fail(`expected ${show(value)} to be ${show(want)}`);
    },
    toEqual(want: unknown) {
      if (!deepEqual(value, want)) fail(`expected ${show(value)} to equal ${show(want)}`);
    },
    toBeLessThan(n: number) {
      if (!((value as number) < n)) fail(`expected ${show(value)} < ${n}`);
    },
    toBeLessThanOrEqual(n: number) {
      if (!((value as number) <= n)) fail(`expected ${show(value)} ≤ ${n}`);
    },
    toBeGreaterThan(n: number) {
      if (!((value as number) > n)) fail(`expected ${show(value)} > ${n}`);
    },
    toBeGreaterThanOrEqual(n: number) {
      if (!((value as number) >= n)) fail(`expected ${show(value)} ≥ ${n}`);
    },
    toBeInstanceOf(cls: abstract new (...args: never[]) => unknown) {
      if (!(value instanceof cls)) fail(`expected ${show(value)} to be an instance of ${cls.name}`);
    },
    toThrow(want?: unknown) {
      if (typeof value !== "function") fail("toThrow needs a function");
      let thrown: unknown;
      let threw = false;
      try {
        (value as () => unknown)();
      } catch (e) {
        threw = true;
        thrown = e;
      }
      if (!threw) fail("expected the function to throw");
      if (want !== undefined && !matches(thrown, want)) fail(`threw ${show(thrown)}, expected ${show(want)}`);
    },
  };
}

type Matchers = ReturnType<typeof matchers>;

/** `expect(value, message?)` with the matchers above; any other matcher throws naming itself. */
export const expect = Object.assign(
  (value: unknown, message?: string): Matchers =>
    new Proxy(matchers(value, message), {
      get(target, key) {
        if (key in target) return target[key as keyof Matchers];
        throw new AssertionError(`matcher ${String(key)} is not in the device kit's vitest shim`);
      },
    }),
  {
    objectContaining: (fields: Record<string, unknown>): ObjectContaining => ({ [OBJECT_CONTAINING]: fields }),
  },
);

export function beforeAll(): never {
  throw new AssertionError("beforeAll is not in the device kit's vitest shim");
}
export const afterAll = beforeAll;

export interface TestResult {
  title: string;
  status: "ok" | "FAIL" | "skip";
  ms: number;
  error?: string;
}

/**
 * Runs every registered test in order (each at most `timeoutMs`), calling `report` as each ends.
 * Returns the results; the registry is emptied.
 */
export async function runRegistered(report: (r: TestResult) => void, timeoutMs = 300_000): Promise<TestResult[]> {
  const results: TestResult[] = [];
  for (const t of registered.splice(0)) {
    const start = performance.now();
    let r: TestResult;
    if (t.skip) {
      r = { title: t.title, status: "skip", ms: 0 };
    } else {
      let timer: NodeJS.Timeout | undefined;
      try {
        await Promise.race([
          Promise.resolve().then(t.fn),
          new Promise((_, reject) => {
            timer = setTimeout(() => reject(new Error(`timed out after ${timeoutMs} ms`)), timeoutMs);
          }),
        ]);
        r = { title: t.title, status: "ok", ms: performance.now() - start };
      } catch (e) {
        r = {
          title: t.title,
          status: "FAIL",
          ms: performance.now() - start,
          error: e instanceof Error ? e.message : String(e),
        };
      } finally {
        clearTimeout(timer);
      }
    }
    results.push(r);
    report(r);
  }
  return results;
}
