#!/bin/bash
# The trainer's compile for an arm of issue 12's 10-minute preset (bench/quality_arms.json) with torch's own log of
# it, in one device call and no carried model: SmolLM2-135M-Instruct's shape (bench/smollm2-config.json) with random
# weights (the graphs depend on shapes and settings alone), then `bench.warm` (two steps and two held-out
# evaluations: the real run's graphs) under TORCH_LOGS=dynamo,recompiles,graph_breaks (each frame's tracing and
# compile in order, timed, and why a graph recompiled or broke). What it is for: at 16,384 tokens a step the first
# step's graphs took 238-268 s to compile on an H200 where 8,192 took 70-100 s (docs/TRAINING.md, the seventh try).
#     ARM=ten-minutes-16k T=200 bash bench/compile_log.sh     # the log and a summary in $OUT (default /tmp/compile-log)
# COMPILE=yes compiles on a CPU too (auto: on a GPU only); TB=N sets the tokens a step. T bounds the warm run in
# seconds; the figures (compile seconds, graphs) come from its manifest when it ends in time. Here (`TB=1024
# COMPILE=yes`, 2 CPU cores): 5 graphs, two of them the held-out evaluation's recompiles (grad mode), 11 s cold, 3 s
# with Inductor's cache warm.
set -u
ARM=${ARM:-ten-minutes-16k}; O=${OUT:-/tmp/compile-log}; M=${MODEL:-/tmp/compile-log-model}; W=$M-warm-$ARM
mkdir -p "$M" "$O" && cp "$(dirname "$0")/smollm2-config.json" "$M/config.json" || exit 1
python3 -c "
import torch, transformers
model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained('$M'), dtype=torch.bfloat16)
model.save_pretrained('$M')" || exit 1
rm -rf "$W" "$W.partial"
python3 -c "
import json, sys
arm = next(x for x in json.load(open('$(dirname "$0")/quality_arms.json'))['ten-minutes'] if x['name'] == '$ARM')
train = {**arm['train'], 'compile': '${COMPILE:-auto}', **({'token_budget': int('${TB:-}')} if '${TB:-}' else {})}
json.dump({'target': '$M', 'out_dir': '$W', 'draft_vocab_size': 32000, 'nice': 0, 'train': train}, sys.stdout)
" > "$M.warm.json" || exit 1
s=$(date +%s)
TORCH_LOGS=dynamo,recompiles,graph_breaks timeout "${T:-200}" python3 -m bench.warm --config "$M.warm.json" \
    > "$O/warm-$ARM.log" 2>&1
echo "warm of $ARM: rc=$? in $(( $(date +%s) - s )) s" | tee "$O/summary-$ARM.txt"
cp "$W/manifest.json" "$O/manifest-$ARM.json" 2>/dev/null
grep -E "start tracing|done compiler function|Graph break|Recompiling|__recompiles\]     - " "$O/warm-$ARM.log" | cut -c1-240 \
    | tee -a "$O/summary-$ARM.txt" | head -60
