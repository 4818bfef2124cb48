"""``llmd bench ...``: the click group of the benchmark commands (what they run lives in
:mod:`llmd.daemon.bench`). The commands live one family per module: :mod:`.bench_serving`
(throughput, prefix, cascade, chunked-prefill, serve, routing), :mod:`.bench_engine` (single,
step, kernels, startup), :mod:`.bench_kv` (kv-quality, context-shift, hybrid, beam,
kv-transfer); the option parsing they share is in :mod:`.bench_options`."""

from __future__ import annotations

import click

from llmd.daemon.cli.bench_engine import bench_kernels, bench_single, bench_startup, bench_step
from llmd.daemon.cli.bench_kv import bench_beam, bench_context_shift, bench_hybrid, bench_kv_quality, bench_kv_transfer
from llmd.daemon.cli.bench_serving import (
    bench_cascade,
    bench_chunked_prefill,
    bench_prefix,
    bench_routing,
    bench_serve,
    bench_throughput,
)


@click.group()
def bench():
    """Benchmarks that print side-by-side ratios measured in one run."""


for _command in (bench_throughput, bench_prefix, bench_cascade, bench_chunked_prefill, bench_serve, bench_routing,
                 bench_single, bench_step, bench_kernels, bench_startup,
                 bench_kv_quality, bench_context_shift, bench_hybrid, bench_beam, bench_kv_transfer):
    bench.add_command(_command)
