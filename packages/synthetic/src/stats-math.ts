/**
 * Small numerical helpers of the synthetic-model generator: the normal distribution and the power-law
 * firing frequencies of FFN neurons.
 */

/** Complementary error function (Numerical Recipes' Chebyshev fit, |relative error| < 1.2e-7). */
export function erfc(x: number): number {
  const z = Math.abs(x);
  const t = 1 / (1 + 0.5 * z);
  const r =
    t *
    Math.exp(
      -z * z -
        1.26551223 +
        t *
          (1.00002368 +
            t *
              (0.37409196 +
                t *
                  (0.09678418 +
                    t *
                      (-0.18628806 +
                        t *
                          (0.27886807 + t * (-1.13520398 + t * (1.48851587 + t * (-0.82215223 + t * 0.17087277)))))))),
    );
  return x >= 0 ? r : 2 - r;
}

/** Standard normal CDF Φ(x). */
export function normalCdf(x: number): number {
  return 0.5 * erfc(-x / Math.SQRT2);
}

/** Standard normal density φ(x). */
export function normalPdf(x: number): number {
  return Math.exp(-0.5 * x * x) / Math.sqrt(2 * Math.PI);
}

/**
 * Inverse standard normal CDF Φ⁻¹(p) for p in (0, 1): Acklam's rational approximation (relative
 * error 1.15e-9) refined by one Halley step.
 */
export function normalQuantile(p: number): number {
  if (!(p > 0 && p < 1)) throw new RangeError(`normalQuantile: p must be in (0, 1), got ${p}`);
  const a = [
    -39.69683028665376, 220.9460984245205, -275.9285104469687, 138.357751867269, -30.66479806614716, 2.506628277459239,
  ];
  const b = [-54.47609879822406, 161.5858368580409, -155.6989798598866, 66.80131188771972, -13.28068155288572];
  const c = [
    -0.007784894002430293, -0.3223964580411365, -2.400758277161838, -2.549732539343734, 4.374664141464968,
    2.938163982698783,
  ];
  const d = [0.007784695709041462, 0.3224671290700398, 2.445134137142996, 3.754408661907416];
  const lo = 0.02425;
  let x: number;
  if (p < lo) {
    const q = Math.sqrt(-2 * Math.log(p));
    x =
      (((((c[0]! * q + c[1]!) * q + c[2]!) * q + c[3]!) * q + c[4]!) * q + c[5]!) /
      ((((d[0]! * q + d[1]!) * q + d[2]!) * q + d[3]!) * q + 1);
  } else if (p <= 1 - lo) {
    const q = p - 0.5;
    const r = q * q;
    x =
      ((((((a[0]! * r + a[1]!) * r + a[2]!) * r + a[3]!) * r + a[4]!) * r + a[5]!) * q) /
      (((((b[0]! * r + b[1]!) * r + b[2]!) * r + b[3]!) * r + b[4]!) * r + 1);
  } else {
    const q = Math.sqrt(-2 * Math.log(1 - p));
    x =
      -(((((c[0]! * q + c[1]!) * q + c[2]!) * q + c[3]!) * q + c[4]!) * q + c[5]!) /
      ((((d[0]! * q + d[1]!) * q + d[2]!) * q + d[3]!) * q + 1);
  }
  // Halley refinement (only where erfc is accurate enough to help)
  if (p > 1e-6 && p < 1 - 1e-6) {
    const e = normalCdf(x) - p;
    const u = e * Math.sqrt(2 * Math.PI) * Math.exp(0.5 * x * x);
    x = x - u / (1 + 0.5 * x * u);
  }
  return x;
}

/** E[ReLU(b + z)²] for z ~ N(0, 1). */
export function reluSecondMoment(b: number): number {
  return (b * b + 1) * normalCdf(b) + b * normalPdf(b);
}

/** Options of {@link powerLawFrequencies}. */
export interface PowerLawOptions {
  /** Mean firing frequency (the fraction of neurons active per token), in (0, pMax). */
  mean: number;
  /** Share of neurons (the most active ones) that account for `cover` of all activations, in (0, 1). */
  hotShare: number;
  /** Share of activations the hot neurons account for (default 0.8). */
  cover?: number;
  /** Largest firing frequency of a neuron (default 0.99). */
  pMax?: number;
}

/**
 * Per-neuron firing frequencies, most active first: p_k = min(pMax, C·((k + ½)/n)^(−a)), with C and the
 * exponent a solved so that the mean is `mean` and the top `hotShare` of the neurons carry `cover` of
 * the activations (a Zipf-like law, as measured on ReLU LLMs by PowerInfer, Song et al. 2023).
 * @throws RangeError when no such law exists (e.g. the hot neurons would need frequencies above pMax)
 */
export function powerLawFrequencies(n: number, opts: PowerLawOptions): Float64Array {
  const { mean, hotShare } = opts;
  const cover = opts.cover ?? 0.8;
  const pMax = opts.pMax ?? 0.99;
  if (!(mean > 0 && mean < pMax)) throw new RangeError(`active fraction must be in (0, ${pMax}), got ${mean}`);
  if (!(hotShare > 0 && hotShare < 1)) throw new RangeError(`hot share must be in (0, 1), got ${hotShare}`);
  if (!(cover > hotShare && cover < 1)) {
    throw new RangeError(
      `the hot ${hotShare * 100} % of neurons must cover more than that share of activations (got ${cover})`,
    );
  }
  const p = new Float64Array(n);
  const w = new Float64Array(n);
  const logU = Float64Array.from({ length: n }, (_, k) => Math.log((k + 0.5) / n));
  const nHot = Math.max(1, Math.round(hotShare * n));
  const suffix = new Float64Array(n + 1);
  /**
   * p for exponent a, with C solved so the mean is `mean`: w is decreasing, so the capped neurons are a
   * prefix k < j and C = (n·mean − j·pMax) / Σ_{k≥j} w_k for the j where that C caps exactly that prefix.
   */
  const solve = (a: number) => {
    for (let k = 0; k < n; k++) w[k] = Math.exp(-a * logU[k]!);
    suffix[n] = 0;
    for (let k = n - 1; k >= 0; k--) suffix[k] = suffix[k + 1]! + w[k]!;
    let C = mean / (suffix[0]! / n);
    for (let j = 0; j < n; j++) {
      C = (n * mean - j * pMax) / suffix[j]!;
      if (C * w[j]! <= pMax) break;
    }
    for (let k = 0; k < n; k++) p[k] = Math.min(pMax, C * w[k]!);
  };
  const share = (a: number) => {
    solve(a);
    let hot = 0;
    let all = 0;
    for (let k = 0; k < n; k++) {
      if (k < nHot) hot += p[k]!;
      all += p[k]!;
    }
    return hot / all;
  };
  let lo = 0;
  let hi = 8;
  if (share(hi) < cover) {
    throw new RangeError(
      `no power law has mean ${mean} with the top ${hotShare * 100} % of ${n} neurons covering ${cover * 100} % of activations (frequencies are capped at ${pMax})`,
    );
  }
  for (let it = 0; it < 50; it++) {
    const mid = 0.5 * (lo + hi);
    if (share(mid) < cover) lo = mid;
    else hi = mid;
  }
  share(hi);
  return p;
}

/**
 * The smallest share of neurons that accounts for `cover` of the activations, given per-neuron
 * activation counts or frequencies.
 */
export function hotNeuronShare(counts: ArrayLike<number>, cover = 0.8): number {
  const s = Array.from(counts).sort((a, b) => b - a);
  const total = s.reduce((a, b) => a + b, 0);
  if (total === 0) return 0;
  let acc = 0;
  for (let k = 0; k < s.length; k++) {
    acc += s[k]!;
    if (acc >= cover * total - 1e-9 * total) return (k + 1) / s.length;
  }
  return 1;
}
