"""The fused single-stream decode kernel (``kernels/native/fused_decode.c``) against a float64
reference of the same step (``fused_reference.py``: the kernel's int8 activation quantization,
the rest in float64) on random tiny models.

The products (Q4 and Q8 packs, every K) and the K/V rows the first layer stores match to float32
rounding. Deeper in the step the kernel's float32 values and the reference's float64 ones can
fall on opposite sides of an activation code's rounding boundary (about one code per layer), and a
random network amplifies those one-code differences: the whole step matches to 1e-5 relative
(float32 rounding, ~1e-7 in most cases), or, where such a difference occurred, is still much closer
to the quantized reference than the quantization itself moves the result (a wrong head mapping,
RoPE or softmax moves it by far more)."""

import fused_reference
import pytest
import torch
from fused_reference import decode_step, product, rms_norm

from llmd.kernels import cpu_fused

pytestmark = pytest.mark.skipif(not cpu_fused.available(64, 3), reason="fused kernel unavailable on this CPU")


def _q4(n, k, gen):
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.04 + 0.01).half()
    mins = (-8 * scales.float() + torch.randn(n, k // 32, generator=gen) * 0.01).half()
    return "q4", (codes, scales, mins)


def _q8(n, k, gen):
    codes = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    return "q8", (codes, (torch.rand(n, k // 32, generator=gen) * 0.004 + 0.001).half())


def make(hidden, inter, heads, kv_heads, head_dim, layers, block_size, num_blocks, kv_dtype, window, seed):
    """Random layers (Q4 and Q8 products alternating), final norm, Q8 head [256, hidden], embeddings."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(layers):
        kind = (_q4, _q8)[i % 2]
        kv = (torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=gen) * 0.5).to(kv_dtype)
        out.append(cpu_fused.FusedLayer(
            1 + 0.1 * torch.randn(hidden, generator=gen), 1 + 0.1 * torch.randn(hidden, generator=gen),
            kind((heads + 2 * kv_heads) * head_dim, hidden, gen), kind(hidden, heads * head_dim, gen),
            kind(2 * inter, hidden, gen), kind(hidden, inter, gen), kv, window))
    return out, 1 + 0.1 * torch.randn(hidden, generator=gen), _q8(256, hidden, gen), \
        torch.randn(256, hidden, generator=gen).to(torch.float32 if kv_dtype == torch.float16 else kv_dtype)  # model's


def _copy(layers):
    return [cpu_fused.FusedLayer(lay.attn_norm, lay.ffn_norm, lay.qkv, lay.o, lay.gate_up, lay.down, lay.kv.clone(),
                                 lay.window) for lay in layers]


@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("kind", ["q4", "q8"])
@pytest.mark.parametrize("hidden", [64, 576, 1024, 1536])
def test_products_match_float64(kind, hidden, levels, monkeypatch):
    """No layers: the logits are the head's product of the normed, quantized embedding."""
    monkeypatch.setattr(fused_reference, "LEVELS", levels)
    gen = torch.Generator().manual_seed(hidden)
    head = (_q4 if kind == "q4" else _q8)(64, hidden, gen)
    embed, norm = torch.randn(8, hidden, generator=gen), 1 + 0.1 * torch.randn(hidden, generator=gen)
    dec = cpu_fused.FusedDecoder([], norm, head, embed, 2, 1, 32, 1e-6, 0.1, 1e4, 16, act_levels=levels,
                                 specialize=False)
    got = dec(5, 0, 0, torch.zeros(1, dtype=torch.int32), 1)[0].double()
    want = product(head, rms_norm(embed[5].double(), norm, 1e-6))
    assert (got - want).abs().max().item() <= 1e-5 * want.abs().max().item()


SMOLLM2_SHAPE = (192, 384, 3, 1, 64, 16, None)  # SmolLM2's head_dim and group (the specialized build)
SHAPES = [  # hidden, inter, heads, kv_heads, head_dim, block_size, window
    (128, 256, 4, 4, 32, 16, None),
    SMOLLM2_SHAPE,
    (256, 512, 8, 2, 32, 32, None),
    (128, 192, 4, 1, 32, 16, 20),
    (256, 256, 2, 1, 128, 32, None),
    (128, 192, 4, 1, 32, 64, 40),  # a block of 4 runs of 16 slots, a window starting inside one
]


def _exact_input(x):
    x = x.double().view(-1, 32)
    return x.flatten(), torch.ones(x.shape[0], dtype=torch.float64), x.sum(-1)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kv_dtype,levels", [(torch.float32, 1), (torch.float32, 2), (torch.bfloat16, 2),
                                             (torch.float16, 2)])  # float16: a float32 model's --kv-cache-dtype float16
def test_fused_step_matches_float64_reference(shape, kv_dtype, levels, monkeypatch):
    monkeypatch.setattr(fused_reference, "LEVELS", levels)
    hidden, inter, heads, kv_heads, head_dim, bs, window = shape
    theta, eps, scale = 10000.0, 1e-5, head_dim**-0.5
    for seed, seq_len in ((0, 1), (1, 37), (2, 3 * bs)):
        layers, final_norm, head, embed = make(hidden, inter, heads, kv_heads, head_dim, 2, bs, 12, kv_dtype, window,
                                               seed)
        gen = torch.Generator().manual_seed(100 + seed)
        table = torch.cat((torch.randperm(11, generator=gen)[: -(-seq_len // bs)].to(torch.int32) + 1,
                           torch.zeros(4, dtype=torch.int32)))
        pos = seq_len - 1
        slot = int(table[pos // bs]) * bs + pos % bs
        ref, unq = _copy(layers), _copy(layers)
        dec = cpu_fused.FusedDecoder(layers, final_norm, head, embed, heads, kv_heads, head_dim, eps, scale, theta, bs,
                                     act_levels=levels, specialize=shape == SMOLLM2_SHAPE)
        token = 7 + seed
        got = dec(token, pos, slot, table, seq_len)[0].double()
        args = (final_norm, head, embed[token], heads, kv_heads, head_dim, eps, scale, theta, pos, slot, table,
                seq_len, bs)
        want = decode_step(ref, *args)
        with monkeypatch.context() as m:
            m.setattr(fused_reference, "quantized_input", _exact_input)
            unquantized = decode_step(unq, *args)
        err, moved = (got - want).abs().max().item(), (want - unquantized).abs().max().item()
        top = want.abs().max().item()
        if levels == 1:  # float32 rounding (~1e-7 relative), or a one-code activation difference amplified
            assert err <= 1e-5 * top or err <= 0.35 * moved, (seed, err, moved)
        else:  # residual codes: one-step differences ~1/254 as large, and many more of them (measured <= 1.6e-4);
            # a bfloat16 (float16) cache adds one-ulp (2^-9, 2^-11) differences in the K/V rows later layers store
            assert err <= (5e-4 if kv_dtype == torch.float32 else 1e-2) * top, (seed, err / top)
        k, r = (lay.kv.view(2, -1, kv_heads, head_dim)[:, slot].double() for lay in (layers[0], ref[0]))
        tol = {torch.float32: 1e-5, torch.float16: 2**-10}.get(kv_dtype, 2**-8)
        assert (k - r).abs().max().item() <= tol * r.abs().max().item()
