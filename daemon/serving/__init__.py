"""llmd.daemon.serving: the daemon around the engine.

``engine_loop`` (the engine's thread and command queue; ``engine_health``: its failures,
backoff and ``/health`` states), ``api`` (aiohttp routes),
``lifecycle`` (socket claim, lock, signals, drain: ``llmd serve``), ``validation`` (JSON →
engine inputs, 400s), ``responses`` (OpenAI shapes), ``metrics`` (Prometheus). Imports
``core`` and ``protocol``, never ``client``, ``cli`` or ``bench``.
"""
