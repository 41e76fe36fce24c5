#!/bin/bash
# The two device calls that bring the 2,048-token data and the SmolLM2 GGUF to a fresh H200 and run issue 12's
# 10-minute arm on it, from this tree's .pack/, made here first (~70 s):
#     .venv/bin/python bench/eval_bench.py --pack .pack --conversations 0 --dtype bfloat16 --max-length 2048 --out /dev/null
# Call 1, carry [".pack/a"] (data.parquet, the gguf wheel, the GGUF's first 39.5 MB):
#     bash bench/h200_carry.sh a
# Call 2, made at once (the machine stays warm 30 s after a call), carry [".pack/b"] (the rest of the GGUF):
#     ONLY=ten-minutes bash bench/h200_carry.sh b
# The arm's budget is BUDGET (default 575) or what the call has left after the join, the copy and the conversion
# (~50 s), less 10 s, whichever is smaller: CALL_S (default 595) is the call's limit. On 2026-12-05 BUDGET=575 after
# the conversion ran past a 600-s call and cut the arm in its evaluation.
# It joins and checks the GGUF, copies this tree to /root/eaglet, converts the model (bench/h200_queue.sh none), runs
# the arm on the 2,048-token data in the foreground (bench/h200_queue.sh 2048:/root/qb/d; ONLY, BUDGET, RESERVE,
# PACE as there) and copies the run's results folder to $OUT (quality.json, the draft's tar, the logs).
# A second argument replaces the queue's (`b none`: convert only).
set -u
QB=/root/qb
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # SmolLM2-135M-Instruct.Q4_1.gguf
case "${1:-}" in
a)
    mkdir -p $QB/d /root/site && cp .pack/a/data.parquet $QB/d/ && cp .pack/a/gguf.part-1 $QB/g1 \
        && pip install -q --no-deps --target /root/site .pack/a/gguf-*.whl && ls -l $QB/g1 $QB/d/data.parquet
    ;;
b)
    t0=$(date +%s)
    cat $QB/g1 .pack/b/gguf.part-2 > $QB/smollm2.gguf && echo "$SHA  $QB/smollm2.gguf" | sha256sum -c || exit 1
    rm -rf /root/eaglet && mkdir -p /root/eaglet \
        && tar --exclude=./.pack --exclude=./.git --exclude=./.venv --exclude=./work -cf - . | tar -xf - -C /root/eaglet
    out=${OUT:-$QB/out}; mkdir -p "$out"
    bash /root/eaglet/bench/h200_queue.sh none > "$out/convert.log" 2>&1 || exit 1
    left=$(( ${CALL_S:-595} - ($(date +%s) - t0) - 10 )); BUDGET=${BUDGET:-575}
    export BUDGET=$(( BUDGET < left ? BUDGET : left ))
    echo "the arm's budget: $BUDGET s ($(( $(date +%s) - t0 )) s of the call spent)" | tee -a "$out/convert.log"
    bash /root/eaglet/bench/h200_queue.sh "${2:-2048:$QB/d}" > "$out/queue.log" 2>&1
    R=$(ls -d $QB/res/q2048-* 2>/dev/null | tail -1)
    [ -n "$R" ] && cp "$R"/* "$out"/
    tail -3 "$out/queue.log"
    ;;
*)
    echo "usage: bash bench/h200_carry.sh a|b [queue arguments]" >&2; exit 2
    ;;
esac
