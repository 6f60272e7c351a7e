#!/usr/bin/env bash
# Decode speed of a model larger than the memory it may use: llama.cpp (llama-bench, mmap) against
# powerinfer-ts with --ram-budget (neuron cache fed from the file with O_DIRECT), each in a cgroup v1
# memory group limited below the model's size, after dropping the page cache. Run as root.
#
#   bench-ram-budget.sh GGUF PWRI [options]
#     GGUF                 the model for llama.cpp (plain GGUF)
#     PWRI                 the same weights as PowerInfer GGUF (ffn_down_t + predictors; for routed experts the
#                          expert model with its per-expert predictors) for powerinfer-ts
#   options:
#     --limit-share X      memory limit as a share of GGUF's size (default 0.5)
#     --limit-bytes N      memory limit in bytes (instead of --limit-share)
#     --budget-gib G       our --ram-budget (default: the limit minus --overhead-mib)
#     --overhead-mib M     memory kept for the process itself, the KV cache and the arena (default 200)
#     -n N                 tokens decoded per repetition (llama-bench tgN: random token ids; default 16)
#     -r R                 counted repetitions, after one uncounted that warms the caches (default 2)
#     -t T                 threads (default 2)
#     --sparse MODE        our FFN mode (default predictor; off for a dense-expert MoE such as Qwen3-MoE)
#     --with-mmap          also run powerinfer-ts without --ram-budget under the limit (mapped, as llama.cpp)
#     --no-llama-cpp       skip llama.cpp
#
# Prints the machine load, the disk's speed (sequential MB/s, 4 KiB O_DIRECT random reads/s) and, per
# engine, decode tokens/s; for ours also MiB read per token, reads per token, cache hit rate, share of
# read time hidden behind compute, and the tokens/s the disk's random reads alone would allow at our
# reads per token. The group is removed on exit. Environment: LLAMA_BENCH (path of llama-bench; default
# ~/.cache/powerinfer-ts/llama.cpp/v0.5.0/build/bin/llama-bench).
set -euo pipefail
# the script's own stderr, for the traps' messages (a trap can run inside a command whose stderr is redirected)
exec 3>&2

here=$(cd "$(dirname "$0")" && pwd)
bin="$here/../dist/bin.js"
llama_bench=${LLAMA_BENCH:-$HOME/.cache/powerinfer-ts/llama.cpp/v0.5.0/build/bin/llama-bench}

die() { echo "bench-ram-budget: $*" >&2; exit 1; }
[ $# -ge 2 ] || die "usage: bench-ram-budget.sh GGUF PWRI [--limit-share X] [--budget-gib G] [-n N] [-r R] [-t T] [--sparse MODE] [--with-mmap] [--no-llama-cpp]"
gguf=$1 pwri=$2
shift 2
share=0.5 limit="" budget="" overhead=200 n=16 threads=2 with_mmap=0 llama=1 reps=2 sparse=predictor
while [ $# -gt 0 ]; do
  case $1 in
    --limit-share) share=$2; shift ;;
    --limit-bytes) limit=$2; shift ;;
    --budget-gib) budget=$2; shift ;;
    --overhead-mib) overhead=$2; shift ;;
    -n) n=$2; shift ;;
    -t) threads=$2; shift ;;
    -r) reps=$2; shift ;;
    --sparse) sparse=$2; shift ;;
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
# the smallest budget our engine accepts for this file, checked before anything runs
need=$(cd "$here/.." && node --input-type=module -e "
import { planRamBudget } from '@powerinfer/engine';
import { openGgufModel, parseModelConfig } from '@powerinfer/gguf';
const f = openGgufModel(process.argv[1]);
try { planRamBudget(f, parseModelConfig(f), 1, process.argv[2]); console.log(0); }
catch (e) { const m = /needs at least [^(]*\((\d+) bytes\)/.exec(e.message); console.log(m ? m[1] : -1); }
" "$pwri" "$sparse") || need=-1
if [ "$need" = -1 ]; then die "cannot plan a RAM budget for $pwri"; fi
python3 -c "import sys; sys.exit(0 if $budget * 2**30 >= $need else 1)" ||
  die "--ram-budget $budget GiB is below the $(python3 -c "print(f'{$need/2**30:.4f}')") GiB this model needs (limit $limit bytes minus --overhead-mib $overhead); raise --limit-share, or lower --overhead-mib / set --budget-gib"
group="$root/pi-rambench-$$"
mkdir "$group" || die "cannot create $group"
cleanup() {
  # stop what still runs in the group (an interrupted run), then remove it; its page-cache charges move
  # to the parent
  local pids
  pids=$(cat "$group/cgroup.procs" 2>/dev/null || true)
  if [ -n "$pids" ]; then
    kill $pids 2>/dev/null || true
    for _ in 1 2 3 4 5 6 7 8 9 10; do
      [ -z "$(cat "$group/cgroup.procs" 2>/dev/null)" ] && break
      sleep 0.5
    done
    pids=$(cat "$group/cgroup.procs" 2>/dev/null || true)
    [ -n "$pids" ] && kill -9 $pids 2>/dev/null || true
    sleep 0.5
  fi
  rmdir "$group" 2>/dev/null || echo "bench-ram-budget: could not remove $group" >&3
}
trap cleanup EXIT
# an interrupt ends the whole run (its numbers would be wrong), through the EXIT trap; the engine running
# outside the group (the unlimited run) is stopped here, those in the group by cleanup
bg=""
trap 'echo "bench-ram-budget: interrupted" >&3; [ -n "$bg" ] && kill "$bg" 2>/dev/null; exit 130' INT TERM
echo "$limit" > "$group/memory.limit_in_bytes"

# runs "$@" in the background and waits for it: bash runs an INT/TERM trap only once its foreground child
# has ended, but interrupts `wait` at once; returns the command's exit status
waited() {
  "$@" &
  bg=$!
  local rc=0
  wait "$bg" || rc=$?
  bg=""
  return "$rc"
}

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

# Both engines decode the same protocol: llama-bench's tgN of random token ids, one repetition first
# that is not counted (it fills the page cache / the neuron cache), then -r counted ones; the median.
llama_tps=""
if [ "$llama" = 1 ]; then
  ooms=$(awk '/^oom_kill /{print $2}' "$group/memory.oom_control")
  out_file=$(mktemp)
  waited in_group "$llama_bench" -m "$gguf" -p 0 -n "$n" -t "$threads" -r $((reps + 1)) --no-warmup -o json >"$out_file" 2>/dev/null || true
  out=$(cat "$out_file")
  rm -f "$out_file"
  if [ "$(awk '/^oom_kill /{print $2}' "$group/memory.oom_control")" != "$ooms" ]; then
    echo "== llama.cpp was killed by the OOM killer in the group (its anonymous allocations, e.g. repacked weights, exceed the limit)"
  fi
  llama_tps=$(printf '%s' "$out" | python3 -c "import json,sys,statistics
try:
  rows=json.load(sys.stdin); print(round(statistics.median(rows[0]['samples_ts'][1:]),3))
except Exception: print('')")
  echo "== llama.cpp (llama-bench tg$n, mmap, median of $reps after one uncounted) under the limit: ${llama_tps:-failed} tokens/s; group peak (page cache included) $(cat "$group/memory.max_usage_in_bytes") bytes"
fi

# ours: `powerinfer bench` JSON (tokens/s and the neuron cache's counters over the counted repetitions)
ours() {
  python3 - "$1" "$disk" <<'EOF'
import json, sys
rows = json.load(open(sys.argv[1]))
rows = rows if isinstance(rows, list) else rows["rows"]
disk = json.loads(sys.argv[2])
r = [x for x in rows if x["engine"] == "powerinfer-ts"][0]
line = f"{r['median_ts']:.3f} tokens/s"
c = r.get("neuron_cache")
if c:
    mib, reads = c["mib_per_token"], c["reads_per_token"]
    seq = disk["seq_mb_s"] * 1e6 / (mib * 2**20) if mib > 0 else float("inf")
    line += f"; {mib:.2f} MiB and {reads:.0f} reads ({c.get('io', '?')}) per token, hit rate {100*c['hit_rate']:.1f} %, read time hidden {100*c['hidden']:.1f} %; the disk allows"
    # the random-read bound only where reads are small (neuron rows); expert reads are 1 MiB pieces
    if reads > 0 and mib * 1024 / reads <= 256:
        line += f" {disk['rand_iops_qd8'] / reads:.2f} tokens/s at this many random reads (QD8, 4 KiB-class),"
    line += f" {seq:.2f} at its sequential speed"

print(line)
EOF
}
log=$(mktemp)
json=$(mktemp)
trap 'rm -f "$log" "$json"; cleanup' EXIT
args=(bench -m "$pwri" -p 0 -n "$n" -r "$reps" -t "$threads" --sparse "$sparse" --no-llama-cpp --bandwidth-mib 0 --json -q)
if ! waited in_group node "$bin" "${args[@]}" --ram-budget "$budget" >"$json" 2>"$log"; then
  tail -5 "$log" >&2
  die "powerinfer-ts with --ram-budget failed"
fi
peak=$(cat "$group/memory.max_usage_in_bytes")
echo "== powerinfer-ts --ram-budget $budget (bench tg$n, --sparse $sparse) under the limit: $(ours "$json"); group peak (page cache included) $peak bytes"
limited=$(ours "$json" | cut -d' ' -f1)

if [ "$with_mmap" = 1 ]; then
  if waited in_group node "$bin" "${args[@]}" >"$json" 2>"$log"; then
    echo "== powerinfer-ts mapped (no --ram-budget) under the limit: $(ours "$json")"
  else
    echo "== powerinfer-ts mapped (no --ram-budget) under the limit failed: $(tail -1 "$log")"
  fi
fi

# unlimited: page cache warm (read once), no group
cat "$pwri" > /dev/null
waited node "$bin" "${args[@]}" >"$json" 2>"$log"
unlimited=$(ours "$json" | cut -d' ' -f1)
echo "== powerinfer-ts unlimited (warm page cache, no group): $unlimited tokens/s"
python3 - "$limited" "$unlimited" "${llama_tps:-nan}" <<'EOF'
import sys
ours, free, llama = (float(x) for x in sys.argv[1:4])
print(f"== summary: ours {ours:.3f} tokens/s = {ours/llama:.2f}x llama.cpp ({llama:.3f}) under the limit; {free/ours:.2f}x slower than our unlimited {free:.3f}")
EOF
