#!/usr/bin/env bash
# GPU checks of the Triton kernels (issue 15), on a CUDA machine, from the repo root:
#   bash benchmarks/gpu_kernels.sh [outdir]        (default ./gpu-results)
#
# Needs torch + triton (+ pytest if present); not gguf, textual or a model package. Every step
# runs on its own under a time limit (no `set -e`: a failing or hanging step never stops the
# next one) and appends "step<TAB>exit code<TAB>seconds" to OUTDIR/results.tsv; its output goes
# to OUTDIR/<step>.log. Exit code 124 = the step hit its time limit. Steps, most important first:
#   env        torch / triton versions, device name and compute capability
#   install    pip install --no-deps --no-build-isolation -e .  (skipped if llmd already imports)
#   check      every kernel compiled for this device vs the float64 reference: store_kv bytes
#              equal to the torch reference's, decode (direct, split + merge) and prefill within
#              the per-dtype budget, bf16 / fp16 / fp32 models x auto / int8 / fp8 KV
#              (python -m llmd.kernels.bench check)
#   pytest     tests/kernels/test_kernels.py on CUDA (pairwise shapes, static-scale clamping, the
#              > 2^31-element cache), if pytest is installed (--noconftest: no model needed)
#   engine-qwen3, engine-llama3
#              the whole engine on random-weight presets of real shapes (random:qwen3-0.6b,
#              random:llama-3-8b; no GGUF needed), triton vs torch attention backends on the same
#              weights: teacher-forced logits agree within 5 % of max |logit|, and out tok/s of
#              32 greedy requests (python -m llmd.daemon.bench.backends)
#   bench      paged decode on the Llama-3-8B attention shape vs pinned SDPA and a d2d copy
#              (python -m llmd.kernels.bench bench)
# Budget: the limits add up to 18 minutes (install skipped); a healthy H200 run should take well under half.
out="${1:-gpu-results}"
mkdir -p "$out"
results="$out/results.tsv"
printf 'step\texit\tseconds\n' > "$results"
unset TRITON_INTERPRET
export PYTHONUNBUFFERED=1

step() {  # step NAME LIMIT_S COMMAND...
    local name="$1" limit="$2"
    shift 2
    local t0=$SECONDS
    echo "== $name (limit ${limit}s): $*"
    timeout -k 10 "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$results"
    tail -n 3 "$out/$name.log"
    echo "-- $name: exit $rc after $((SECONDS - t0)) s"
}

step env 60 python -c "
import torch, triton
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)
print('device', torch.cuda.get_device_name(0), 'capability', torch.cuda.get_device_capability(0))
"
if python -c "import llmd.kernels.bench" > /dev/null 2>&1; then
    printf 'install\tskipped (llmd imports)\t0\n' >> "$results"
else
    step install 180 pip install --no-deps --no-build-isolation -e .
fi
step check 240 python -m llmd.kernels.bench check
if python -c "import pytest" > /dev/null 2>&1; then
    step pytest 300 python -m pytest tests/kernels/test_kernels.py -q -p no:cacheprovider --noconftest \
        --durations=5
else
    printf 'pytest\tskipped (no pytest)\t0\n' >> "$results"
fi
step engine-qwen3 120 python -m llmd.daemon.bench.backends --model random:qwen3-0.6b --backends triton,torch
step engine-llama3 120 python -m llmd.daemon.bench.backends --model random:llama-3-8b --backends triton,torch
step bench 240 python -m llmd.kernels.bench bench
echo
cat "$results"
