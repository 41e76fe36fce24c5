#!/bin/bash
# The H200 session's queue (2026-12-03): the 10-minute arm, the transformers capture's rows vs one packed
# row, regenerated vs original answers, one after another, results into /root/qb/res. Started detached
# (setsid) by a device call, so no call's 10-minute limit cuts a job; later calls wait on /root/qb/done.
#
# Before it, on the device: /root/qb/a (PACK/a: data.parquet, gguf.part-1), /root/qb/smollm2.gguf
# (gguf.part-1 + PACK/b/gguf.part-2), /root/qb/c/original.jsonl (bench/regen_quality_bench.first_turns of the
# embedded default's sharegpt-all, 3,000 conversations), the wheels in /root/site, this tree in /root/eaglet.
export PYTHONPATH=/root/site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
cd /root/eaglet
R=/root/qb/res; mkdir -p $R
echo "start $(date +%s)"
python3 -c "
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
timeout 700 python3 bench/quality_bench.py --model-dir $M --prepared /root/qb/a/data.parquet --arms ten-minutes \
    --cache-root /dev/shm/qb10 --work /root/qb/work10 --out $R/q10
echo "ten-minutes rc=$? $(date +%s)"
timeout 240 python3 bench/hf_capture_bench.py --model-dir $M --prepared /root/qb/a/data.parquet --samples 1024 \
    --pack-tokens 8192 32768 --rounds 2 --out $R/hf_capture.json
echo "hf_capture rc=$? $(date +%s)"
timeout 900 python3 bench/regen_quality_bench.py --model-dir $M --conversations /root/qb/c/original.jsonl --prompts 3000 \
    --max-tokens 512 --batch-size 1024 --epochs 2 --work /root/qb/regen --cache-root /dev/shm/rq --out $R
echo "regen rc=$? $(date +%s)"
touch /root/qb/done
