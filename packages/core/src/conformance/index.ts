/**
 * The backend conformance kit: float64 reference ops, a reference graph interpreter, and
 * {@link runConformance}, which every backend (ours and third parties') runs in its own tests:
 *
 * ```ts
 * import { runConformance, formatConformanceReport } from "@powerinfer/core";
 * const report = await runConformance(await descriptor.load({ threads: 2 }));
 * expect(report.ok, formatConformanceReport(report)).toBe(true);
 * ```
 */
export { bf16ToNumber, halfToNumber, numberToBf16, numberToHalf, roundToHalf } from "./float.js";
export {
  CONFORMANCE_OPS,
  type ConformanceFailure,
  type ConformanceOptions,
  type ConformancePair,
  type ConformanceReport,
  conformanceDtypes,
  formatConformanceReport,
  runConformance,
  WEIGHT_DTYPES,
} from "./kit.js";
export {
  type Dequantized,
  dequantizeReference,
  encodeFloatTensor,
  ConformanceRng,
  randomWeightBytes,
} from "./quant.js";
export {
  type RefAttentionParams,
  type RefExpertShape,
  type RefExpertSparseArgs,
  type ReferenceComputeOptions,
  type ReferenceHandleBytes,
  type ReferenceOpContext,
  type ReferenceOpImpl,
  type ReferenceOpResult,
  type ReferenceResult,
  type RefRopeParams,
  type RefSparseArgs,
  refAttention,
  refAttentionWeights,
  refAxpyIdSparse,
  refAxpySparse,
  refBinary,
  referenceCompute,
  refGelu,
  refGetRows,
  refMulMat,
  refMoeScatter,
  refMoeSum,
  refMulMatId,
  refMulMatIdSparse,
  refMulMatSparse,
  refNorm,
  refRmsNorm,
  refRope,
  refSigmoid,
  refSilu,
  refSoftmax,
  refTopK,
  writeGraphOutputs,
} from "./reference.js";
export {
  ACTIVATION_ROUNDING,
  type ActivationRounding,
  activationErrors,
  dotTolerance,
  exactActivations,
} from "./tolerance.js";
export {
  type ConformancePerfOptions,
  type ConformancePerfReport,
  type ConformancePerfRow,
  formatConformancePerf,
  runConformancePerf,
} from "./perf.js";
