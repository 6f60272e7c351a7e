#!/usr/bin/env bash
# One check of the CUDA backend on a machine with an NVIDIA GPU, in under 8 minutes, ending in one table:
#   1. builds the repository (the CUDA addon for this GPU's architecture only, to keep the build short);
#   2. runs the native tests on the device (ctest: every kernel against a float64 reference, no Node);
#   3. runs core's conformance kit and the shared GPU suite on the device (vitest);
#   4. generates 7B and 13B slices (powerinfer gen-model, PowerInfer format with predictors), profiles
#      them, and decodes with the FFN dense on the CPU, sparse on the CPU, and hybrid (hot neurons on the
#      GPU under a VRAM budget smaller than the model, cold on the CPU), printing tokens/s.
# Usage (from anywhere in the repository): bash packages/backend-cuda/scripts/device-check.sh
# Environment: DEVICE_CHECK_TOKENS (decoded tokens per run, default 32), DEVICE_CHECK_DIR (scratch,
# default /tmp/powerinfer-device-check), DEVICE_CHECK_LAYERS_7B / _13B (slice sizes, default 4 / 3).
# Needs the repository's node_modules (pnpm install, or carried over); without them only step 2 runs.
set -uo pipefail
cd "$(dirname "$0")/../../.."
root=$(pwd)
start=$(date +%s)
budget_s=470
tokens=${DEVICE_CHECK_TOKENS:-32}
scratch=${DEVICE_CHECK_DIR:-/tmp/powerinfer-device-check}
jobs=$(nproc 2>/dev/null || echo 4)
mkdir -p "$scratch"
rows=()
row() { rows+=("$1|$2|$3"); printf '%-44s %-10s %s\n' "$1" "$2" "$3" >&2; }
left() { echo $((budget_s - ($(date +%s) - start))); }
# run a step with what is left of the time budget; its output goes to $scratch/<name>.log
step() {
  local name=$1
  shift
  local t
  t=$(left)
  if [ "$t" -lt 20 ]; then
    echo "skipped (time budget spent)" >"$scratch/$name.log"
    return 124
  fi
  timeout "$t" "$@" >"$scratch/$name.log" 2>&1
}
print_table() {
  echo
  echo "| check | result | details |"
  echo "| --- | --- | --- |"
  for r in "${rows[@]}"; do
    IFS='|' read -r a b c <<<"$r"
    echo "| $a | $b | $c |"
  done
  echo
  echo "device-check: $(($(date +%s) - start)) s; logs in $scratch"
}
trap print_table EXIT

# ---- 0. the GPU ----
if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  row "NVIDIA GPU" "absent" "nvidia-smi finds no GPU: this check needs one"
  exit 2
fi
gpu=$(nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader | head -1)
cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' .')
row "NVIDIA GPU" "found" "$gpu"
export POWERINFER_CUDA_ARCHS="${cc}-real" POWERINFER_NATIVE_JOBS=$jobs POWERINFER_REQUIRE_NATIVE=1
export POWERINFER_BUILD_ROCM=0 TURBO_TELEMETRY_DISABLED=1 DO_NOT_TRACK=1

# ---- 1. build ----
have_node_modules=0
[ -d node_modules/.pnpm ] && [ -x node_modules/.bin/turbo ] && have_node_modules=1
if [ $have_node_modules = 1 ]; then
  if step build node_modules/.bin/turbo run build --filter=@powerinfer/cli... --filter=@powerinfer/backend-cuda --output-logs=errors-only; then
    row "build (CUDA for sm_$cc)" "ok" "$(grep -o 'built powerinfer_cuda.node[^(]*' "$scratch/build.log" | head -1)"
  else
    row "build (CUDA for sm_$cc)" "FAILED" "see $scratch/build.log"
  fi
else
  row "build" "skipped" "no node_modules (run pnpm install); native tests only"
fi

# ---- 2. native tests on the device ----
if step native env POWERINFER_NATIVE_DEVICE=1 node packages/backend-cuda/scripts/test-native.mjs; then
  row "native tests on the GPU (ctest)" "ok" "$(grep -E '^[0-9]+ passed' "$scratch/native.log" | tail -1)"
else
  row "native tests on the GPU (ctest)" "FAILED" "$(grep -E 'FAIL|SKIP|failed' "$scratch/native.log" | head -3 | tr '\n' ' ')"
fi
[ $have_node_modules = 1 ] || exit 1

# ---- 3. conformance kit and GPU suite on the device ----
if step conformance node_modules/.bin/vitest run --project backend-cuda test/cuda.test.ts --reporter verbose; then
  row "conformance kit + GPU suite on cuda" "ok" "$(grep -E 'Tests ' "$scratch/conformance.log" | tail -1 | sed 's/\x1b\[[0-9;]*m//g' | xargs)"
else
  row "conformance kit + GPU suite on cuda" "FAILED" "$(grep -E 'FAIL|×' "$scratch/conformance.log" | head -3 | sed 's/\x1b\[[0-9;]*m//g' | tr '\n' ' ')"
fi

# ---- 4. decode on generated 7B/13B slices: dense CPU vs sparse CPU vs hybrid ----
cli=(node apps/cli/dist/bin.js)
if ! "${cli[@]}" gen-model --help >/dev/null 2>&1; then
  row "decode on 7B/13B slices" "skipped" "powerinfer gen-model is not available in this checkout"
  exit 0
fi
text="$scratch/profile.txt"
for _ in $(seq 1 40); do echo "Once upon a time there was a little robot who liked to count the stars over the hills."; done >"$text"
tps() { grep -E '^ *eval time' "$1" | grep -oE '[0-9.]+ tokens per second' | head -1; }
for preset in 7b 13b; do
  layers=$([ $preset = 7b ] && echo "${DEVICE_CHECK_LAYERS_7B:-4}" || echo "${DEVICE_CHECK_LAYERS_13B:-3}")
  model="$scratch/$preset-slice$layers.pwri.gguf"
  if [ ! -f "$model" ]; then
    if ! step "gen-$preset" "${cli[@]}" gen-model --preset $preset --layers "$layers" --format pwri --dtype F16 -o "$model" --force; then
      row "$preset slice ($layers layers)" "FAILED" "gen-model: see $scratch/gen-$preset.log"
      continue
    fi
  fi
  size_gib=$(awk -v b="$(stat -c %s "$model")" 'BEGIN { printf "%.2f", b / 2^30 }')
  # a VRAM budget of 40 % of the model: the hot neurons must fit, the model does not
  vram=$(awk -v s="$size_gib" 'BEGIN { printf "%.2f", s * 0.4 }')
  step "profile-$preset" "${cli[@]}" profile -m "$model" -f "$text" --tokens 64 --backend cpu -t "$jobs" ||
    row "$preset profile" "FAILED" "see $scratch/profile-$preset.log"
  common=(-m "$model" -p "Once upon a time" -n "$tokens" --temp 0 --ignore-eos -t "$jobs" --backend cpu -c 256)
  if step "dense-$preset" "${cli[@]}" run "${common[@]}" --sparse off --disable-gpu-index; then
    row "$preset×$layers ($size_gib GiB) dense, CPU" "$(tps "$scratch/dense-$preset.log")" "FFN dense on $jobs threads"
  else
    row "$preset×$layers dense, CPU" "FAILED" "see $scratch/dense-$preset.log"
  fi
  if step "sparse-$preset" "${cli[@]}" run "${common[@]}" --sparse predictor --disable-gpu-index; then
    row "$preset×$layers ($size_gib GiB) sparse, CPU only" "$(tps "$scratch/sparse-$preset.log")" "$(grep -oE 'neurons computed per token: [0-9.]+ %' "$scratch/sparse-$preset.log" | head -1)"
  else
    row "$preset×$layers sparse, CPU only" "FAILED" "see $scratch/sparse-$preset.log"
  fi
  if step "hybrid-$preset" "${cli[@]}" run "${common[@]}" --sparse predictor --device-backend cuda --vram-budget "$vram" --reset-gpu-index; then
    row "$preset×$layers ($size_gib GiB) hybrid, GPU budget $vram GiB" "$(tps "$scratch/hybrid-$preset.log")" "$(grep -oE 'hybrid: .*' "$scratch/hybrid-$preset.log" | head -1)"
  else
    row "$preset×$layers hybrid, GPU budget $vram GiB" "FAILED" "$(grep -iE 'error|unavailable' "$scratch/hybrid-$preset.log" | head -2 | tr '\n' ' ')"
  fi
done
