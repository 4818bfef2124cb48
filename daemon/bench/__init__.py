"""llmd.daemon.bench: what ``llmd bench`` runs (throughput, step, serve, prefix, chunked
prefill, hybrid KV cache groups, KV quality). The top layer, beside ``cli``."""
