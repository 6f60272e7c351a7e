#!/usr/bin/env bash
# powerinfer-ts device kit: checks the GPU backends on a machine that has a GPU but no Node, no npm and
# no network. Everything it runs is in this folder: a Node binary (node.xz), the CLI and the checks as
# plain JavaScript (js/), the native addons and native test binaries (build/Release, bin/), small models
# (models/). Larger models are generated here with `powerinfer gen-model`.
#
# usage: run.sh [--quick] [--cpu] [--rocm] [--out DIR] [--keep]
#   --quick  steps 1-4 and one 7B hybrid row (under 2 minutes on 16 cores)
#   --cpu    no GPU: steps 3-6 on the CPU (conformance on the CPU backend, the GPU suite and logits on
#            the SIMT emulator, the CPU standing in for the device in hybrid rows)
#   --rocm   an AMD GPU through the ROCm backend (a kit built with `build-kit.mjs --rocm`)
#   --out    folder for the table (table.md), the rows as they end (rows.tsv) and each step's log (logs/)
#   --keep   keep the scratch folder (unpacked node, generated models)
# Environment: KIT_BUDGET_S (seconds for all steps; default 290, --quick 110, --cpu 840),
#   KIT_TOKENS (decoded tokens per speed row, default 32), KIT_LAYERS (layers of the generated slices, 4).
# Each step is time-boxed and prints its row as soon as it ends; a failed step says why and the rest runs.
# Exit status: 0 when no step failed, 1 otherwise, 2 for bad usage, 130 when interrupted.
# (end of usage)
[ -n "${BASH_VERSION:-}" ] || exec bash "$0" "$@"
set -uo pipefail
kit=$(cd "$(dirname "$0")" && pwd)
quick=0
cpu=0
gpu=cuda
out=""
keep=0
usage() { sed -n '2,/^# (end of usage)/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; }
die() {
  echo "run.sh: $1" >&2
  exit 2
}
while [ $# -gt 0 ]; do
  case $1 in
  --quick) quick=1 ;;
  --cpu) cpu=1 ;;
  --rocm) gpu=rocm ;;
  --keep) keep=1 ;;
  --out)
    [ $# -ge 2 ] && [ -n "$2" ] && [ "${2#-}" = "$2" ] || die "--out needs a folder"
    out=$2
    shift
    ;;
  --out=*) out=${1#--out=} ;;
  -h | --help) usage; exit 0 ;;
  *) echo "run.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done

start=$(date +%s)
if [ -n "${KIT_BUDGET_S:-}" ]; then budget=$KIT_BUDGET_S
elif [ $cpu = 1 ]; then budget=840
elif [ $quick = 1 ]; then budget=110
else budget=290; fi
tokens=${KIT_TOKENS:-32}
layers=${KIT_LAYERS:-4}
[[ $budget =~ ^[1-9][0-9]*$ ]] || die "KIT_BUDGET_S must be a positive whole number of seconds, got '$budget'"
[[ $tokens =~ ^[1-9][0-9]*$ ]] || die "KIT_TOKENS must be a positive whole number, got '$tokens'"
[[ $layers =~ ^[1-9][0-9]*$ ]] || die "KIT_LAYERS must be a positive whole number, got '$layers'"
jobs=$(nproc 2>/dev/null || echo 4)
rows=()
failed=0
scratch=""
tmp=${TMPDIR:-/tmp}
[ -d "$tmp" ] && [ -w "$tmp" ] || die "the temporary folder '$tmp' (TMPDIR) does not exist or is not writable"
server_pid=""
smi_pid=""
step_pid=""
cleanup() {
  # a step still running (Ctrl-C, a kill, a closed pipe) is stopped with the script
  [ -n "$step_pid" ] && kill -TERM "$step_pid" 2>/dev/null
  [ -n "$server_pid" ] && kill "$server_pid" 2>/dev/null
  [ -n "$smi_pid" ] && kill "$smi_pid" 2>/dev/null
  [ -n "$scratch" ] || return 0
  if [ $keep = 1 ]; then echo "scratch kept: $scratch"; else rm -rf "$scratch"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM HUP PIPE
scratch=$(mktemp -d "$tmp/powerinfer-kit.XXXXXX") || die "cannot make a scratch folder in '$tmp'"
# the results outlive the scratch folder: without --out they go to a folder of their own
[ -n "$out" ] || out=$(mktemp -d "$tmp/powerinfer-kit-out.XXXXXX") || die "cannot make an output folder in '$tmp'"
mkdir -p "$out/logs" 2>/dev/null || die "cannot create the output folder '$out/logs'"
out=$(cd "$out" && pwd) || die "cannot enter the output folder"
: >"$out/rows.tsv" 2>/dev/null || die "cannot write in the output folder '$out'"


now() { date +%s; }
left() { echo $((budget - ($(now) - start))); }
# row NAME STATUS DETAIL SECONDS: printed as soon as a step ends, and appended to rows.tsv
row() {
  local d=${3//|/\/}
  d=${d//$'\n'/ }
  rows+=("$1|$2|$d|$4")
  printf '%-34s %-5s %5ss  %s\n' "$1" "$2" "$4" "$d"
  printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$d" "$4" >>"$out/rows.tsv"
  [ "$2" = FAIL ] && failed=1
  return 0
}
# run LOG CAP CMD...: CMD with at most min(CAP, what is left of the budget) seconds, output to logs/LOG.log
run() {
  local log=$out/logs/$1.log cap=$2 t
  shift 2
  t=$(left)
  [ "$cap" -lt "$t" ] && t=$cap
  if [ "$t" -lt 5 ]; then
    echo "not run: the time budget ($budget s) is spent" >"$log"
    return 125
  fi
  timeout -k 5 "$t" "$@" >"$log" 2>&1 &
  step_pid=$!
  local rc=0
  wait "$step_pid" || rc=$?
  step_pid=""
  return $rc
}
# the RESULT line a check printed (a check without one failed, whatever its exit status)
result_of() { grep -E '^RESULT ' "$out/logs/$1.log" 2>/dev/null | tail -1 | cut -d' ' -f2-; }
status_of() {
  local r
  r=$(result_of "$2")
  if [ -n "$r" ] && [ "$1" != 124 ] && [ "$1" != 137 ]; then echo "${r%% *}"; else echo FAIL; fi
}
# why a step failed: the budget, the time box, or the first error line of its log
why() {
  local rc=$1 log=$out/logs/$2.log line
  case $rc in
  125) echo "not run: the time budget ($budget s) was spent"; return ;;
  124 | 137) echo "timed out (see logs/$2.log)"; return ;;
  esac
  line=$(grep -m1 -E '(^|[^a-z])(Error|error|FAIL|powerinfer:|Cannot|cannot)' "$log" 2>/dev/null)
  [ -n "$line" ] || line=$(grep -v -E '^\s*$|^Node\.js v|^\s*at |^\s*[{}]\s*$' "$log" 2>/dev/null | tail -2 | tr '\n' ' ')
  echo "exit $rc: ${line:-no output} (logs/$2.log)" | cut -c1-300
}
detail_of() {
  local r
  r=$(result_of "$2")
  if [ -n "$r" ] && [ "$1" != 124 ] && [ "$1" != 137 ]; then echo "${r#* }"; else why "$1" "$2"; fi
}
# check ROW LOG CAP CMD...: runs a check that ends with a RESULT line, and prints its row
check() {
  local name=$1 log=$2 cap=$3 t0 rc
  shift 3
  t0=$(now)
  run "$log" "$cap" "$@"
  rc=$?
  row "$name" "$(status_of $rc "$log")" "$(detail_of $rc "$log")" $(($(now) - t0))
}

echo "powerinfer-ts device kit $(sed -n 's/.*"commit": *"\([^"]*\)".*/\1/p' "$kit/kit.json" | head -1)," \
  "mode: $([ $cpu = 1 ] && echo cpu || echo $gpu)$([ $quick = 1 ] && echo ', quick'), budget $budget s, $jobs cores, out $out"

# ---- Node, from the kit only (never one on PATH) ----
t0=$(now)
node=$scratch/node
want=$(sed -n 's/.*"sha256_node_xz": *"\([0-9a-f]*\)".*/\1/p' "$kit/kit.json" 2>/dev/null | head -1)
if [ ! -f "$kit/node.xz" ]; then
  row "0 node" FAIL "$kit/node.xz is missing: the kit is incomplete (build it again with pnpm device-kit)" 0
  exit 1
fi
if [ -n "$want" ] && command -v sha256sum >/dev/null 2>&1 && [ "$(sha256sum <"$kit/node.xz" | cut -d' ' -f1)" != "$want" ]; then
  row "0 node" FAIL "node.xz does not match kit.json's sha256: the kit is damaged (copy it again)" $(($(now) - t0))
  exit 1
fi
if command -v xz >/dev/null 2>&1; then
  xz -dc "$kit/node.xz" >"$node" 2>"$out/logs/node.log"
elif command -v python3 >/dev/null 2>&1; then
  python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], "wb"))' "$kit/node.xz" "$node" 2>"$out/logs/node.log"
else
  row "0 node" FAIL "neither xz nor python3 is here to unpack node.xz" 0
  exit 1
fi
rc=$?
if [ $rc != 0 ] || [ ! -s "$node" ]; then
  row "0 node" FAIL "unpacking node.xz failed (exit $rc): $(head -c 300 "$out/logs/node.log")" $(($(now) - t0))
  exit 1
fi
chmod +x "$node"
if ! node_version=$("$node" --version 2>"$out/logs/node.log") || [ -z "$node_version" ]; then
  row "0 node" FAIL "the kit's Node does not start: $(head -c 300 "$out/logs/node.log")" $(($(now) - t0))
  exit 1
fi
export POWERINFER_TEST_MODELS=$kit/models NODE_PATH="" NODE_OPTIONS=""
unset POWERINFER_BACKEND POWERINFER_CPU_ADDON POWERINFER_CUDA_ADDON
# timeout(1) runs programs, not shell functions: the two entry points as arrays
PI=("$node" "$kit/js/powerinfer.mjs")
CHECKS=("$node" "$kit/js/checks.mjs")

# ---- 1. the machine: GPU, OS, glibc ----
t0=$(now)
os=$( (. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME") || uname -sr)
glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
need=$(sed -n 's/.*"glibc_needed": *"\([^"]*\)".*/\1/p' "$kit/kit.json" | head -1)
host="$os, glibc ${glibc:-?} (kit needs ≥ ${need:-?}), $jobs cores, node $node_version"
glibc_ok=1
if [ -n "$glibc" ] && [ -n "$need" ] && [ "$(printf '%s\n%s\n' "$need" "$glibc" | sort -V | head -1)" != "$need" ]; then
  glibc_ok=0
fi
run env 60 "${CHECKS[@]}" env
env_rc=$?
if [ $cpu = 1 ]; then
  st=$(status_of $env_rc env)
  [ $glibc_ok = 1 ] || st=FAIL
  row "1 machine (--cpu: no GPU used)" $st "$host; $(detail_of $env_rc env)" $(($(now) - t0))
elif [ $gpu = rocm ]; then
  st=ok
  grep -qE '^rocm: usable' "$out/logs/env.log" || st=FAIL
  [ $glibc_ok = 1 ] || st=FAIL
  [ -x "$kit/bin/powerinfer_rocm_tests" ] || st=FAIL
  row "1 GPU (ROCm)" $st "$(awk '/^rocm:/ { p = 1; print; next } /^[^ ]/ { p = 0 } p' "$out/logs/env.log" | tr '\n' ' '); amdgpu $(cat /sys/module/amdgpu/version 2>/dev/null || echo '?'); $host" $(($(now) - t0))
elif ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
  row "1 GPU" FAIL "nvidia-smi finds no GPU (use --cpu on a machine without one); $host" $(($(now) - t0))
else
  name=$(nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv,noheader | head -1)
  st=ok
  grep -qE '^cuda: usable' "$out/logs/env.log" || st=FAIL
  [ $glibc_ok = 1 ] || st=FAIL
  row "1 GPU" $st "$name; $host; $(grep -E '^cuda:' "$out/logs/env.log" | head -1)" $(($(now) - t0))
fi

# ---- 2. native kernel tests ----
t0=$(now)
if [ $cpu = 1 ]; then
  # the device binaries must load and skip (77) without a GPU; the kernels under the emulator instead
  bad=""
  for dev_tests in "$kit"/bin/powerinfer_cuda_tests "$kit"/bin/powerinfer_rocm_tests; do
    [ -e "$dev_tests" ] || continue
    run native-device 60 "$dev_tests"
    rc=$?
    [ $rc = 77 ] || bad="$bad $(basename "$dev_tests") exited $rc without a GPU (77 = skipped expected): $(tail -2 "$out/logs/native-device.log" | tr '\n' ' ');"
  done
  if [ -n "$bad" ]; then
    row "2 native tests (no GPU)" FAIL "$bad" $(($(now) - t0))
  else
    run native 300 "$kit/bin/powerinfer_gpu_tests" --emu-warp 32
    rc=$?
    st=$([ $rc = 0 ] && echo ok || echo FAIL)
    row "2 native tests on the emulator" $st "device binaries skip without a GPU (77); emulator warp 32: $(tail -1 "$out/logs/native.log")" $(($(now) - t0))
  fi
else
  run native 120 "$kit/bin/powerinfer_${gpu}_tests"
  rc=$?
  st=$([ $rc = 0 ] && echo ok || echo FAIL)
  row "2 native tests on the GPU" $st "exit $rc: $(tail -1 "$out/logs/native.log")" $(($(now) - t0))
fi

# ---- 2b. kernel timings (timing events) at 7B shapes, and the decode step / pp512 they add up to ----
t0=$(now)
if [ $cpu = 1 ]; then
  # like step 5's GPU row: a skip row in the full --cpu run only (--quick rows must all pass)
  [ $quick = 1 ] || row "2b kernel timings" skip "--cpu: no GPU (the emulator's times mean nothing)" 0
else
  run bench 150 "$kit/bin/powerinfer_${gpu}_tests" --bench
  rc=$?
  if [ $rc = 0 ]; then
    # "bench<TAB>kernel<TAB>µs<TAB>GB/s<TAB>% of 4.8 TB/s" and "row<TAB>name<TAB>detail" lines
    while IFS=$'\t' read -r kind name a b c; do
      case $kind in
      bench) [ -n "$b" ] && row "2b $name" ok "$a, $b, $c of 4.8 TB/s" 0 ;;
      row) row "2b $name" ok "$a" 0 ;;
      esac
    done <"$out/logs/bench.log"
    row "2b kernel timings" ok "$(grep -m1 '^bench on' "$out/logs/bench.log")" $(($(now) - t0))
  else
    row "2b kernel timings" FAIL "$(why $rc bench)" $(($(now) - t0))
  fi
fi

# ---- 3. conformance kit and the GPU suite (sparse-op row counters included) ----
if [ $cpu = 1 ]; then
  check "3a conformance kit: cpu" conformance 240 "${CHECKS[@]}" conformance --backend cpu
  [ $quick = 1 ] || check "3b GPU suite: emulator" gpu-suite 300 "${CHECKS[@]}" gpu-suite --backend gpu-emu
else
  check "3a conformance kit: $gpu" conformance 120 "${CHECKS[@]}" conformance --backend $gpu
  check "3b GPU suite: $gpu" gpu-suite 120 "${CHECKS[@]}" gpu-suite --backend $gpu
fi

# ---- 4. logits, device vs CPU, both vs llama.cpp's reference ids (the emulator is slow: one prompt, 8 steps) ----
check "4 logits $([ $cpu = 1 ] && echo emulator || echo $gpu) vs cpu" logits 240 \
  "${CHECKS[@]}" logits --device "$([ $cpu = 1 ] && echo gpu-emu || echo $gpu)" --models "$kit/models" \
  $([ $cpu = 1 ] && echo "--cases 1 --steps 8")

# ---- 5. generated 7B/13B slices: dense CPU, sparse CPU, hybrid, all on the GPU ----
device=$([ $cpu = 1 ] && echo cpu || echo $gpu)
# device memory is read with nvidia-smi (CUDA only)
smi=0
[ $cpu = 0 ] && [ $gpu = cuda ] && smi=1
tps() { grep -E '^ *eval time' "$out/logs/$1.log" | grep -oE '[0-9.]+ tokens per second' | head -1; }
# MiB in use on GPU 0, or nothing when nvidia-smi gives no number ([N/A] under MIG, an NVML error)
mib_used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2>/dev/null | head -1 | tr -d ' ' | grep -E '^[0-9]+$'; }
# speed NAME LOG ARGS...: one decode run; its row gives tokens/s, the plan's device bytes and the measured device memory
speed() {
  local name=$1 log=$2 t0 rc base peak=0 smi_log st detail
  shift 2
  t0=$(now)
  smi_log=$scratch/$log.smi
  if [ $smi = 1 ]; then
    base=$(mib_used)
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 >"$smi_log" 2>/dev/null &
    smi_pid=$!
  fi
  run "$log" 180 "${PI[@]}" run "$@" -p "Once upon a time" -n "$tokens" --temp 0 --ignore-eos -t "$jobs" -c 256
  rc=$?
  if [ -n "$smi_pid" ]; then
    kill "$smi_pid" 2>/dev/null
    wait "$smi_pid" 2>/dev/null
    smi_pid=""
    peak=$(grep -E '^ *[0-9]+ *$' "$smi_log" 2>/dev/null | sort -n | tail -1 | tr -d ' ')
  fi
  if [ $rc = 0 ] && [ -n "$(tps "$log")" ]; then
    st=ok
    detail="$(tps "$log")"
    local plan
    plan=$(grep -oE 'hybrid: .*' "$out/logs/$log.log" | head -1)
    [ -n "$plan" ] && detail="$detail; $plan"
    local sparse
    sparse=$(grep -oE 'neurons computed per token: [0-9.]+ %' "$out/logs/$log.log" | head -1)
    [ -n "$sparse" ] && detail="$detail; $sparse"
    if [ $smi = 1 ] && [[ ${base:-} =~ ^[0-9]+$ ]] && [[ $peak =~ ^[0-9]+$ ]]; then
      detail="$detail; device memory measured (nvidia-smi peak − idle): $((peak - base)) MiB"
    fi
  else
    st=FAIL
    detail=$(why "$rc" "$log")
  fi
  row "$name" $st "$detail" $(($(now) - t0))
}
text=$kit/text/profile.txt
presets="7b 13b"
[ $quick = 1 ] && presets="7b"
for preset in $presets; do
  model=$scratch/$preset-x$layers.pwri.gguf
  t0=$(now)
  run "gen-$preset" 240 "${PI[@]}" gen-model --preset "$preset" --layers "$layers" --format pwri --dtype F16 -o "$model" --force -t "$jobs"
  rc=$?
  if [ $rc != 0 ]; then
    row "5 $preset×$layers slice" FAIL "gen-model: $(why $rc "gen-$preset")" $(($(now) - t0))
    continue
  fi
  run "profile-$preset" 240 "${PI[@]}" profile -m "$model" -f "$text" -c 128 --tokens 128 --backend cpu -t "$jobs"
  rc=$?
  if [ $rc != 0 ]; then
    row "5 $preset×$layers profile" FAIL "$(why $rc "profile-$preset")" $(($(now) - t0))
    continue
  fi
  gib=$(awk -v b="$(stat -c %s "$model")" 'BEGIN { printf "%.2f", b / 2^30 }')
  row "5 $preset×$layers slice ($gib GiB F16 PWRI)" ok "generated and profiled over 128 tokens of text/profile.txt ($(grep -oE 'active [0-9.]+ %' "$out/logs/gen-$preset.log" | head -1) by design)" $(($(now) - t0))
  common=(-m "$model" --backend cpu)
  if [ $quick = 0 ]; then
    speed "5 $preset dense, CPU" "dense-$preset" "${common[@]}" --sparse off --disable-gpu-index
    speed "5 $preset sparse, CPU only" "sparse-$preset" "${common[@]}" --sparse predictor --disable-gpu-index
  fi
  for share in 25 50; do
    [ $quick = 1 ] && [ $share = 25 ] && continue
    vram=$(awk -v g="$gib" -v s=$share 'BEGIN { printf "%.3f", g * s / 100 }')
    speed "5 $preset hybrid, $device $share % ($vram GiB)" "hybrid$share-$preset" "${common[@]}" \
      --sparse predictor --device-backend "$device" --vram-budget "$vram" --reset-gpu-index
  done
  if [ $quick = 0 ]; then
    if [ $cpu = 1 ]; then
      row "5 $preset all on the GPU" skip "--cpu: no GPU" 0
    else
      speed "5 $preset all on the GPU" "gpu-$preset" -m "$model" --backend $gpu --sparse predictor --disable-gpu-index
    fi
  fi
done

# ---- 5e. a SmallThinker-21B-shaped slice (routed ReLU experts with per-expert predictors): hot (expert, neuron)
# pairs on the device ----
if [ $quick = 0 ]; then
  model=$scratch/st21b-x$layers.gguf
  t0=$(now)
  run "gen-st21b" 240 "${PI[@]}" gen-model --preset smallthinker-21b-a3b --layers "$layers" --dtype F16 --predictors \
    --vocab-size 4096 -o "$model" --force
  rc=$?
  [ $rc = 0 ] && { run "profile-st21b" 240 "${PI[@]}" profile -m "$model" -f "$text" -c 128 --tokens 128 --backend cpu -t "$jobs"; rc=$?; }
  if [ $rc != 0 ]; then
    row "5e smallthinker-21b×$layers slice" FAIL "$(why $rc "$([ -f "$out/logs/profile-st21b.log" ] && echo profile-st21b || echo gen-st21b)")" $(($(now) - t0))
  else
    gib=$(awk -v b="$(stat -c %s "$model")" 'BEGIN { printf "%.2f", b / 2^30 }')
    row "5e smallthinker-21b×$layers slice ($gib GiB F16 GGUF, predictors)" ok "generated and profiled over 128 tokens" $(($(now) - t0))
    common=(-m "$model" --backend cpu)
    speed "5e smallthinker-21b sparse, CPU only" "sparse-st21b" "${common[@]}" --sparse predictor --disable-gpu-index
    for share in 25 50; do
      vram=$(awk -v g="$gib" -v s=$share 'BEGIN { printf "%.3f", g * s / 100 }')
      speed "5e smallthinker-21b hybrid, $device $share % ($vram GiB)" "hybrid$share-st21b" "${common[@]}" \
        --sparse predictor --device-backend "$device" --vram-budget "$vram" --reset-gpu-index
    done
    if [ $cpu = 1 ]; then
      row "5e smallthinker-21b all on the GPU" skip "--cpu: no GPU" 0
    else
      speed "5e smallthinker-21b all on the GPU" "gpu-st21b" -m "$model" --backend $gpu --sparse predictor --disable-gpu-index
    fi
  fi
fi

# ---- 6. the server: 8 concurrent requests on loopback ----
if [ $quick = 0 ]; then
  t0=$(now)
  port=$("$node" -e 'const s = require("net").createServer().listen(0, "127.0.0.1", () => { console.log(s.address().port); s.close(); })' 2>/dev/null)
  [[ $port =~ ^[0-9]+$ ]] || port=$((20000 + $$ % 20000))
  backend=$([ $cpu = 1 ] && echo cpu || echo $gpu)
  "${PI[@]}" serve -m "$kit/models/stories260K.gguf" --host 127.0.0.1 --port "$port" -np 8 -c 2048 --backend "$backend" \
    >"$out/logs/server.log" 2>&1 &
  server_pid=$!
  # one backend here (the server takes the same device options as run; the hybrid rows above measure the split)
  check "6 serve on $backend: 8 concurrent" serve-load 120 "${CHECKS[@]}" serve-load --url "http://127.0.0.1:$port" --n 8 \
    --pid "$server_pid" --log "$out/logs/server.log"
  kill "$server_pid" 2>/dev/null
  wait "$server_pid" 2>/dev/null
  server_pid=""
fi

# ---- the table ----
{
  echo
  echo "| step | status | detail | seconds |"
  echo "| --- | --- | --- | ---: |"
  for r in "${rows[@]}"; do
    IFS='|' read -r a b c d <<<"$r"
    echo "| $a | $b | $c | $d |"
  done
  echo
  echo "device kit: $(($(now) - start)) s in all; logs in $out/logs"
} | tee "$out/table.md"
exit $failed
