"""The transport comparison of ``llmd bench kv-transfer --compare-gloo``: the same byte counts
sent between two processes with ``torch.distributed`` gloo ``send`` / ``recv`` on loopback
(the ``torch.distributed`` option the issue names for CPU), timed on the receiver after a
barrier, median of ``repeats`` after one warm-up transfer per size."""

from __future__ import annotations

import multiprocessing as mp
import socket
import statistics
import time


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, sizes: list[int], repeats: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    results = []
    for n in sizes:
        buf = torch.ones(n, dtype=torch.uint8) if rank == 0 else torch.empty(n, dtype=torch.uint8)
        times = []
        for r in range(repeats + 1):
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
            else:
                dist.recv(buf, 0)
            if r:
                times.append(time.perf_counter() - t0)
        results.append(statistics.median(times))
    if rank == 1:
        out.put(results)
    dist.destroy_process_group()


def gloo_send_recv_seconds(sizes: list[int], repeats: int = 3) -> list[float]:
    """Median seconds to move each of ``sizes`` bytes from rank 0 to rank 1 (two spawned
    processes, one torch thread each). Raises RuntimeError if a worker fails."""
    ctx = mp.get_context("spawn")
    port, out = _free_port(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(rank, port, sizes, repeats, out)) for rank in (0, 1)]
    for p in procs:
        p.start()
    try:
        result = out.get(timeout=300)
    finally:
        for p in procs:
            p.join(30)
    if any(p.exitcode for p in procs):
        raise RuntimeError(f"a gloo worker failed (exit codes {[p.exitcode for p in procs]})")
    return result
