#!/bin/bash
# The H200 queue (since 2026-12-04): issue 12's 10-minute arm on the data of record (every clean ShareGPT
# conversation cut to 1,024 tokens, as measured before), then the same arm on the same conversations prepared at
# the prepare step's default max_length, 2,048 (53% of the samples were cut at 1,024). Results into /root/qb/res.
# Started detached (setsid) by a device call, so no call's 10-minute limit cuts a job; later calls wait on
# /root/qb/done, which a run removes as it starts. The arm's whole 600 s that way: after the conversion call, one call
# `setsid nohup bash /root/eaglet/bench/h200_queue.sh 1024:/root/qb/a > /root/qb/queue.log 2>&1 &` and, made at
# once (the machine stays warm 30 s between calls), waiting calls of at most 580 s each, one after the other until
# the run is done: `timeout 580 sh -c 'until [ -e /root/qb/done ]; do sleep 5; done' && cp /root/qb/res/q1024-*/* $OUT/`
# (the arm takes its 600 s and a little more to start and end, longer than one call may run).
#
# BUDGET=S (seconds instead of the arm's 600) and RESERVE=S (for export and evaluate, default 45) in the environment
# make an arm fit one device call, so no later call has to come back in time to collect it (a chain of calls broken
# for longer than the machine stays warm lost a whole run on 2026-12-04). The conversion (~41 s) is done once: a
# call `bash bench/h200_queue.sh none` only converts; the next, at once, runs in the foreground
# `BUDGET=575 bash bench/h200_queue.sh 1024:/root/qb/a` and copies /root/qb/res/q1024-*/ to $OUT (quality.json, the
# draft's tar, loss.jsonl, profile.txt, train.log and warm.log: within the 8 files a call brings back). PACE=300
# then runs bench/pace_bench.py on the arm's capture (~2 x 300 steps; give the arm ~90 s less BUDGET), pace.json beside.
# ONLY=ARM runs that arm of the ten-minutes preset alone (ten-minutes: 8,192 tokens a step; ten-minutes-16k: 16,384);
# without it every arm of the preset, one after another.
# CHUNK=1 (in the conversion call: ~3 minutes, the first of its four runs compiling cold) times the train step with the
# loss in 2,048-row chunks against one chunk a TTT step (remote.draft.loss.loss_chunk_rows), alternating, into
# /root/qb/res/loss-chunk.jsonl (launches and aten ops a step from each run's 4 profiled steps among its figures).
#
# Before it, on the device: /root/qb/a (PACK/a: data.parquet at 1,024, gguf.part-1), /root/qb/smollm2.gguf
# (gguf.part-1 + PACK/b/gguf.part-2), /root/qb/d/data.parquet (the 2,048-token data), the gguf wheel in /root/site,
# this tree in /root/eaglet. bench/h200_carry.sh does it for the 2,048-token data in two calls (a call carries 64 MiB
# with the tree) and runs this queue on it.
export PYTHONPATH=/root/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
rm -f /root/qb/done  # a call waiting on it waits for this run
cd /root/eaglet
R=/root/qb/res; mkdir -p $R
echo "start $(date +%s)"
[ -s /root/qb/model_dir ] || python3 -c "
import sys; sys.path.insert(0,'.')
from pathlib import Path
from bench.eval_bench import gguf_as_package
gguf_as_package('/root/qb/smollm2.gguf')
from remote.data import embedded_default
m,_ = embedded_default.ensure_model(Path('/root/qb/work/model'), 'bfloat16')
open('/root/qb/model_dir','w').write(str(m))
" || { echo convert failed; touch /root/qb/done; exit 1; }
M=$(cat /root/qb/model_dir)
echo "converted $(date +%s) $M"
if [ -n "${CHUNK:-}" ]; then  # CHUNK=1: the loss in 2,048-row chunks (the old fixed size) against loss_chunk_rows', alternating
    for c in 2048 0 2048 0; do
        timeout 240 python3 bench/train_bench.py --shape smollm2 --ttt 3 --tokens 8192 --doc-len 1024 --optimizer muon \
            --norms --draft-vocab 32000 --steps 48 --warmup 4 --loss-chunk $c --profile $R/loss-chunk-profile.txt \
            --out $R/loss-chunk.jsonl > /dev/null 2>> $R/loss-chunk.log
        echo "loss-chunk $c rc=$? $(date +%s)"
    done
fi
for cut in ${*:-1024:/root/qb/a 2048:/root/qb/d}; do  # arguments: CUT:FOLDER of data.parquet ... (none: convert only)
    [ "$cut" = none ] && continue
    n=${cut%%:*}-$(date +%s)  # a fresh work folder and results folder each run (a finished train folder refuses a rerun)
    timeout 700 python3 bench/quality_bench.py --model-dir $M --prepared ${cut#*:}/data.parquet --arms ten-minutes ${ONLY:+--only $ONLY} \
        --cache-root /dev/shm/q$n --work /root/qb/work$n --out $R/q$n ${BUDGET:+--budget-s $BUDGET} ${RESERVE:+--reserve-s $RESERVE}
    echo "ten-minutes $n rc=$? $(date +%s) -> $R/q$n"
    A=${ONLY:-ten-minutes}; W=/root/qb/work$n/${A%% *}  # the (first) arm's folder; beside the results: the profile, the loss curve, the trainer's own account of its time
    for d in $W/train $W/train.partial; do cp $d/profile.txt $d/loss.jsonl $R/q$n/ 2>/dev/null; done  # partial: cut off
    for f in train warm; do  # the logs without their per-step events (a device call brings back 8 files at most)
        grep -v '"event": "progress"\|"event": "train"' $W/$f.log > $R/q$n/$f.log 2>/dev/null
    done
    if [ -n "${PACE:-}" ]; then  # PACE=STEPS: the trainer's pace on this capture beside synthetic states (before the rm)
        timeout 300 python3 bench/pace_bench.py --target $M --capture-dir $W/capture --vocab-dir $W/vocab \
            --steps $PACE --work /root/qb/pace$n --out $R/q$n/pace.json > $R/q$n/pace.log 2>&1
        echo "pace $n rc=$? $(date +%s)"
    fi
    rm -rf /dev/shm/q$n
done
touch /root/qb/done
