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
#              the per-dtype budget, bf16 / fp16 / fp32 models x auto / int8 / fp8 / int4 KV (int4:
#              the KIVI store's bytes on CUDA equal the CPU's, its decode / prefill kernels vs the
#              read rule's float64 reference; llmd.kernels.kivi_check) (python -m llmd.kernels.bench check)
#   e2e        nano-vllm's workload end to end on random:qwen3-0.6b (256 requests, prompt and output
#              lengths U[100, 1024], ignore_eos, --max-num-seqs 256, CUDA graphs for decode): output
#              tok/s (target 20,000 on an H200), host ms per decode step (target <= 2), greedy tokens
#              graphs vs eager (python -m llmd.daemon.bench.e2e)
#   pytest     tests/kernels/test_kernels.py and test_decode_graph_splits.py on CUDA (pairwise shapes,
#              static-scale clamping, the > 2^31-element cache, per-sequence splits and slot -1), if
#              pytest is installed (--noconftest: no model needed)
#   engine-qwen3, engine-llama3 (60 s each; llama3 gave 30 s to check's int4 rows)
#              the whole engine on random-weight presets of real shapes (random:qwen3-0.6b,
#              random:llama-3-8b; no GGUF needed), triton vs torch attention backends on the same
#              weights: teacher-forced logits agree within 5 % of max |logit|, and out tok/s of
#              32 greedy requests (python -m llmd.daemon.bench.backends)
#   bench      paged decode on the Llama-3-8B attention shape vs pinned SDPA and a d2d copy, KV
#              bf16 / int8 / fp8 / int4 (python -m llmd.kernels.bench bench)
# Budget: one 15-minute device lease. The limits add up to 680 s (11.3 min, install included), plus at
# most 5 s of kill grace per step: <= 12 min even if every step hangs (tests/bench/test_gpu_script.py
# checks the sum).
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
    timeout -k 5 "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >> "$results"
    tail -n 3 "$out/$name.log"
    echo "-- $name: exit $rc after $((SECONDS - t0)) s"
}

step env 30 python -c "
import torch, triton
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__)
print('device', torch.cuda.get_device_name(0), 'capability', torch.cuda.get_device_capability(0))
"
if python -c "import llmd.kernels.bench" > /dev/null 2>&1; then
    printf 'install\tskipped (llmd imports)\t0\n' >> "$results"
else
    step install 80 pip install --no-deps --no-build-isolation -e .
fi
step check 120 python -m llmd.kernels.bench check
step e2e 150 python -m llmd.daemon.bench.e2e --model random:qwen3-0.6b --requests 256 --min-len 100 --max-len 1024 \
    --max-num-seqs 256 --max-model-len 4096
if python -c "import pytest" > /dev/null 2>&1; then
    step pytest 90 python -m pytest tests/kernels/test_kernels.py tests/kernels/test_decode_graph_splits.py -q \
        -p no:cacheprovider --noconftest --durations=5
else
    printf 'pytest\tskipped (no pytest)\t0\n' >> "$results"
fi
step engine-qwen3 60 python -m llmd.daemon.bench.backends --model random:qwen3-0.6b --backends triton,torch
step bench 90 python -m llmd.kernels.bench bench
step engine-llama3 60 python -m llmd.daemon.bench.backends --model random:llama-3-8b --backends triton,torch
echo
cat "$results"
