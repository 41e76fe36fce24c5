#!/bin/bash
# The trainer's pace on the SmolLM2 shape on one H200, before (an old tree, unpacked at $OLD) and after, side by
# side in one call: bench/read_bench.py (a step's read) and bench/train_bench.py (a step, AdamW, the shape's own
# draft vocabulary: what both trees can run), then the 10-minute recipe's step (Muon + AdamW, the three norms, a
# 32,000-token draft vocabulary) profiled, at 8,192 and 32,768 tokens a step. Results into $1 (one JSON line a
# measurement, the profile's tables in prof.txt).
#
#     bash bench/h200_speed.sh OUT [OLD]        # OLD: a tree of `git archive REV remote bench`
R=${1:?out folder}; OLD=${2:-}; mkdir -p "$R"
export PYTHONUNBUFFERED=1
run() {  # label, tree, command...
    local label=$1 tree=$2; shift 2
    echo "== $label $(date +%s)"
    (cd "$tree" && timeout 170 "$@" --out "$R/$label.jsonl") || echo "$label rc=$?"
}
here=$(pwd)
read_args=(python3 bench/read_bench.py --shape smollm2 --samples 64 --doc-len 1024 --steps 32 --dir /dev/shm/rb)
step_args=(python3 bench/train_bench.py --shape smollm2 --ttt 3 --tokens 8192 --doc-len 1024 --steps 16)
[ -n "$OLD" ] && run read-old "$OLD" "${read_args[@]}"
run read-new "$here" "${read_args[@]}"
[ -n "$OLD" ] && run step-old "$OLD" "${step_args[@]}"
run step-new "$here" "${step_args[@]}"
run recipe-8192 "$here" "${step_args[@]}" --optimizer muon --norms --draft-vocab 32000 --profile "$R/prof.txt"
run recipe-32768 "$here" "${step_args[@]/8192/32768}" --optimizer muon --norms --draft-vocab 32000
echo "done $(date +%s)"
