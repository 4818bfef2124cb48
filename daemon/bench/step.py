"""``llmd bench step``: where one decode step's time goes, beside its two floors (issue 13).

Every sequence of the batch has ``context`` tokens cached and decodes one token. The step is
timed whole (``ModelRunner.execute``: preparation, forward, LM head, sampling) and by
component, each called alone on the same step, so no profiler overhead enters:

- ``prep``: ``runner.prepare_inputs`` (ids, positions, slot mapping, block tables);
- ``linears``: a matmul-only replay of every 2-D weight of every layer (whatever the layers
  hold: separate or fused Q/K/V and gate/up) on ``[batch, in_features]`` random activations.
  This is also the first floor: the projections at this batch with nothing else around them;
- ``lm_head``: ``model.compute_logits`` on ``[batch, hidden]`` (tied embedding or own head);
- ``attention``: ``kernels.store_kv`` (told whether the step pads its slots, as the forward
  does) + ``kernels.paged_attention`` for every layer, with the step's real metadata (rebuilt
  by ``prepare_inputs`` before each repetition, untimed, so anything a backend builds once per
  step is counted) and random q/k/v of the model's shapes; where the forward stores K/V inside
  its RoPE pass (:mod:`llmd.models.glue_forward`), the forward's own attention block
  (:func:`llmd.models.glue_forward.attention`: that pass on a random QKV row, RoPE included, then
  the same ``paged_attention``);
- ``rest``: the forward (``model(...)``) minus linears and attention: embedding, norms, RoPE,
  activations, residuals, and whatever the real projections cost beyond the replay;
- ``sample``: ``runner.sampler`` on the step's logits (greedy).

Beside the floors, the **KV-gather read**: the same K/V bytes read through the step's block tables
in the decode kernel's order, one block prefetched ahead as the kernel does, summed and nothing
else (``kernels/native/kv_read.c``), timed just before each attention repetition: ``KV_gth`` its
median, ``attn/gth`` the median of attention ÷ the gather read before it. It is the read speed
this machine gives for the paged layout (blocks of 16 slots scattered over the pool) rather than
for one long stream; on the 2-core Zen 4 (2026-12-06) it ran at 14–26 GB/s while ``x.sum()``
read 26–48 GB/s, and the bfloat16 decode attention took 1.06–1.32× its time.

The second floor is the KV-read floor: the K/V bytes the step must read (every layer's
``context + 1`` tokens, or its sliding window, of every sequence; scales included for int8/fp8
caches) ÷ this machine's read bandwidth, measured in the same run as the best of several
``x.sum()`` over a large float32 tensor: once at the start (the header line), and in each row
just before every repetition of its attention (best of two sums): the row's ``GB/s`` is the
median of those, its ``KV_flr`` the bytes ÷ that median, and its ``attn/KV`` the median over the
repetitions of each attention time ÷ the floor of the bandwidth read just before it. On a shared
machine the bandwidth can swing ~2× within minutes (seen on 2026-12-03: 7.7 to 18.4 GB/s in one
hour; on 2026-12-06, with ``x.sum()`` steady, attention alone took 16 or 22 ms a few minutes
apart), so only a probe taken back to back with each timed attention divides by the same machine
phase. For the same reason ``step/flr`` is paired too (:func:`paired_step`): each repetition reads
the bandwidth, then times the linears' replay, the LM head and the whole step back to back, and
the ratio is the median of step ÷ (linears + lm_head + KV bytes ÷ that bandwidth) over the
repetitions (on 2026-12-06 the same linears took 23.5 and 41.2 ms in runs a minute apart, and a
ratio of medians then printed 0.98×).

The KV state is built without the scheduler or the KV manager (their state is untouched;
:mod:`llmd.daemon.bench.step_setup`, re-exported here): each sequence gets distinct block ids
drawn without replacement from a seeded shuffle of the pool (block 0, the null block, excluded),
as a pool after some churn; the cache is filled with uniform random values so every read touches
real memory (never the kernel's zero page).
Weights are loaded once per dtype; one engine per (dtype, backend) holds a pool sized for the
largest batch × context. Times are medians of ``reps`` repetitions after one warm-up, in
seconds internally and printed in milliseconds.
"""

from __future__ import annotations

import gc
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from llmd import kernels
from llmd.daemon.bench.step_pairs import (  # noqa: F401 (re-exported: the bench's helpers)
    BandwidthProbe,
    CpuOther,
    gather_reader,
    median_time,
    paired_attention,
    paired_step,
    timed,
)
from llmd.daemon.bench.step_report import format_table
from llmd.daemon.bench.step_setup import (  # noqa: F401 (re-exported: the step and its KV state)
    blocks_needed,
    decode_step,
    engine_for,
    fill_kv,
    first_kept,
    kv_read_bytes,
)
from llmd.daemon.core.config import EngineConfig
from llmd.daemon.core.errors import LlmdError
from llmd.kernels import cpu_glue
from llmd.kernels.native import build
from llmd.models import glue_forward
from llmd.quant import fp16_linear, prepacked


@dataclass
class StepTimes:
    """One (dtype, backend, batch, context) row. Times in seconds (medians); ``kv_bytes`` in
    bytes; ``cpu_other``: fraction of all cores busy with other processes while it ran."""

    dtype: str
    backend: str
    batch: int
    context: int
    prep: float
    linears: float
    lm_head: float
    attention: float
    forward: float
    sample: float
    step: float
    kv_bytes: int
    kv_floor: float
    cpu_other: float
    bandwidth: float = float("nan")  # bytes/s: median of the probes before each attention (the floor's divisor)
    attn_ratio: float = float("nan")  # median over repetitions of attention / (kv_bytes / the probe just before it)
    gather: float = float("nan")  # seconds: the KV-gather read (kernels/native/kv_read.c), median; NaN: not measured
    gather_ratio: float = float("nan")  # median over repetitions of attention / the gather read just before it
    step_ratio: float = float("nan")  # median over repetitions of step / (its linears + lm_head + KV floor)

    @property
    def rest(self) -> float:
        return self.forward - self.linears - self.attention

    @property
    def floor(self) -> float:
        """linears + lm_head + KV-read floor (seconds)."""
        return self.linears + self.lm_head + self.kv_floor


def measure(engine, batch: int, context: int, reps: int, probe: BandwidthProbe) -> StepTimes:
    """Time one decode step of ``batch`` sequences × ``context`` cached tokens, by component
    (the attention paired with bandwidth reads: :func:`paired_attention`; the step with its floor's
    components: :func:`paired_step`)."""
    runner, model, cfg = engine.runner, engine.runner.model, engine.model_config
    dev, dtype = runner.device, next(model.parameters()).dtype
    out, reqs = decode_step(engine, batch, context)
    meter = CpuOther()
    gen = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(device=dev, dtype=dtype)

    # (weight, its fbgemm fp16 pack or None): the products the forward runs (quant/fp16_linear.py)
    packs = runner.fp16_weights
    weights = [(p, m.__dict__.get(fp16_linear.ATTR) if packs else None) for layer in model.layers
               for m in layer.modules() for p in m.parameters(recurse=False) if p.dim() == 2]
    acts = {w.shape[1]: rand(batch, w.shape[1]) for w, _ in weights}
    q = rand(batch, cfg.num_heads, cfg.head_dim)
    k, v = rand(batch, cfg.num_kv_heads, cfg.head_dim), rand(batch, cfg.num_kv_heads, cfg.head_dim)
    hidden = rand(batch, cfg.hidden_size)
    cpu_glue.active = runner.native_glue  # as the runner sets it for its forwards
    fp16_linear.active = runner.fp16_weights
    fused_store = glue_forward.why_not(model, runner.layer_caches) is None  # the forward runs glue_forward
    qkv = rand(batch, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim)
    glue, threads = build.load_glue(), torch.get_num_threads()
    metas = lambda: runner.prepare_inputs(out)  # noqa: E731

    def attention(inputs):
        meta, positions = inputs[2], inputs[1]
        ropes = glue_forward.rope_rows(model, positions, batch) if fused_store else None
        for i, cache in enumerate(runner.layer_caches):
            m = meta[i] if isinstance(meta, list) else meta
            if fused_store:  # the forward's own attention block: K/V stored inside its RoPE pass
                glue_forward.attention(glue, threads, cfg, model.layers[i].self_attn, qkv,
                                       ropes[model.rope_thetas[i]], cache, m)
                continue
            kernels.store_kv(k, v, cache, m.slot_mapping, m.attn_backend, m.slots_padded)
            kernels.paged_attention(q, cache, m, cfg.softmax_scale, cfg.layer_window(i))

    def forward(inputs):
        ids, pos, meta, _ = inputs
        runner.forward(ids, pos, meta)  # with the runner's choice of the C layer glue

    def replay():
        return [prepacked.linear(acts[w.shape[1]], w) if pk is None else fp16_linear.linear(acts[w.shape[1]], pk)
                for w, pk in weights]

    nbytes = kv_read_bytes(engine, batch, context)
    with torch.inference_mode():
        t = dict(
            prep=median_time(lambda: runner.prepare_inputs(out), reps, dev),
            linears=median_time(replay, reps, dev),
            lm_head=median_time(lambda: model.compute_logits(hidden), reps, dev),
            forward=median_time(forward, reps, dev, setup=lambda: runner.prepare_inputs(out)),
        )
        gather = gather_reader(engine, runner.prepare_inputs(out))
        t["attention"], bandwidth, pairs = paired_attention(attention, metas, reps, probe, dev, gather)
        logits = runner.compute_logits(out)
        t["sample"] = median_time(lambda: runner.sampler(logits, reqs), reps, dev)
        t["step"] = median_time(lambda: runner.execute(out, reqs), reps, dev)
        step_ratio, _ = paired_step(lambda: runner.execute(out, reqs), replay, lambda: model.compute_logits(hidden),
                                    probe, nbytes, reps, dev)
    label = "f32/fp16" if runner.fp16_weights else engine.config.dtype  # fp16 packs: quant/fp16_linear.py
    return StepTimes(label, engine.config.attention_backend, batch, context, **t,
                     kv_bytes=nbytes, kv_floor=nbytes / bandwidth, cpu_other=meter.frac(), bandwidth=bandwidth,
                     attn_ratio=statistics.median(a * b / nbytes for a, b, _ in pairs),
                     gather=statistics.median(g for _, _, g in pairs),
                     gather_ratio=statistics.median(a / g for a, _, g in pairs), step_ratio=step_ratio)


def run_step_bench(engine_kw: dict, dtypes: list[str], backends: list[str], batches: list[int], contexts: list[int],
                   reps: int = 5, bandwidth_mib: int = 512, echo: Callable[[str], None] = print) -> list[StepTimes]:
    """Load the model once per dtype, measure every (backend, batch, context), print the table.

    ``engine_kw``: :class:`EngineConfig` fields (model, device, block size, KV cache dtype, ...);
    its ``dtype`` / ``attention_backend`` / ``kv_cache_memory`` are set here. A backend the
    engine rejects is reported and skipped. Returns the rows measured.
    """
    from llmd.models.gguf_loader import load_config, load_model
    from llmd.models.registry import resolve_model

    base = EngineConfig(**{**engine_kw, "dtype": None, "attention_backend": None, "kv_cache_memory": None}).resolve()
    if hasattr(base, "apply_threads"):
        base.apply_threads()  # --threads, before the bandwidth probe (each engine applies it again)
    if base.kv_format.k_per_block:
        raise LlmdError(f"llmd bench step does not take --kv-cache-dtype {base.kv_cache_dtype}: its open-block "
                        "residual slots come from the KV manager, which this bench bypasses")
    dev = torch.device(base.device)
    path = resolve_model(base.model)
    model_cfg = load_config(path)
    if max(contexts) + 1 > min(base.max_model_len or model_cfg.max_position, model_cfg.max_position):
        raise LlmdError(f"--context {max(contexts)} + 1 decoded token exceeds the model's context of "
                        f"{model_cfg.max_position} tokens")
    probe = BandwidthProbe(dev, bandwidth_mib)
    bandwidth = probe.read(5)
    load = open("/proc/loadavg").read().strip() if os.path.exists("/proc/loadavg") else "n/a"
    echo(f"llmd bench step: {os.path.basename(path)} on {dev}, {torch.get_num_threads()} threads; decode steps "
         f"(every sequence has `context` tokens cached, decodes 1); block size {base.block_size}, KV cache "
         f"{base.kv_cache_dtype}; read bandwidth {bandwidth / 1e9:.1f} GB/s (best x.sum() of {bandwidth_mib} MiB; "
         f"and before each repetition of a row's attention: GB/s, their median); "
         f"median of {reps} reps; loadavg {load}")
    rows: list[StepTimes] = []
    for dname in dtypes:
        cfg = EngineConfig(**{**engine_kw, "dtype": dname, "attention_backend": None,
                              "kv_cache_memory": None}).resolve()
        model, _ = load_model(path, cfg.torch_dtype, cfg.device)
        for be in backends:
            try:
                bcfg = EngineConfig(**{**engine_kw, "dtype": dname, "attention_backend": be,
                                       "kv_cache_memory": None}).resolve()
            except LlmdError as e:
                echo(f"{cfg.dtype} {be}: skipped ({e})")
                continue
            # --dtype auto's float32 on a CPU without native bfloat16: the dense products on fp16 packs,
            # as the engine's own --weight-quant auto does (bench step loads dense weights: "none")
            bcfg.fp16_weights = getattr(bcfg, "dtype_auto", False) and bcfg.dtype == "float32" \
                and bcfg.device == "cpu" and not bcfg.model.startswith("random:")
            engine = engine_for(model, bcfg, max(batches), max(contexts))
            for b in batches:
                for c in contexts:
                    rows.append(measure(engine, b, c, reps, probe))
            del engine
            gc.collect()
        del model
        gc.collect()
    for line in format_table(rows):
        echo(line)
    return rows
