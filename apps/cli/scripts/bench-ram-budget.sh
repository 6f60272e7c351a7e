#!/usr/bin/env bash
# Decode speed of a model larger than the memory it may use: llama.cpp (llama-bench, mmap) against
# powerinfer-ts with --ram-budget (neuron cache fed from the file with O_DIRECT), each in a cgroup v1
# memory group limited below the model's size, after dropping the page cache. Run as root.
#
#   bench-ram-budget.sh GGUF PWRI [options]
#     GGUF                 the model for llama.cpp (plain GGUF)
#     PWRI                 the same weights as PowerInfer GGUF (ffn_down_t + predictors) for powerinfer-ts
#   options:
#     --limit-share X      memory limit as a share of GGUF's size (default 0.5)
#     --limit-bytes N      memory limit in bytes (instead of --limit-share)
#     --budget-gib G       our --ram-budget (default: the limit minus --overhead-mib)
#     --overhead-mib M     memory kept for the process itself, the KV cache and the arena (default 200)
#     -n N                 tokens generated (default 16)
#     -t T                 threads (default 2)
#     --with-mmap          also run powerinfer-ts without --ram-budget under the limit (mapped, as llama.cpp)
#     --no-llama-cpp       skip llama.cpp
#
# Prints the machine load, the disk's speed (sequential MB/s, 4 KiB O_DIRECT random reads/s) and, per
# engine, decode tokens/s; for ours also MiB read per token, reads per token, cache hit rate, share of
# read time hidden behind compute, and the tokens/s the disk's random reads alone would allow at our
# reads per token. The group is removed on exit. Environment: LLAMA_BENCH (path of llama-bench; default
# ~/.cache/powerinfer-ts/llama.cpp/v0.5.0/build/bin/llama-bench).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
bin="$here/../dist/bin.js"
llama_bench=${LLAMA_BENCH:-$HOME/.cache/powerinfer-ts/llama.cpp/v0.5.0/build/bin/llama-bench}

die() { echo "bench-ram-budget: $*" >&2; exit 1; }
[ $# -ge 2 ] || die "usage: bench-ram-budget.sh GGUF PWRI [--limit-share X] [--budget-gib G] [-n N] [-t T] [--with-mmap] [--no-llama-cpp]"
gguf=$1 pwri=$2
shift 2
share=0.5 limit="" budget="" overhead=200 n=16 threads=2 with_mmap=0 llama=1
while [ $# -gt 0 ]; do
  case $1 in
    --limit-share) share=$2; shift ;;
    --limit-bytes) limit=$2; shift ;;
    --budget-gib) budget=$2; shift ;;
    --overhead-mib) overhead=$2; shift ;;
    -n) n=$2; shift ;;
    -t) threads=$2; shift ;;
    --with-mmap) with_mmap=1 ;;
    --no-llama-cpp) llama=0 ;;
    *) die "unknown option $1" ;;
  esac
  shift
done
[ -f "$gguf" ] || die "$gguf does not exist"
[ -f "$pwri" ] || die "$pwri does not exist"
[ -f "$bin" ] || die "$bin missing: run pnpm build"
[ "$(id -u)" = 0 ] || die "needs root (cgroup and drop_caches)"
root=/sys/fs/cgroup/memory
[ -f "$root/cgroup.procs" ] || die "no cgroup v1 memory controller at $root"
if [ "$llama" = 1 ] && [ ! -x "$llama_bench" ]; then
  echo "note: $llama_bench not found: llama.cpp skipped" >&2
  llama=0
fi

size=$(stat -c %s "$gguf")
[ -n "$limit" ] || limit=$(python3 -c "print(int($size * $share))")
[ -n "$budget" ] || budget=$(python3 -c "print(round(($limit - $overhead * 2**20) / 2**30, 4))")
group="$root/pi-rambench-$$"
mkdir "$group" || die "cannot create $group"
cleanup() {
  # processes have exited by now; the group's page-cache charges move to the parent
  rmdir "$group" 2>/dev/null || echo "bench-ram-budget: could not remove $group" >&2
}
trap cleanup EXIT
echo "$limit" > "$group/memory.limit_in_bytes"

# runs "$@" inside the group after dropping the page cache
in_group() {
  sync
  echo 1 > /proc/sys/vm/drop_caches
  echo 0 > "$group/memory.max_usage_in_bytes" 2>/dev/null || true
  sh -c 'echo $$ > "$0/cgroup.procs" && shift && exec "$@"' "$group" -- "$@"
}

echo "== machine: $(nproc) cores, load average $(cut -d' ' -f1-3 /proc/loadavg) (other work on the machine counts)"
echo "== model: $gguf ($(python3 -c "print(f'{$size/2**30:.2f}')") GiB); ours: $pwri"
echo "== memory group limit: $limit bytes ($(python3 -c "print(f'{$limit/2**30:.3f}')") GiB); our --ram-budget $budget GiB"
disk=$(python3 "$here/disk-speed.py" "$pwri" 3)
echo "== disk (O_DIRECT): $disk"

prompt="once upon a time there was a little girl who"
llama_tps=""
if [ "$llama" = 1 ]; then
  ooms=$(awk '/^oom_kill /{print $2}' "$group/memory.oom_control")
  out=$(in_group "$llama_bench" -m "$gguf" -p 0 -n "$n" -t "$threads" -r 1 --no-warmup -o json 2>/dev/null) || true
  if [ "$(awk '/^oom_kill /{print $2}' "$group/memory.oom_control")" != "$ooms" ]; then
    echo "== llama.cpp was killed by the OOM killer in the group (its anonymous allocations, e.g. repacked weights, exceed the limit)"
  fi
  llama_tps=$(printf '%s' "$out" | python3 -c "import json,sys
try:
  rows=json.load(sys.stdin); print(round(rows[0]['avg_ts'],3))
except Exception: print('')")
  echo "== llama.cpp (llama-bench tg$n, mmap) under the limit: ${llama_tps:-failed} tokens/s; peak $(cat "$group/memory.max_usage_in_bytes") bytes"
fi

# ours: tokens/s from the "eval time" line, counters from the "neuron cache" line
ours() {
  local log=$1
  python3 - "$log" "$disk" <<'EOF'
import json, re, sys
log = open(sys.argv[1]).read()
disk = json.loads(sys.argv[2])
m = re.search(r"eval time =.*?([\d.]+) tokens per second", log.split("prompt eval time")[-1])
tps = float(m.group(1)) if m else float("nan")
c = re.search(r"neuron cache over (\d+) tokens: ([\d.]+) MiB read per token in ([\d.]+) reads, hit rate ([\d.]+) %, read time hidden ([\d.]+) %", log)
line = f"{tps:.3f} tokens/s"
if c:
    mib, reads = float(c.group(2)), float(c.group(3))
    bound = disk["rand_iops_qd8"] / reads if reads > 0 else float("inf")
    seq = disk["seq_mb_s"] * 1e6 / (mib * 2**20) if mib > 0 else float("inf")
    line += (f"; {mib:.2f} MiB and {reads:.0f} reads per token, hit rate {c.group(4)} %, read time hidden {c.group(5)} %;"
             f" the disk allows {bound:.2f} tokens/s at this many 4 KiB-class random reads (QD8), {seq:.2f} at its sequential speed")
print(line)
EOF
}
log=$(mktemp)
trap 'rm -f "$log"; cleanup' EXIT
args=(run -m "$pwri" -p "$prompt" -n "$n" --temp 0 --ignore-eos -t "$threads" -c 256)
if ! in_group node "$bin" "${args[@]}" --ram-budget "$budget" >/dev/null 2>"$log"; then
  tail -5 "$log" >&2
  die "powerinfer-ts with --ram-budget failed"
fi
peak=$(cat "$group/memory.max_usage_in_bytes")
grep -a "ram budget" "$log" | head -1
echo "== powerinfer-ts --ram-budget $budget under the limit: $(ours "$log"); peak $peak bytes"
limited=$(ours "$log" | cut -d' ' -f1)

if [ "$with_mmap" = 1 ]; then
  if in_group node "$bin" "${args[@]}" >/dev/null 2>"$log"; then
    echo "== powerinfer-ts mapped (no --ram-budget) under the limit: $(ours "$log")"
  else
    echo "== powerinfer-ts mapped (no --ram-budget) under the limit failed: $(tail -1 "$log")"
  fi
fi

# unlimited: page cache warm (read once), no group
cat "$pwri" > /dev/null
node "$bin" "${args[@]}" >/dev/null 2>"$log"
unlimited=$(ours "$log" | cut -d' ' -f1)
echo "== powerinfer-ts unlimited (warm page cache, no group): $unlimited tokens/s"
python3 - "$limited" "$unlimited" "${llama_tps:-nan}" <<'EOF'
import sys
ours, free, llama = (float(x) for x in sys.argv[1:4])
print(f"== summary: ours {ours:.3f} tokens/s = {ours/llama:.2f}x llama.cpp ({llama:.3f}) under the limit; {free/ours:.2f}x slower than our unlimited {free:.3f}")
EOF
