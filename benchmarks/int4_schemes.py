"""Which 4-bit KV scheme to build next (issue 19): HF transformers' float32 model from the GGUF,
with K and V fake-quantized inside attention, teacher-forced on the first 1,000 tokens of the
kv-quality text; ΔNLL and top-1 vs the unquantized run.

Schemes: llmd's int4 today (K and V per token in groups of 16 channels, symmetric, float16
scales; K rotated by the Walsh-Hadamard matrix), and KIVI's (arXiv:2402.02750) K per channel
over blocks of 16 tokens (asymmetric: float16 scale and zero point per (block, head, channel);
the open block left unquantized, as KIVI's residual) with V per token.

Usage: ``python benchmarks/int4_schemes.py [smollm2-135m | gemma3-270m]`` (~1-3 min on 2 cores).
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from llmd.daemon.bench.kv_quality_text import QUALITY_TEXT
from llmd.models.registry import resolve_model
from llmd.quant.rotation import rotate

F16_MIN = 2.0**-14


def per_token(x: torch.Tensor, group: int = 16, asym: bool = False) -> torch.Tensor:
    """``x [..., head_dim]`` through 4-bit codes per (token, head, ``group`` channels)."""
    xf = x.float().unflatten(-1, (-1, group))
    if asym:
        lo, hi = xf.amin(-1, keepdim=True), xf.amax(-1, keepdim=True)
        s, z = ((hi - lo) / 15).clamp(min=F16_MIN).half().float(), lo.half().float()
        return (torch.round((xf - z) / s).clamp(0, 15) * s + z).flatten(-2).to(x.dtype)
    s = (xf.abs().amax(-1, keepdim=True) / 7).clamp(min=F16_MIN).half().float()
    return (torch.round(xf / s).clamp(-7, 7) * s).flatten(-2).to(x.dtype)


def per_channel(x: torch.Tensor, block: int = 16) -> torch.Tensor:
    """KIVI's K: ``x [B, heads, L, head_dim]`` through asymmetric 4-bit codes per (block of
    ``block`` tokens, head, channel); the last, partial block stays as it is (the residual)."""
    full = x.shape[2] // block * block
    xf = x[:, :, :full].float().unflatten(2, (-1, block))
    lo, hi = xf.amin(3, keepdim=True), xf.amax(3, keepdim=True)
    s, z = ((hi - lo) / 15).clamp(min=F16_MIN).half().float(), lo.half().float()
    q = (torch.round((xf - z) / s).clamp(0, 15) * s + z).flatten(2, 3)
    return torch.cat([q, x[:, :, full:].float()], 2).to(x.dtype)


def hadamard_then(fn):
    return lambda k: rotate(fn(rotate(k, "hadamard")), "hadamard").to(k.dtype)


SCHEMES = {
    "none (16-bit)": (lambda k: k, lambda v: v),
    "llmd int4 today: K per token/16 + hadamard, V per token/16": (hadamard_then(per_token), per_token),
    "  today's K alone": (hadamard_then(per_token), lambda v: v),
    "  today's V alone": (lambda k: k, per_token),
    "KIVI: K per channel/16 tokens asym, V per token/16": (per_channel, per_token),
    "KIVI: K per channel/16 tokens asym, V per token/16 asym": (per_channel, lambda v: per_token(v, asym=True)),
    "  KIVI's K alone": (per_channel, lambda v: v),
}


def main(name: str = "smollm2-135m") -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    path = resolve_model(name)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    ids = tok(QUALITY_TEXT)["input_ids"][:1000]
    target = torch.tensor(ids[1:])[:, None]
    base = None
    for label, (fk, fv) in SCHEMES.items():
        def attention(module, query, key, value, mask, _fk=fk, _fv=fv, **kw):
            return sdpa_attention_forward(module, query, _fk(key), _fv(value), mask, **kw)

        AttentionInterface.register("int4_scheme", attention)
        ALL_MASK_ATTENTION_FUNCTIONS.register("int4_scheme", sdpa_mask)  # keeps Gemma's sliding windows
        model.config._attn_implementation = "int4_scheme"
        with torch.inference_mode():
            logits = model(torch.tensor([ids])).logits[0, :-1].float()
        nll = -torch.log_softmax(logits, -1).gather(1, target).mean().item()
        top = logits.argmax(-1)
        base = base or (nll, top)
        print(f"{label:<60} NLL {nll:.4f}  ΔNLL {100 * (nll - base[0]) / base[0]:+6.2f} %  "
              f"top-1 {100 * (top == base[1]).float().mean().item():5.1f} %", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
