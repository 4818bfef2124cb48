"""``llmd bench beam``: peak KV blocks held by one beam-search request with shared blocks vs
the same search copying its blocks, and vs ``beam_width`` independent greedy requests.

The PagedAttention paper (Kwon et al., SOSP'23, section 6.3) measured 37.6-55.2 % of the KV
memory saved by sharing beams' blocks (beam widths 2-6). One engine, prefix caching **off**
(with it on, independent requests would share the prompt's full blocks anyway), one fixed
prompt of ``prompt_tokens`` tokens (the head of the kv-quality text), ``ignore_eos`` so every
sequence reaches exactly ``output_tokens`` new tokens. Three runs, one after another:

1. ``shared``: one beam search of ``beam_width`` beams (forks share blocks, the partly filled
   last block is copied on write, dropped beams free theirs at once);
2. ``copied``: the same search with ``engine.beams.share_blocks = False`` (every fork copies
   every block: what beams cost without paging);
3. ``independent``: ``beam_width`` greedy requests of the prompt, ``output_tokens`` each.

The figure per run is the most blocks in use after any step (``kv_manager.num_used_blocks``,
all KV cache groups), with ``check_integrity()`` after every step.
"""

from __future__ import annotations

from collections.abc import Callable

from llmd.daemon.core.parallel import child_request_ids
from llmd.daemon.core.request import SamplingParams

TARGET = 0.35  # the target: >= 35 % fewer blocks than independent sequences


def _peak(engine) -> tuple[int, int]:
    """Step to completion; (peak blocks in use, steps)."""
    peak = steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.kv_manager.check_integrity()
        peak = max(peak, engine.kv_manager.num_used_blocks)
        steps += 1
    return peak, steps


def measure_beam_blocks(engine, prompt: list[int], beam_width: int, output_tokens: int) -> dict:
    """The three runs of the module docstring on ``engine`` (prefix caching must be off).

    Returns ``{"shared", "copied", "independent"}`` peak blocks, ``"saved_vs_independent"`` and
    ``"saved_vs_copied"`` (fractions), ``"block_size"``. Raises ``ValueError`` if prefix
    caching is on."""
    if engine.kv_manager.enable_caching:
        raise ValueError("bench beam measures with prefix caching off (--no-prefix-caching)")
    beam = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True, use_beam_search=True,
                          length_penalty=0.0)
    out = {"block_size": engine.kv_manager.block_size}
    for name, share in (("shared", True), ("copied", False)):
        engine.beams.share_blocks = share
        engine.add_parallel_request(list(prompt), beam, child_request_ids(f"bench-{name}", beam_width))
        out[name] = _peak(engine)[0]
    engine.beams.share_blocks = True
    for i in range(beam_width):
        engine.add_request(list(prompt), SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True),
                           f"bench-greedy-{i}")
    out["independent"] = _peak(engine)[0]
    out["saved_vs_independent"] = 1 - out["shared"] / out["independent"]
    out["saved_vs_copied"] = 1 - out["shared"] / out["copied"]
    return out


def run_beam_bench(engine, prompt_tokens: int, output_tokens: int, beam_width: int,
                   echo: Callable[[str], None] = print) -> dict:
    """Tokenize the fixed text, cut it to ``prompt_tokens``, measure, print the table."""
    from llmd.daemon.bench.kv_quality_text import QUALITY_TEXT

    ids = engine.tokenizer.encode(QUALITY_TEXT)
    if len(ids) < prompt_tokens:
        raise ValueError(f"the fixed text has only {len(ids)} tokens; --prompt-tokens must be at most that")
    r = measure_beam_blocks(engine, ids[:prompt_tokens], beam_width, output_tokens)
    bs = r["block_size"]
    echo(f"beam width {beam_width}, prompt {prompt_tokens} + output {output_tokens} tokens, block size {bs}, "
         "prefix caching off")
    echo(f"  {'run':<34} peak blocks")
    echo(f"  {'beam search, shared blocks':<34} {r['shared']:>11}")
    echo(f"  {'beam search, blocks copied':<34} {r['copied']:>11}")
    echo(f"  {f'{beam_width} independent greedy requests':<34} {r['independent']:>11}")
    ok = "met" if r["saved_vs_independent"] >= TARGET else "NOT met"
    echo(f"  shared: {100 * r['saved_vs_independent']:.1f} % fewer blocks than independent sequences "
         f"(target >= {100 * TARGET:.0f} %: {ok}), {100 * r['saved_vs_copied']:.1f} % fewer than copied beams")
    return r
