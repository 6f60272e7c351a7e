/**
 * A layer's activation predictor, as PowerInfer (Song et al. 2023) runs it after Deja Vu (Liu et al.
 * 2023, "Deja Vu: Contextual Sparsity for Efficient LLMs at Inference Time"): a two-layer MLP without
 * biases from the FFN input x (n_embd) to one logit per FFN neuron,
 *
 *     z = fc2 · ReLU(fc1 · x),   neuron i is computed iff z_i ≥ threshold.
 *
 * Storage, float32 row-major: `fc1` is [rank × n_embd] (row j = hidden unit j; GGUF `blk.N.fc1.weight`
 * ne {n_embd, rank}), `fc2` is [n_ff × rank] (row i = neuron i; GGUF `blk.N.fc2.weight` ne {rank, n_ff}).
 */
import { f16ToF32, f32ToF16 } from "@powerinfer/gguf";
import { type MatMul, transpose } from "./matmul.js";
import { Rng } from "./rng.js";

/** One layer's predictor weights. */
export interface LayerPredictor {
  rank: number;
  nEmbd: number;
  nFf: number;
  /** [rank × nEmbd] float32. */
  fc1: Float32Array;
  /** [nFf × rank] float32. */
  fc2: Float32Array;
}

/** Multiply-adds per token of a rank-r predictor: r·(n_embd + n_ff). */
export function predictorCost(rank: number, nEmbd: number, nFf: number): number {
  return rank * (nEmbd + nFf);
}

/** Rounds every element to the nearest F16 value (kept as float32), in place. */
export function roundF16InPlace(a: Float32Array): Float32Array {
  for (let i = 0; i < a.length; i++) a[i] = f16ToF32(f32ToF16(a[i]!));
  return a;
}

/**
 * Logits for `n` tokens: `z[t·nFf + i]` ([n × nFf] token-major) from inputs `x` ([n × nEmbd]).
 * Works in blocks of `block` tokens to bound memory. With `f16Activations` the input and the hidden
 * activations are rounded to F16 before each product, as the CPU backend does for F16 weights — use it
 * to calibrate and evaluate predictors that will be stored as F16.
 */
export function predictLogits(
  p: LayerPredictor,
  x: Float32Array,
  n: number,
  mm: MatMul,
  opts: { out?: Float32Array; block?: number; f16Activations?: boolean } = {},
): Float32Array {
  const z = opts.out ?? new Float32Array(n * p.nFf);
  const block = opts.block ?? 1024;
  const h = new Float32Array(Math.min(block, n) * p.rank);
  const xr = opts.f16Activations ? new Float32Array(Math.min(block, n) * p.nEmbd) : undefined;
  for (let t0 = 0; t0 < n; t0 += block) {
    const m = Math.min(block, n - t0);
    const hv = h.subarray(0, m * p.rank);
    let xv = x.subarray(t0 * p.nEmbd, (t0 + m) * p.nEmbd);
    if (xr) {
      const r = xr.subarray(0, xv.length);
      r.set(xv);
      xv = roundF16InPlace(r);
    }
    mm.gemmNT(xv, p.fc1, m, p.rank, p.nEmbd, hv);
    for (let i = 0; i < hv.length; i++) if (!(hv[i]! > 0)) hv[i] = 0;
    if (xr) roundF16InPlace(hv);
    mm.gemmNT(hv, p.fc2, m, p.nFf, p.rank, z.subarray(t0 * p.nFf, (t0 + m) * p.nFf));
  }
  return z;
}

/** A copy with both matrices rounded to F16 and back (what an F16 file holds). */
export function roundPredictorF16(p: LayerPredictor): LayerPredictor {
  return { ...p, fc1: roundF16InPlace(p.fc1.slice()), fc2: roundF16InPlace(p.fc2.slice()) };
}

/** He-style random initialisation: fc1 ~ N(0, 2/n_embd), fc2 ~ N(0, 1/rank). */
export function randomPredictor(rank: number, nEmbd: number, nFf: number, seed: number): LayerPredictor {
  const rng = new Rng(seed);
  const fc1 = new Float32Array(rank * nEmbd);
  const fc2 = new Float32Array(nFf * rank);
  const s1 = Math.sqrt(2 / nEmbd);
  const s2 = Math.sqrt(1 / rank);
  for (let i = 0; i < fc1.length; i++) fc1[i] = rng.normal() * s1;
  for (let i = 0; i < fc2.length; i++) fc2[i] = rng.normal() * s2;
  return { rank, nEmbd, nFf, fc1, fc2 };
}

/**
 * The data-aware principal subspace of a layer's gate, from which {@link gatePredictor} builds
 * predictors of any rank up to 2·`k`.
 */
export interface GateSubspace {
  nEmbd: number;
  nFf: number;
  /** Directions kept, in order of importance. */
  k: number;
  /** [k × nEmbd]: row j = the input direction p_j (already divided by the mean rms(x)). */
  p: Float64Array;
  /** [nFf × k]: column j = the orthonormal neuron-space direction q_j. */
  q: Float64Array;
  /** Eigenvalues of W'·C·W'ᵀ (C = E[x xᵀ] over the samples) for the k directions (descending): the gate variance each explains. */
  values: Float64Array;
}

/**
 * The rank-k approximation of a layer's gate that is best on the data — the warm start that makes a few
 * epochs of training enough.
 *
 * For a Llama-style FFN the gate is W_gate·(ffn_norm ⊙ x / rms(x)); rms(x) > 0 does not change its
 * sign, so neuron i fires iff (W'x)_i > 0 with W' = W_gate·diag(ffn_norm) [nFf × nEmbd] — a linear
 * function of the predictor's input x. The best rank-k approximation of W'x over the samples in the
 * least-squares sense is Q_k Q_kᵀ W'x, with Q_k the top-k left singular vectors of the gate's outputs on
 * the samples, G = W'·Xᵀ [nFf × ns] (Eckart–Young), i.e. the top eigenvectors of W'·C·W'ᵀ, C = E[x xᵀ].
 *
 * They are found in sample space, where the numbers stay in the gate's own units: with S = GᵀG
 * [ns × ns], Q = G·V is orthonormal iff VᵀSV = I, and G Gᵀ·GV = G·(S·V), so simultaneous (subspace)
 * iteration V ← S·V with S-orthonormalisation (modified Gram–Schmidt in float64, which keeps the
 * columns in order of convergence) converges to them. Working with W'ᵀW' and C separately would not
 * do: residual streams carry "massive activations" (Sun et al. 2024) — one channel ~10³× the others —
 * which puts the two matrices' eigenvalues 10¹⁰ apart, beyond float32, and the iteration then keeps
 * the massive direction and noise (seen on 7B-shaped layers: sign agreement 0.5). G itself is
 * well-scaled: it is the gate's pre-activations. The large products run on `mm` in float32.
 * Cost O(ns·nFf·nEmbd + ns²·nFf + iterations·ns²·k), ns = min(n, 4096).
 * @param gate W_gate (or W_up for an ungated FFN) [nFf × nEmbd] float32 row-major
 * @param norm ffn_norm weights [nEmbd] (undefined: all ones)
 * @param x sample FFN inputs [n × nEmbd] (at most 4096 of them, evenly spaced, are used)
 * @param kWanted directions to keep, ≤ nEmbd. Fewer are returned (`k` of the result) when the gate on
 *   the data spans fewer: e.g. with fewer sample positions than `kWanted`, G has rank < `kWanted`.
 * @throws RangeError when `kWanted` is outside [1, nEmbd], or the gate is zero on every sample
 */
export function gateSubspace(
  gate: Float32Array,
  norm: Float32Array | undefined,
  x: Float32Array,
  n: number,
  nEmbd: number,
  nFf: number,
  kWanted: number,
  mm: MatMul,
  seed = 1,
  iterations = 12,
): GateSubspace {
  const e = nEmbd;
  if (!(kWanted >= 1 && kWanted <= e)) throw new RangeError(`subspace size ${kWanted} must be in [1, n_embd ${e}]`);
  if (!(n >= 1)) throw new RangeError("gate subspace: no samples");
  const w = new Float32Array(nFf * e);
  for (let i = 0; i < nFf; i++) for (let c = 0; c < e; c++) w[i * e + c] = gate[i * e + c]! * (norm ? norm[c]! : 1);
  // ≤ 4096 evenly spaced samples and their mean rms(x)
  const ns = Math.min(n, 4096);
  const xs = new Float32Array(ns * e);
  let rmsSum = 0;
  for (let s = 0; s < ns; s++) {
    const t = Math.floor((s * n) / ns);
    let sq = 0;
    for (let c = 0; c < e; c++) {
      const v = x[t * e + c]!;
      xs[s * e + c] = v;
      sq += v * v;
    }
    rmsSum += Math.sqrt(sq / e);
  }
  const scale = rmsSum > 0 ? ns / rmsSum : 1;
  const gt = mm.gemmNT(xs, w, ns, nFf, e); // Gᵀ [ns × nFf]: the gate's pre-activations per sample
  const ss = mm.gemmNT(gt, gt, ns, ns, nFf); // S = GᵀG [ns × ns], symmetric
  const ss64 = Float64Array.from(ss);
  let traceS = 0;
  for (let i = 0; i < ns; i++) traceS += ss64[i * ns + i]!;

  // V is kept transposed, vt [k×ns] (row j = column j of V); (S·V)ᵀ = Vᵀ·S = gemmNT(vt, S) since S is
  // symmetric, kept as svt.
  const rng = new Rng(seed);
  let k = Math.min(kWanted, ns);
  let vt: Float32Array = new Float32Array(k * ns);
  for (let i = 0; i < vt.length; i++) vt[i] = rng.normal();
  let svt = mm.gemmNT(vt, ss, k, ns, ns);
  // S-orthonormalisation by modified Gram–Schmidt, twice ("twice is enough"), in float64 on vt and S·V
  // together (the same row operations keep svt = (S·V)ᵀ). A column that vanishes (dependent on the
  // previous ones) is replaced by a fresh random one; when direction j keeps vanishing (the samples span
  // fewer than k directions of the gate), the subspace stops at j directions, which is returned.
  const orthonormalize = (): number => {
    const v64 = Float64Array.from(vt);
    const sv64 = Float64Array.from(svt);
    const dot = (a: Float64Array, ao: number, b: Float64Array, bo: number) => {
      let s = 0;
      for (let c = 0; c < ns; c++) s += a[ao + c]! * b[bo + c]!;
      return s;
    };
    for (let j = 0; j < k; j++) {
      const rj = j * ns;
      for (let attempt = 0; ; attempt++) {
        for (let pass = 0; pass < 2; pass++) {
          for (let p = 0; p < j; p++) {
            const rp = p * ns;
            const c = dot(v64, rj, sv64, rp);
            for (let x = 0; x < ns; x++) {
              v64[rj + x]! -= c * v64[rp + x]!;
              sv64[rj + x]! -= c * sv64[rp + x]!;
            }
          }
        }
        const nrm2 = dot(v64, rj, sv64, rj);
        // vanished: its Rayleigh quotient is a negligible share of the gate's total variance (trace S);
        // relative to its own size before the projection it can be tiny for a real direction, since S·V
        // pulls every column towards the dominant ones
        if (nrm2 > 1e-10 * traceS * dot(v64, rj, v64, rj) && Number.isFinite(nrm2)) {
          const d = 1 / Math.sqrt(nrm2);
          for (let x = 0; x < ns; x++) {
            v64[rj + x]! *= d;
            sv64[rj + x]! *= d;
          }
          break;
        }
        if (attempt > 3) {
          if (j === 0) throw new RangeError("gate subspace: the gate is zero on the data (ffn_gate degenerate)");
          vt = Float32Array.from(v64.subarray(0, j * ns));
          svt = Float32Array.from(sv64.subarray(0, j * ns));
          return j;
        }
        for (let x = 0; x < ns; x++) v64[rj + x] = rng.normal();
        for (let x = 0; x < ns; x++) sv64[rj + x] = dot(ss64, x * ns, v64, rj);
      }
    }
    vt.set(v64);
    svt.set(sv64);
    return k;
  };
  k = orthonormalize();
  for (let it = 0; it < iterations; it++) {
    vt = svt; // V ← S·V
    svt = mm.gemmNT(vt, ss, k, ns, ns);
    k = orthonormalize();
  }
  // gate variance per direction: ‖S·v_j‖² for S-orthonormal v_j is the squared singular value σ_j² of
  // G; directions are sorted by it so that the first k' of them serve a smaller rank
  const ray = new Float64Array(k);
  for (let j = 0; j < k; j++) {
    let s = 0;
    for (let c = 0; c < ns; c++) s += svt[j * ns + c]! ** 2;
    ray[j] = s;
  }
  const order = Array.from({ length: k }, (_, j) => j).sort((a, b) => ray[b]! - ray[a]!);
  // Directions with σ² below 1e-5 of the largest are float32 rounding of S, not the gate: Q = G·v/σ
  // would amplify that noise. They are dropped (S has rank < k: fewer samples or a low-rank gate).
  const floor = ray[order[0]!]! * 1e-5;
  while (k > 1 && !(ray[order[k - 1]!]! > floor)) k--;
  order.length = k;
  const vs = new Float32Array(k * ns);
  const values = new Float64Array(k);
  order.forEach((src, j) => {
    vs.set(vt.subarray(src * ns, (src + 1) * ns), j * ns);
    values[j] = ray[src]! / ns;
  });
  // Q = G·V = W'·(Xᵀ·V): yt = (XᵀV)ᵀ [k×e], q = gemmNT(W', yt) [nFf×k]
  const yt = mm.gemmNT(vs, transpose(xs, ns, e), k, e, ns);
  const q32 = mm.gemmNT(w, yt, nFf, k, e);
  // P = QᵀW' [k×e] (times the mean 1/rms(x), see gatePredictor)
  const p32 = mm.gemmNT(transpose(q32, nFf, k), transpose(w, nFf, e), k, e, nFf);
  const p = new Float64Array(k * e);
  for (let i = 0; i < p.length; i++) p[i] = p32[i]! * scale;
  return { nEmbd: e, nFf, k, p, q: Float64Array.from(q32), values };
}

/**
 * A predictor of even `rank` = 2·k' (k' ≤ subspace.k) that computes the subspace's rank-k'
 * approximation of the gate (in units of the gate, times `logitScale`) exactly, through the ReLU, with
 * the pair identity ReLU(u) − ReLU(−u) = u: fc1 = [P; −P], fc2 = [Q, −Q]. Training then moves it away
 * from this linear solution.
 *
 * When the subspace has fewer than rank/2 directions (see {@link gateSubspace}), the first 2·sub.k rows
 * come from the gate and the remaining `rank − 2·sub.k` hidden units start random (fc1 rows as in
 * {@link randomPredictor}, seeded by `seed`; their fc2 columns 0, so the start still computes the gate's
 * approximation); {@link gateDirectionsUsed} tells how many came from the gate.
 * @throws RangeError when `rank` is odd or < 2
 */
export function gatePredictor(sub: GateSubspace, rank: number, logitScale = 1, seed = 1): LayerPredictor {
  if (rank % 2 !== 0 || rank < 2) throw new RangeError(`rank ${rank} must be even and ≥ 2`);
  const k = gateDirectionsUsed(sub, rank);
  const { nEmbd: e, nFf } = sub;
  const fc1 = new Float32Array(rank * e);
  if (2 * k < rank) {
    const rng = new Rng(seed);
    const s1 = Math.sqrt(2 / e);
    for (let i = 2 * k * e; i < fc1.length; i++) fc1[i] = rng.normal() * s1;
  }
  for (let j = 0; j < k; j++) {
    for (let c = 0; c < e; c++) {
      fc1[j * e + c] = sub.p[j * e + c]!;
      fc1[(j + k) * e + c] = -sub.p[j * e + c]!;
    }
  }
  const fc2 = new Float32Array(nFf * rank);
  for (let i = 0; i < nFf; i++) {
    for (let j = 0; j < k; j++) {
      const v = sub.q[i * sub.k + j]! * logitScale;
      fc2[i * rank + j] = v;
      fc2[i * rank + j + k] = -v;
    }
  }
  return { rank, nEmbd: e, nFf, fc1, fc2 };
}

/** Gate directions a {@link gatePredictor} of `rank` uses: min(rank/2, sub.k). */
export function gateDirectionsUsed(sub: GateSubspace, rank: number): number {
  return Math.min(Math.floor(rank / 2), sub.k);
}

/**
 * The logit scale s > 0 minimising the weighted cross-entropy L(s) = Σ ℓ(s·z, y) of the samples (see
 * train.ts for ℓ). L is convex in s (ℓ is convex in its first argument, s·z is linear in s), so
 * safeguarded Newton steps from s = 1 find it: L'(s) = Σ z·(σ(sz)·(1−y) − w₊·y·(1−σ(sz))),
 * L''(s) = Σ z²·σ(sz)(1−σ(sz))·(y ? w₊ : 1). The gate-derived logits are in the gate's units, far too
 * small for a sigmoid: at the wrong scale every sample looks uncertain and gradient steps undo the warm
 * start.
 */
export function fitLogitScale(z: Float32Array, masks: Uint8Array, n: number, nFf: number, posWeight: number): number {
  const stride = (nFf + 7) >> 3;
  for (let i = 0; i < n * nFf; i++) if (!Number.isFinite(z[i]!)) throw new RangeError("logits are not finite");
  const derivs = (scale: number): [number, number] => {
    let d1 = 0;
    let d2 = 0;
    for (let t = 0; t < n; t++) {
      for (let i = 0; i < nFf; i++) {
        const zi = z[t * nFf + i]!;
        const a = scale * zi;
        const ex = Math.exp(-Math.abs(a));
        const sig = a >= 0 ? 1 / (1 + ex) : ex / (1 + ex);
        const h = zi * zi * sig * (1 - sig);
        if ((masks[t * stride + (i >> 3)]! >> (i & 7)) & 1) {
          d1 -= posWeight * zi * (1 - sig);
          d2 += posWeight * h;
        } else {
          d1 += zi * sig;
          d2 += h;
        }
      }
    }
    return [d1, d2];
  };
  let s = 1;
  let lo = 0;
  let hi = Number.POSITIVE_INFINITY;
  for (let it = 0; it < 40; it++) {
    const [d1, d2] = derivs(s);
    if (d1 > 0) hi = s;
    else lo = s;
    let next = d2 > 0 ? s - d1 / d2 : d1 > 0 ? s / 2 : s * 2;
    // keep inside the bracket; bisect (geometrically) when Newton leaves it
    if (!(next > lo && next < hi)) next = Number.isFinite(hi) ? (lo > 0 ? Math.sqrt(lo * hi) : hi / 2) : s * 4;
    if (Math.abs(next - s) <= 1e-4 * s) return next;
    s = next;
  }
  return s;
}
