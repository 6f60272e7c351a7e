/**
 * Every dense op and weight dtype against a float64 reference computed here, at 1 thread, 2 threads
 * and on the forced scalar path. Dot products are checked against an exact emulation of llama.cpp's
 * activation rounding (so a kernel that skipped the Q8 rounding, or rounded differently, fails).
 */
import { bf16ToNumber, type DType, Graph, halfToNumber, numberToBf16, numberToHalf } from "@powerinfer/core";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";
import { describe, expect, it } from "vitest";
import {
  backend,
  CONFIGS,
  dotTol,
  oddK,
  probeReason,
  Rng,
  randomWeights,
  refDot,
  roundActivation,
  usable,
  WEIGHT_DTYPES,
} from "./helpers.js";

/** Largest |actual − expected| / tol over all elements (≤ 1 passes). */
function worst(actual: ArrayLike<number>, expected: ArrayLike<number>, tol: (i: number) => number): number {
  let w = 0;
  for (let i = 0; i < expected.length; i++) {
    const a = actual[i]!;
    if (!Number.isFinite(a)) return Number.POSITIVE_INFINITY;
    w = Math.max(w, Math.abs(a - expected[i]!) / tol(i));
  }
  return w;
}

describe.skipIf(!usable)(`dense ops (${probeReason})`, () => {
  for (const cfg of CONFIGS) {
    describe(cfg.name, () => {
      it("reports the kernel it chose", async () => {
        const b = (await backend(cfg.opts)) as unknown as { kernel: string; kernelReason: string; threads: number };
        expect(b.threads).toBe(cfg.opts.threads);
        if (cfg.opts.forceScalar) {
          expect(b.kernel).toBe("scalar");
          expect(b.kernelReason).toMatch(/forced/);
        } else {
          expect(b.kernelReason).toBe(probeReason);
        }
      });

      for (const dtype of WEIGHT_DTYPES) {
        it(`get_rows and mul_mat ${dtype} (T=1 and T=5, odd shapes)`, async () => {
          const b = await backend(cfg.opts);
          const rng = new Rng(1000 + WEIGHT_DTYPES.indexOf(dtype));
          for (const [kMul, n] of [
            [1, 7],
            [2, 13],
          ] as const) {
            const k = oddK(dtype, kMul);
            const w = randomWeights(dtype, k, n, rng);
            const wt = b.createTensor(dtype, [k, n], w.bytes);
            // get_rows: bit-exact with gguf's reference dequantizer
            const ids = Int32Array.from([n - 1, 0, 3, 3]);
            {
              const g = new Graph();
              const y = g.output(g.getRows(g.handle(wt), g.input("i32", [ids.length], ids)));
              b.compute(g);
              for (let t = 0; t < ids.length; t++) {
                expect(Array.from(y.subarray(t * k, (t + 1) * k))).toEqual(
                  Array.from(w.values.subarray(ids[t]! * k, (ids[t]! + 1) * k)),
                );
              }
            }
            for (const T of [1, 5]) {
              const x = rng.f32(k * T, -2, 2);
              const g = new Graph();
              const y = g.output(g.mulMat(g.handle(wt), g.input("f32", [k, T], x)));
              b.compute(g);
              const expected = new Float64Array(n * T);
              const tol = new Float64Array(n * T);
              for (let t = 0; t < T; t++) {
                const xr = roundActivation(dtype, x, t * k, k);
                for (let r = 0; r < n; r++) {
                  const d = refDot(dtype, w, r, k, xr);
                  expected[t * n + r] = d.value;
                  tol[t * n + r] = dotTol(k, d.scale);
                }
              }
              expect(
                worst(y, expected, (i) => tol[i]!),
                `${dtype} K=${k} N=${n} T=${T}`,
              ).toBeLessThanOrEqual(1);
            }
            b.freeTensor(wt);
          }
        });
      }

      it("rms_norm and norm", async () => {
        const b = await backend(cfg.opts);
        const rng = new Rng(7);
        const n = 67;
        const T = 3;
        const x = rng.f32(n * T, -3, 3);
        const g = new Graph();
        const xi = g.input("f32", [n, T], x);
        const yr = g.output(g.rmsNorm(xi, 1e-5));
        const yn = g.output(g.norm(xi, 1e-6));
        b.compute(g);
        const er = new Float64Array(n * T);
        const en = new Float64Array(n * T);
        for (let t = 0; t < T; t++) {
          let ss = 0;
          let s = 0;
          for (let i = 0; i < n; i++) {
            ss += x[t * n + i]! ** 2;
            s += x[t * n + i]!;
          }
          const mean = s / n;
          let v = 0;
          for (let i = 0; i < n; i++) v += (x[t * n + i]! - mean) ** 2;
          for (let i = 0; i < n; i++) {
            er[t * n + i] = x[t * n + i]! / Math.sqrt(ss / n + 1e-5);
            en[t * n + i] = (x[t * n + i]! - mean) / Math.sqrt(v / n + 1e-6);
          }
        }
        expect(worst(yr, er, (i) => 1e-6 * (1 + Math.abs(er[i]!)))).toBeLessThanOrEqual(1);
        expect(worst(yn, en, (i) => 1e-5 * (1 + Math.abs(en[i]!)))).toBeLessThanOrEqual(1);
      });

      for (const mode of [0, 2]) {
        it(`rope ${mode === 0 ? "normal" : "NeoX"} (partial n_dims, several heads)`, async () => {
          const b = await backend(cfg.opts);
          const rng = new Rng(11 + mode);
          const hd = 16;
          const H = 3;
          const nDims = 12;
          const T = 5;
          const x = rng.f32(hd * H * T);
          const pos = Int32Array.from([0, 1, 7, 30, 3]);
          const p = { headDim: hd, nDims, mode, freqBase: 10000, freqScale: 0.5 };
          const g = new Graph();
          const y = g.output(g.rope(g.input("f32", [hd * H, T], x), g.input("i32", [T], pos), p));
          b.compute(g);
          const e = Float64Array.from(x);
          for (let t = 0; t < T; t++) {
            for (let h = 0; h < H; h++) {
              const o = t * hd * H + h * hd;
              for (let i = 0; i < nDims / 2; i++) {
                const th = pos[t]! * 0.5 * 10000 ** ((-2 * i) / nDims);
                const [a, c] = mode === 0 ? [2 * i, 2 * i + 1] : [i, i + nDims / 2];
                const x0 = x[o + a]!;
                const x1 = x[o + c]!;
                e[o + a] = x0 * Math.cos(th) - x1 * Math.sin(th);
                e[o + c] = x0 * Math.sin(th) + x1 * Math.cos(th);
              }
            }
          }
          expect(worst(y, e, () => 2e-5)).toBeLessThanOrEqual(1);
          // dimensions ≥ n_dims pass through exactly
          for (let t = 0; t < T; t++) {
            for (let h = 0; h < H; h++) {
              for (let i = nDims; i < hd; i++) expect(y[t * hd * H + h * hd + i]).toBe(x[t * hd * H + h * hd + i]);
            }
          }
        });
      }

      it("softmax with scale", async () => {
        const b = await backend(cfg.opts);
        const rng = new Rng(13);
        const n = 37;
        const R = 4;
        const x = rng.f32(n * R, -5, 5);
        const g = new Graph();
        const y = g.output(g.softmax(g.input("f32", [n, R], x), 0.7));
        b.compute(g);
        const e = new Float64Array(n * R);
        for (let r = 0; r < R; r++) {
          let m = -Infinity;
          for (let i = 0; i < n; i++) m = Math.max(m, 0.7 * x[r * n + i]!);
          let s = 0;
          for (let i = 0; i < n; i++) s += Math.exp(0.7 * x[r * n + i]! - m);
          for (let i = 0; i < n; i++) e[r * n + i] = Math.exp(0.7 * x[r * n + i]! - m) / s;
        }
        expect(worst(y, e, (i) => 1e-6 * (1e-3 + e[i]!))).toBeLessThanOrEqual(1);
      });

      for (const cache of ["f32", "f16"] as const) {
        it(`attention over an ${cache} KV cache (cpy, causal mask, GQA)`, async () => {
          const b = await backend(cfg.opts);
          const rng = new Rng(cache === "f32" ? 17 : 19);
          const hd = 8;
          const H = 6;
          const Hkv = 2;
          const C = 12;
          const nPast = 4;
          const T = 3;
          const scale = 1 / Math.sqrt(hd);
          const kc = b.createTensor(cache, [hd * Hkv, C]);
          const vc = b.createTensor(cache, [hd * Hkv, C]);
          // history rows 0..nPast-1 written by one graph, new rows by the attention graph itself
          const kAll = rng.f32(hd * Hkv * (nPast + T));
          const vAll = rng.f32(hd * Hkv * (nPast + T));
          const q = rng.f32(hd * H * T);
          const g0 = new Graph();
          g0.cpy(g0.input("f32", [hd * Hkv, nPast], kAll.subarray(0, hd * Hkv * nPast)), g0.handle(kc), 0);
          g0.cpy(g0.input("f32", [hd * Hkv, nPast], vAll.subarray(0, hd * Hkv * nPast)), g0.handle(vc), 0);
          b.compute(g0);
          const g = new Graph();
          const kt = g.cpy(g.input("f32", [hd * Hkv, T], kAll.subarray(hd * Hkv * nPast)), g.handle(kc), nPast);
          const vt = g.cpy(g.input("f32", [hd * Hkv, T], vAll.subarray(hd * Hkv * nPast)), g.handle(vc), nPast);
          const y = g.output(
            g.attention(g.input("f32", [hd * H, T], q), kt, vt, { headDim: hd, nHead: H, nHeadKv: Hkv, nPast, scale }),
          );
          await b.computeAsync(g);
          const st = (v: number) => (cache === "f16" ? halfToNumber(numberToHalf(v)) : Math.fround(v));
          const e = new Float64Array(hd * H * T);
          // F16 cache: the V accumulator is F16 too (llama.cpp's flash attention), rounded after every
          // key: at most (n + 1) roundings of 2^-11 relative to the running Σ p·|v|
          const tol = new Float64Array(hd * H * T).fill(2e-6);
          for (let t = 0; t < T; t++) {
            for (let h = 0; h < H; h++) {
              const kvh = Math.floor(h / (H / Hkv));
              const n = nPast + t + 1;
              const s: number[] = [];
              for (let j = 0; j < n; j++) {
                let d = 0;
                for (let i = 0; i < hd; i++)
                  d += st(q[t * hd * H + h * hd + i]!) * st(kAll[j * hd * Hkv + kvh * hd + i]!);
                s.push(scale * d);
              }
              const m = Math.max(...s);
              const p = s.map((v) => Math.exp(v - m));
              const z = p.reduce((a, c) => a + c, 0);
              for (let i = 0; i < hd; i++) {
                let o = 0;
                let mag = 0;
                for (let j = 0; j < n; j++) {
                  o += p[j]! * st(vAll[j * hd * Hkv + kvh * hd + i]!);
                  mag += p[j]! * Math.abs(st(vAll[j * hd * Hkv + kvh * hd + i]!));
                }
                e[t * hd * H + h * hd + i] = o / z;
                if (cache === "f16") tol[t * hd * H + h * hd + i] += (2 ** -11 * (n + 1) * mag) / z;
              }
            }
          }
          expect(worst(y, e, (i) => tol[i]!)).toBeLessThanOrEqual(1);
          b.freeTensor(kc);
          b.freeTensor(vc);
        });
      }

      for (const cache of ["f32", "f16"] as const) {
        it(`attention over an ${cache} KV cache: a batch of 19 tokens (tiles of 8 rows, key blocks of 32) gives each token the bits it gets alone`, async () => {
          const b = await backend(cfg.opts);
          const rng = new Rng(cache === "f32" ? 41 : 43);
          const hd = 64;
          const H = 4;
          const Hkv = 2;
          const nPast = 50;
          const T = 19;
          const C = nPast + T;
          const scale = 1 / Math.sqrt(hd);
          const kc = b.createTensor(cache, [hd * Hkv, C]);
          const vc = b.createTensor(cache, [hd * Hkv, C]);
          const g0 = new Graph();
          g0.cpy(g0.input("f32", [hd * Hkv, C], rng.f32(hd * Hkv * C, -2, 2)), g0.handle(kc), 0);
          g0.cpy(g0.input("f32", [hd * Hkv, C], rng.f32(hd * Hkv * C)), g0.handle(vc), 0);
          b.compute(g0);
          const q = rng.f32(hd * H * T, -2, 2);
          const opts = { headDim: hd, nHead: H, nHeadKv: Hkv, scale };
          const g = new Graph();
          const y = g.output(
            g.attention(g.input("f32", [hd * H, T], q), g.handle(kc), g.handle(vc), { ...opts, nPast }),
          );
          b.compute(g);
          for (let t = 0; t < T; t++) {
            const g1 = new Graph();
            const y1 = g1.output(
              g1.attention(
                g1.input("f32", [hd * H, 1], q.subarray(t * hd * H, (t + 1) * hd * H)),
                g1.handle(kc),
                g1.handle(vc),
                {
                  ...opts,
                  nPast: nPast + t,
                },
              ),
            );
            b.compute(g1);
            expect(y1, `token ${t}`).toEqual(y.subarray(t * hd * H, (t + 1) * hd * H));
          }
          b.freeTensor(kc);
          b.freeTensor(vc);
        });
      }

      it("add and mul (same shape and broadcast), scale, silu, relu, gelu", async () => {
        const b = await backend(cfg.opts);
        const rng = new Rng(23);
        const n = 45;
        const T = 3;
        const a = rng.f32(n * T, -4, 4);
        const c = rng.f32(n * T, -2, 2);
        const r = rng.f32(n, -2, 2);
        const g = new Graph();
        const ai = g.input("f32", [n, T], a);
        const ci = g.input("f32", [n, T], c);
        const ri = g.input("f32", [n], r);
        const outs = {
          add: g.output(g.add(ai, ci)),
          addB: g.output(g.add(ai, ri)),
          mul: g.output(g.mul(ai, ci)),
          mulB: g.output(g.mul(ai, ri)),
          scale: g.output(g.scale(ai, -0.3)),
          silu: g.output(g.silu(ai)),
          relu: g.output(g.relu(ai)),
          gelu: g.output(g.gelu(ai)),
        };
        b.compute(g);
        const f: Record<keyof typeof outs, (i: number) => number> = {
          add: (i) => a[i]! + c[i]!,
          addB: (i) => a[i]! + r[i % n]!,
          mul: (i) => a[i]! * c[i]!,
          mulB: (i) => a[i]! * r[i % n]!,
          scale: (i) => a[i]! * -0.3,
          silu: (i) => a[i]! / (1 + Math.exp(-a[i]!)),
          relu: (i) => Math.max(0, a[i]!),
          // ggml's: the input rounded to F16, the result rounded to F16
          gelu: (i) => {
            const h = halfToNumber(numberToHalf(a[i]!));
            return halfToNumber(
              numberToHalf(0.5 * h * (1 + Math.tanh(Math.sqrt(2 / Math.PI) * (h + 0.044715 * h ** 3)))),
            );
          },
        };
        for (const key of Object.keys(outs) as (keyof typeof outs)[]) {
          const e = Float64Array.from({ length: n * T }, (_, i) => f[key](i));
          expect(
            // gelu: float vs float64 may land on either side of an F16 rounding boundary (one F16 ulp)
            worst(outs[key], e, (i) => (key === "gelu" ? 2 ** -10 : 1e-6) * (1 + Math.abs(e[i]!))),
            key,
          ).toBeLessThanOrEqual(1);
        }
      });

      for (const dst of ["f32", "f16", "bf16"] as const) {
        it(`cpy into ${dst} rows at an offset (others untouched), slice`, async () => {
          const b = await backend(cfg.opts);
          const rng = new Rng(29);
          const n = 21;
          const R = 6;
          const T = 3;
          const init = rng.bytes(n * R * (dst === "f32" ? 4 : 2));
          if (dst === "f32") {
            const f = new Float32Array(init.buffer);
            for (let i = 0; i < f.length; i++) f[i] = i; // finite values
          }
          const h = b.createTensor(dst, [n, R], init);
          const x = rng.f32(n * T, -70000, 70000);
          x[0] = 1e-7; // subnormal half
          x[1] = 65519; // rounds to 65504
          const g = new Graph();
          const xi = g.input("f32", [n, T], x);
          g.cpy(xi, g.handle(h), 2);
          const sl = g.output(g.slice(xi, 5, 9));
          b.compute(g);
          const out = b.readTensor(h);
          const es = dst === "f32" ? 4 : 2;
          const before = dst === "f32" ? new Uint8Array(new Float32Array(init.buffer).buffer) : init;
          for (let row = 0; row < R; row++) {
            for (let i = 0; i < n; i++) {
              const o = (row * n + i) * es;
              if (row < 2 || row >= 2 + T) {
                expect(out.subarray(o, o + es)).toEqual(before.subarray(o, o + es));
                continue;
              }
              const v = x[(row - 2) * n + i]!;
              if (dst === "f32") expect(new DataView(out.buffer, out.byteOffset).getFloat32(o, true)).toBe(v);
              else {
                const bits = out[o]! | (out[o + 1]! << 8);
                expect(bits).toBe(dst === "f16" ? numberToHalf(v) : numberToBf16(v));
              }
            }
          }
          for (let t = 0; t < T; t++) {
            for (let i = 0; i < 9; i++) expect(sl[t * 9 + i]).toBe(x[t * n + 5 + i]);
          }
          expect(bf16ToNumber(numberToBf16(1))).toBe(1);
          b.freeTensor(h);
        });
      }
    });
  }

  it("mul_mat GEMM columns (llama.cpp's prompt arithmetic): 1 and 2 threads equal the scalar mirror bit for bit, every tile edge", async () => {
    const rng = new Rng(47);
    const bits = (a: Float32Array) => Array.from(new Uint32Array(a.buffer, a.byteOffset, a.length));
    for (const dtype of ["f32", "f16", "bf16", "q8_0"] as DType[]) {
      const k = 256;
      for (const n of [4, 12, 20, 52]) {
        const w = randomWeights(dtype, k, n, rng);
        for (const flags of [
          [1, 1],
          [1, 1, 1],
          [1, 1, 1, 1, 1],
          [1, 1, 0, 1, 1, 1, 1, 0, 0, 1, 1],
          new Array(53).fill(1),
        ]) {
          const t = flags.length;
          const x = rng.f32(k * t, -2, 2);
          const run = async (opts: { threads: number; forceScalar?: boolean }, f: number[]) => {
            const b = await backend(opts);
            const wt = b.createTensor(dtype, [k, n], w.bytes);
            const g = new Graph();
            g.gemmColumns(Int32Array.from(f));
            const y = g.output(g.mulMat(g.handle(wt), g.input("f32", [k, t], x)));
            b.compute(g);
            b.freeTensor(wt);
            return bits(y);
          };
          // GEMM columns: the scalar mirror's values; the others (matrix × vector arithmetic, where the
          // scalar table is not bit-exact for every dtype) the AVX2 table's without flags
          const scalar = await run({ threads: 2, forceScalar: true }, flags);
          const plain = await run({ threads: 1 }, new Array(t).fill(0));
          const expected = scalar.map((v, i) => (flags[Math.floor(i / n)] ? v : plain[i]!));
          const where = `${dtype} n=${n} flags=${flags.join("")}`;
          expect(await run({ threads: 1 }, flags), where).toEqual(expected);
          expect(await run({ threads: 2 }, flags), where).toEqual(expected);
          // float weights: the flags take another arithmetic (differs in the last bits somewhere); Q8_0's
          // matrix × vector dot already sums block by block into one accumulator, as the GEMM does
          if (t === 53 && n === 52 && dtype !== "q8_0") expect(plain, where).not.toEqual(scalar);
        }
      }
    }
  });

  it("Q4_0 and Q4_K repacked (8-row groups, the default) equal the zero-copy kernels and the scalar table bit for bit: mapped and created, every batch shape, after a write", async () => {
    const rng = new Rng(53);
    const bits = (a: Float32Array) => Array.from(new Uint32Array(a.buffer, a.byteOffset, a.length));
    const dir = mkdtempSync(join(tmpdir(), "q4-repack-"));
    try {
      for (const [dtype, k] of [
        ["q4_0", 32],
        ["q4_0", 256],
        ["q4_0", 4096],
        ["q4_K", 256],
        ["q4_K", 4096],
      ] as const) {
        // Q4_K's packed blocks hold decoded scales: 1184 bytes per 8 rows' 1152
        const copyBytes = (bytes: number) => (dtype === "q4_K" ? (bytes / 1152) * 1184 : bytes);
        for (const n of [8, 24, 29]) {
          const w = randomWeights(dtype, k, n, rng);
          const path = join(dir, `w-${dtype}-${k}-${n}.bin`);
          writeFileSync(path, w.bytes);
          for (const flags of [[0], [1, 1], [1, 1, 1, 1, 1], [1, 1, 0, 1, 1, 1, 1, 0, 0]]) {
            const t = flags.length;
            const x = rng.f32(k * t, -2, 2);
            const run = async (opts: { threads: number; forceScalar?: boolean; repack?: boolean }, mapped: boolean) => {
              const b = await backend(opts);
              const wt = mapped
                ? b.mapTensor(dtype, [k, n], { path, fileOffset: 0, byteLength: w.bytes.length })
                : b.createTensor(dtype, [k, n], w.bytes);
              const before = b.allocatedBytes();
              const out: number[][] = [];
              for (let rep = 0; rep < 2; rep++) {
                const g = new Graph();
                if (t > 1) g.gemmColumns(Int32Array.from(flags));
                const y = g.output(g.mulMat(g.handle(wt), g.input("f32", [k, t], x)));
                b.compute(g);
                out.push(bits(y));
              }
              // the copy is made at the first product, once, and counted (8-row multiples only)
              const grew = b.allocatedBytes() - before;
              expect(grew, `${dtype} k=${k} n=${n} ${JSON.stringify(opts)}`).toBe(
                opts.repack === false || n % 8 ? 0 : copyBytes(w.bytes.length),
              );
              b.freeTensor(wt);
              expect(out[1]).toEqual(out[0]);
              return out[0]!;
            };
            const where = `${dtype} k=${k} n=${n} flags=${flags.join("")}`;
            const ref = await run({ threads: 1, forceScalar: true, repack: false }, false);
            for (const opts of [
              { threads: 1 },
              { threads: 2 },
              { threads: 2, repack: false },
              { threads: 2, forceScalar: true },
            ]) {
              expect(await run(opts, false), `${where} ${JSON.stringify(opts)}`).toEqual(ref);
              expect(await run(opts, true), `${where} ${JSON.stringify(opts)} mapped`).toEqual(ref);
            }
          }
        }
      }
      // a write after the copy was made: the next product reads the new bytes
      for (const dtype of ["q4_0", "q4_K"] as const) {
        const k = 256,
          n = 16;
        const b = await backend({ threads: 2 });
        const w1 = randomWeights(dtype, k, n, rng),
          w2 = randomWeights(dtype, k, n, rng);
        const x = rng.f32(k, -2, 2);
        const wt = b.createTensor(dtype, [k, n], w1.bytes);
        const product = (h: number) => {
          const g = new Graph();
          const y = g.output(g.mulMat(g.handle(h), g.input("f32", [k, 1], x)));
          b.compute(g);
          return bits(y);
        };
        const first = product(wt);
        b.writeTensor(wt, w2.bytes);
        const fresh = b.createTensor(dtype, [k, n], w2.bytes);
        const after = product(wt);
        expect(after).toEqual(product(fresh));
        expect(after).not.toEqual(first);
        b.freeTensor(wt);
        b.freeTensor(fresh);
      }
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it("routed experts (mul_mat_id) over repacked Q4_0 and Q4_K stacks equal the zero-copy kernels and the scalar table bit for bit: decode, batches, per-slot inputs", async () => {
    const rng = new Rng(59);
    const bits = (a: Float32Array) => Array.from(new Uint32Array(a.buffer, a.byteOffset, a.length));
    for (const [dtype, k] of [
      ["q4_0", 64],
      ["q4_0", 1024],
      ["q4_K", 512],
    ] as const) {
      const m = 48, // 6 groups of 8 rows per expert: a chunk of 4 groups and a partial one
        nExpert = 5;
      const w = randomWeights(dtype, k, m * nExpert, rng);
      for (const [nUsed, t, perSlot] of [
        [2, 1, false], // decode: each expert has one (slot, token)
        [1, 1, false],
        [2, 7, false], // a batch: experts with several columns (more than 4 on some)
        [3, 5, true],
      ] as const) {
        const x = rng.f32(k * (perSlot ? nUsed * t : t), -2, 2);
        const ids = new Int32Array(nUsed * t);
        for (let c = 0; c < t; c++) {
          const pick = rng.sample(nExpert, nUsed);
          for (let u = 0; u < nUsed; u++) ids[c * nUsed + u] = c < 2 ? u + 1 : pick[u]!; // tokens 0, 1 share experts
        }
        const run = async (opts: { threads: number; forceScalar?: boolean; repack?: boolean }) => {
          const b = await backend(opts);
          const wt = b.createTensor(dtype, [k, m, nExpert], w.bytes);
          const before = b.allocatedBytes();
          const g = new Graph();
          const xi = g.input("f32", perSlot ? [k, nUsed, t] : [k, t], x);
          const y = g.output(g.mulMatId(g.handle(wt), xi, g.input("i32", [nUsed, t], ids)));
          b.compute(g);
          // the whole stack is repacked at the first product (and counted)
          expect(b.allocatedBytes() > before, JSON.stringify(opts)).toBe(opts.repack !== false && !opts.forceScalar);
          b.freeTensor(wt);
          return bits(y);
        };
        const where = `${dtype} k=${k} used=${nUsed} t=${t}${perSlot ? " per-slot" : ""}`;
        const ref = await run({ threads: 1, forceScalar: true, repack: false });
        for (const opts of [{ threads: 1 }, { threads: 2 }, { threads: 2, repack: false }]) {
          expect(await run(opts), `${where} ${JSON.stringify(opts)}`).toEqual(ref);
        }
      }
    }
  });

  it("matvec results are bit-identical at 1 and 2 threads and across runs", async () => {
    const rng = new Rng(31);
    for (const dtype of ["f16", "q4_0", "q4_K"] as DType[]) {
      const k = oddK(dtype, 2);
      const n = 29;
      const w = randomWeights(dtype, k, n, rng);
      const x = rng.f32(k * 3);
      const results: Float32Array[] = [];
      for (const threads of [1, 2, 2]) {
        const b = await backend({ threads });
        const wt = b.createTensor(dtype, [k, n], w.bytes);
        const g = new Graph();
        results.push(g.output(g.mulMat(g.handle(wt), g.input("f32", [k, 3], x))));
        b.compute(g);
        b.freeTensor(wt);
      }
      expect(results[1]).toEqual(results[0]);
      expect(results[2]).toEqual(results[0]);
    }
  });
});
