#!/usr/bin/env bash
# GPU checks for issue 4 (run on a CUDA machine from the repo root, in the venv with a CUDA torch):
#   1. the kernel tests compiled for the device (no interpreter): Q2 pairwise shapes, static-scale
#      clamping, the > 2^31-element cache, SmolLM2 triton vs torch backend;
#   2. llmd bench kernels: paged decode on the Llama-3-8B attention shape vs SDPA and a d2d copy.
# Usage: bash benchmarks/gpu_kernels.sh [outdir]   (results land in outdir, default ./gpu-results)
set -euo pipefail
out="${1:-gpu-results}"
mkdir -p "$out"
unset TRITON_INTERPRET
python - <<'PY' | tee "$out/env.txt"
import torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "device", torch.cuda.get_device_name(0))
PY
timeout 420 python -m pytest tests/test_kernels.py tests/test_kv_quant.py -q -p no:cacheprovider -x 2>&1 | tee "$out/tests.txt" | tail -5
timeout 300 llmd bench kernels 2>&1 | tee "$out/bench_kernels.txt"
