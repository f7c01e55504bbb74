#!/usr/bin/env bash
# Every parallel strategy against one process, on this machine, in one go.
#
#   benchmarks/compare.sh                    # 2-rank comparisons (one rank per core)
#   benchmarks/compare.sh --oversubscribed   # ...plus dp=4 on 4 ranks, with/without heavy yield
#
# Each strategy is compared with serial at the SAME global batch: a process that
# accumulates 8 micro-batches amortises the optimizer step over 8x the tokens, so
# comparing a pipeline (m=8) with a 1-micro-batch serial run would flatter it.
# ITERS / WARMUP override the iteration counts; results also go to $OUT (JSON lines).
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH="$PWD/.venv/bin:$PATH"
ITERS=${ITERS:-30}
WARMUP=${WARMUP:-5}
OUT=${OUT:-$(mktemp /tmp/numpitron-compare.XXXXXX.jsonl)}
: > "$OUT"

cpu_ticks() {   # "busy total" jiffies of the whole machine
    local _ user nice sys idle iowait irq softirq steal
    read -r _ user nice sys idle iowait irq softirq steal _ < /proc/stat
    echo $((user + nice + sys + irq + softirq + steal)) $((user + nice + sys + idle + iowait + irq + softirq + steal))
}

wait_until_idle() {   # other people's jobs share this machine: start each run on a quiet one
    local b1 t1 b2 t2 busy
    for _ in $(seq 30); do
        read -r b1 t1 < <(cpu_ticks); sleep 2; read -r b2 t2 < <(cpu_ticks)
        busy=$(( 100 * (b2 - b1) / (t2 - t1 > 0 ? t2 - t1 : 1) ))
        (( busy < 15 )) && return
        echo "(machine ${busy}% busy; waiting)" >&2
    done
    echo "(still busy: running anyway; see foreign_cpu_share)" >&2
}

run() {   # run LABEL NRANKS [benchmark flags...]: print and record one JSON line
    local label=$1 n=$2; shift 2
    local line
    wait_until_idle
    if [[ $n == 1 ]]; then
        line=$(python benchmarks/benchmark.py --iters "$ITERS" --warmup "$WARMUP" "$@")
    else
        line=$(mpiexec -n "$n" python benchmarks/benchmark.py --iters "$ITERS" --warmup "$WARMUP" "$@")
    fi
    echo "$label $line"
    python -c 'import json,sys; print(json.dumps({"label": sys.argv[1], **json.loads(sys.argv[2])}))' \
        "$label" "$line" >> "$OUT"
}

# Serial references, one per global batch used below (micro-batch 12 throughout).
run serial-g12 1 --global-batch-size 12
run serial-g24 1 --global-batch-size 24
run serial-g96 1 --global-batch-size 96
run tp2-g12 2 --tensor-parallel-size 2 --global-batch-size 12
run dp2-zero0-g24 2 --data-parallel-size 2 --global-batch-size 24 --zero-stage 0
run dp2-zero1-g24 2 --data-parallel-size 2 --global-batch-size 24 --zero-stage 1
run pp2-1f1b-g96 2 --pipeline-parallel-size 2 --pipeline-schedule 1f1b --global-batch-size 96
run pp2-gpipe-g96 2 --pipeline-parallel-size 2 --pipeline-schedule gpipe --global-batch-size 96
# Not a strategy: what the malloc tuning of numpitron/runtime.py buys, on the two extremes.
run serial-g12-mdefault 1 --global-batch-size 12 --glibc-malloc-defaults
run tp2-g12-mdefault 2 --tensor-parallel-size 2 --global-batch-size 12 --glibc-malloc-defaults

if [[ ${1:-} == --oversubscribed ]]; then
    # 4 ranks on 2 cores. runtime.py sets heavy yield when ranks > cores unless the
    # variable is already set, so "without" must set it to 0 explicitly.
    run serial-g48 1 --global-batch-size 48
    MPIR_CVAR_ENABLE_HEAVY_YIELD=1 run dp4-yield1-g48 4 --data-parallel-size 4 --global-batch-size 48
    MPIR_CVAR_ENABLE_HEAVY_YIELD=0 run dp4-yield0-g48 4 --data-parallel-size 4 --global-batch-size 48
fi

echo "== summary vs serial at the same global batch (results in $OUT)"
python - "$OUT" <<'EOF'
import json, sys
runs = [json.loads(line) for line in open(sys.argv[1])]
serial = {r["mesh"]["global_batch"]: r for r in runs if r["mesh"]["world"] == 1 and not r["glibc_malloc_defaults"]}
print(f"{'run':16s} {'ranks':>5s} {'ms/iter':>8s} {'tok/s':>8s} {'x serial':>8s} {'mfu':>6s} "
      f"{'comm MB/it':>10s} {'comm %':>6s} {'bubble':>13s} {'opt MB':>7s} {'rss MB':>7s} {'faults':>6s} {'foreign':>7s}")
for r in runs:
    ref = serial[r["mesh"]["global_batch"]]
    bubble = (f"{r['pipeline_bubble_measured_median']:.2f}/{r['pipeline_bubble_formula']:.2f}"
              if "pipeline_bubble_formula" in r else "-")
    print(f"{r['label']:16s} {r['mesh']['world']:5d} {r['ms_per_iter_median']:8.1f} {r['tokens_per_s']:8.0f} "
          f"{r['tokens_per_s'] / ref['tokens_per_s']:8.2f} {r['mfu']:6.3f} {r['comm_bytes_per_iter'] / 1e6:10.2f} "
          f"{100 * r['comm_fraction']:6.1f} {bubble:>13s} {max(r['optimizer_state_bytes_per_rank']) / 1e6:7.2f} "
          f"{r['peak_rss_mb']:7.1f} {max(r['page_faults_per_iter_per_rank']):6d} {r.get('foreign_cpu_share', 0):7.3f}")
EOF
