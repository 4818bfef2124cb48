"""Two attention backends on one random-weight preset (the GPU script's ``engine`` step).

``python -m llmd.daemon.bench.backends --model random:qwen3-0.6b [--backends triton,torch]``
builds the preset once (:mod:`llmd.models.presets`: no GGUF, no ``gguf``), then one engine per
backend over those same weights, and reports

* agreement: teacher-forced logits of ``--prompts`` seeded token-id prompts (``--prompt-len``
  tokens, prefilled in chunks of 64 through each engine's own paged cache) on every backend vs
  the first: ``max |Δlogit| / max |logit|`` (must be <= ``--tolerance``, default 0.05, the
  scale of 16-bit rounding through a deep stack) and the share of positions whose argmax agrees;
* throughput: ``--requests`` greedy requests of ``--prompt-len`` prompt and ``--output-len``
  output tokens (``ignore_eos``) through each engine: output tokens per second.

Exit code 0 when every backend's logits are finite and within the tolerance, 1 otherwise. On a
CPU, ``--backends cpu,torch --dtype bfloat16 --model random:qwen3-0.6b:layers=1`` runs the same
code (the test does).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.engine import Engine
from llmd.daemon.core.request import SamplingParams
from llmd.models.presets import NumericTokenizer, build_random_model, preset_config


def seeded_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids drawn uniformly from ``[0, vocab)``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n, length), generator=g).tolist()


def compare_backends(model_name: str, backends: list[str], dtype: str, device: str, prompts: int = 4,
                     prompt_len: int = 200, requests: int = 32, output_len: int = 32,
                     kv_cache_memory: int = 2**30) -> dict:
    """Run the comparison; returns ``{"model", "rel_err": {backend: float}, "top1": {backend:
    share}, "finite": {backend: bool}, "tok_per_s": {backend: float}}`` (the first backend is the
    reference; its own entries are 0.0 / 1.0)."""
    cfg = preset_config(model_name)
    torch_dtype = getattr(torch, dtype)
    model = build_random_model(cfg, torch_dtype, device)
    tok = NumericTokenizer(cfg)
    ids = seeded_prompts(prompts, prompt_len, cfg.vocab_size)
    out = {"model": cfg.name, "rel_err": {}, "top1": {}, "finite": {}, "tok_per_s": {}}
    ref = None
    for backend in backends:
        config = EngineConfig(model=model_name, dtype=dtype, device=device, attention_backend=backend,
                              kv_cache_memory=kv_cache_memory, prefix_cache_seed=0, enable_prefix_caching=False)
        engine = Engine(model, tok, config)
        logits = torch.cat([engine.teacher_forced_logits(p) for p in ids])
        out["finite"][backend] = bool(torch.isfinite(logits).all())
        if ref is None:
            ref = logits
        out["rel_err"][backend] = float((logits - ref).abs().max() / ref.abs().max())
        out["top1"][backend] = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
        work = seeded_prompts(requests, prompt_len, cfg.vocab_size, seed=1)
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.monotonic()
        engine.generate(work, params)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        out["tok_per_s"][backend] = requests * output_len / (time.monotonic() - t0)
        del engine
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:qwen3-0.6b")
    ap.add_argument("--backends", default="triton,torch", help="comma-separated; the first is the reference")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=200)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--kv-cache-memory", type=int, default=2**30, help="bytes per engine")
    ap.add_argument("--tolerance", type=float, default=0.05)
    a = ap.parse_args(argv)
    r = compare_backends(a.model, a.backends.split(","), a.dtype, a.device, a.prompts, a.prompt_len, a.requests,
                         a.output_len, a.kv_cache_memory)
    ok = True
    print(f"{r['model']}: {a.dtype} on {a.device}; {a.prompts} x {a.prompt_len}-token prompts teacher-forced; "
          f"{a.requests} requests x {a.output_len} output tokens")
    for b in r["rel_err"]:
        good = r["finite"][b] and r["rel_err"][b] <= a.tolerance
        ok &= good
        print(f"{b:8s} max|dlogit|/max|logit| {r['rel_err'][b]:.2e}  top-1 agree {100 * r['top1'][b]:6.2f}%  "
              f"finite {r['finite'][b]}  {r['tok_per_s'][b]:9.1f} out tok/s  {'ok' if good else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
