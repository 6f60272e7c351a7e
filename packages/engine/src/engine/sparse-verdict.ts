/**
 * Whether a model can run sparse, and why (what `powerinfer inspect` and the CLI's notes say): from the
 * file's metadata and its parsed configuration, no tensor data read.
 */
import { type GgufFile, type ModelConfig, notAModelReason } from "@powerinfer/gguf";

/** Whether and how the file can use sparse inference. */
export type SparseVerdict =
  /** ReLU FFN and predictors in every layer. */
  | "sparse"
  /** ReLU FFN but no predictors: sparse after `train-predictor`, or in oracle mode. */
  | "needs-predictor"
  /** Non-ReLU FFN: runs dense. */
  | "dense"
  /** Not a runnable model (vocab-only file, GPU index, unsupported architecture). */
  | "not-a-model";

/** The sparse-inference verdict for a file and its configuration. */
export function sparseVerdict(
  file: GgufFile,
  config: ModelConfig | null,
  configError: string | null,
): { verdict: SparseVerdict; reason: string } {
  const arch = file.metadata.get("general.architecture");
  if (arch === "generic.gpu_index") {
    return { verdict: "not-a-model", reason: "a PowerInfer GPU index (neuron placement plan), not a model" };
  }
  const notAModel = notAModelReason(file);
  if (notAModel) return { verdict: "not-a-model", reason: notAModel };
  if (!config) return { verdict: "not-a-model", reason: `cannot run this file: ${configError}` };
  const act = config.ffn.up_activation
    ? `ReLU(gate)·ReLU(up)`
    : config.ffn.gated
      ? `${config.ffn.activation}(gate)·up`
      : `${config.ffn.activation}(up)`;
  if (config.moe && config.ffn.activation === "relu") {
    if (config.has_predictors) {
      const ranks = [...new Set(config.predictor_ranks)].join("/");
      return {
        verdict: "sparse",
        reason: `can run sparse: ReLU-gated experts (${act}) with per-expert predictors in ${config.n_layer === 1 ? "its one layer" : `all ${config.n_layer} layers`} (rank ${ranks}), threshold ${config.sparse_threshold}`,
      };
    }
    return {
      verdict: "needs-predictor",
      reason: `ReLU-gated experts (${act}): within the chosen experts neurons fire sparsely; runs sparse in oracle mode (--sparse oracle, the exact active set), or in predictor mode after \`powerinfer train-predictor\` (per-expert predictors)`,
    };
  }
  if (config.ffn.activation !== "relu") {
    return {
      verdict: "dense",
      reason: `will run dense: its FFN activation is ${config.ffn.activation.toUpperCase()} (${act}), whose outputs are rarely exactly zero — a dense model gains nothing from sparse inference`,
    };
  }
  if (config.has_predictors) {
    const ranks = [...new Set(config.predictor_ranks)].join("/");
    return {
      verdict: "sparse",
      reason: `can run sparse: ReLU FFN (${act}) with activation predictors in ${config.n_layer === 1 ? "its one layer" : `all ${config.n_layer} layers`} (rank ${ranks}), threshold ${config.sparse_threshold}`,
    };
  }
  return {
    verdict: "needs-predictor",
    reason: `ReLU FFN (${act}) without predictors: can run sparse after \`powerinfer train-predictor\` (or in oracle mode, which computes the exact active set); until then it runs dense`,
  };
}
