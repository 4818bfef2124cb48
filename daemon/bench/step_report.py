"""The table of ``llmd bench step`` (:mod:`llmd.daemon.bench.step`): component times in ms,
the floors, the ratios, and issue 13's targets beside the rows they apply to."""

from __future__ import annotations

REFERENCE = "torch"  # the attention backend the f/r ratios divide by
TARGET_BATCH, TARGET_CONTEXT = 32, 512
TARGET_ATTN, TARGET_STEP = 1.5, 1.3  # attention / KV-read floor; step / (linears + lm_head + KV-read floor)


def num(x: float, width: int) -> str:
    """``x`` right-aligned in ``width`` characters with about 3-4 significant digits."""
    if x != x:
        return f"{'nan':>{width}}"
    return f"{x:>{width}.{0 if abs(x) >= 100 else 1 if abs(x) >= 10 else 2 if abs(x) >= 0.1 else 4}f}"


def attn_ratio(r) -> float:
    """Attention / KV-read floor: the row's paired median, else attention / KV_flr."""
    paired = getattr(r, "attn_ratio", float("nan"))
    return paired if paired == paired else r.attention / r.kv_floor


def step_ratio(r) -> float:
    """Step / (linears + lm_head + KV-read floor): the row's paired median, else of the medians."""
    paired = getattr(r, "step_ratio", float("nan"))
    return paired if paired == paired else r.step / r.floor


def format_table(rows: list) -> list[str]:
    """Lines of the table for :class:`llmd.daemon.bench.step.StepTimes` rows (times in seconds
    there, printed in ms), the ratios, and the targets."""
    ref = {(r.dtype, r.batch, r.context): r for r in rows if r.backend == REFERENCE}
    cols = ["prep", "linears", "lm_head", "attn", "rest", "sample", "step", "KV_MB", "KV_flr", "attn/KV", "step/flr",
            "KV_gth", "attn/gth", "f/r_step", "f/r_attn", "other%"]
    lines = ["ms per step; KV_flr = KV bytes read / read bandwidth; attn/KV = median over repetitions of attn / "
             "the KV_flr of the bandwidth read just before it; step/flr = median over repetitions of step / (linears + "
             "lm_head + KV_flr), the four measured back to back in each; "
             "KV_gth = the same K/V bytes read through the block tables and nothing else; attn/gth = median over "
             "repetitions of attn / the KV_gth read just before it; "
             f"f/r = this backend / {REFERENCE}; other% = other processes' share of all cores; "
             "GB/s = median of the read bandwidths measured before each attention repetition (KV_flr's divisor)",
             f"{'dtype':<9}{'backend':<8}{'batch':>6}{'ctx':>6}" + "".join(f"{c:>9}" for c in cols) + f"{'GB/s':>7}"]
    for r in rows:
        base = ref.get((r.dtype, r.batch, r.context))
        vals = [1e3 * x for x in (r.prep, r.linears, r.lm_head, r.attention, r.rest, r.sample, r.step)]
        vals += [r.kv_bytes / 1e6, 1e3 * r.kv_floor, attn_ratio(r), step_ratio(r)]
        vals += [1e3 * getattr(r, "gather", float("nan")), getattr(r, "gather_ratio", float("nan"))]
        fr = [r.step / base.step, r.attention / base.attention] if base and r.backend != REFERENCE else None
        lines.append(f"{r.dtype:<9}{r.backend:<8}{r.batch:>6}{r.context:>6}" + "".join(num(v, 9) for v in vals)
                     + ("".join(num(v, 9) for v in fr) if fr else f"{'-':>9}{'-':>9}") + f"{100 * r.cpu_other:>9.0f}"
                     + f"{r.bandwidth / 1e9:>7.1f}")
    lines.append(f"targets (issue 13) at batch {TARGET_BATCH}, context {TARGET_CONTEXT}: attention <= {TARGET_ATTN}x "
                 f"its KV-read floor; step <= {TARGET_STEP}x (linears + lm_head + KV-read floor)")
    hits = [r for r in rows if (r.batch, r.context) == (TARGET_BATCH, TARGET_CONTEXT)]
    for r in hits:
        a, s = attn_ratio(r), step_ratio(r)
        lines.append(f"  {r.dtype} {r.backend}: attention {a:.2f}x ({'met' if a <= TARGET_ATTN else 'not met'}), "
                     f"step {s:.2f}x ({'met' if s <= TARGET_STEP else 'not met'})")
    if not hits:
        lines.append(f"  (no row at batch {TARGET_BATCH}, context {TARGET_CONTEXT}: add them to --batch / --context)")
    return lines
