"""llmd.daemon.serving: the daemon around the engine.

``engine_loop`` (the engine's thread and command queue), ``api`` (aiohttp routes),
``lifecycle`` (socket claim, lock, signals, drain: ``llmd serve``), ``validation`` (JSON →
engine inputs, 400s), ``responses`` (OpenAI shapes), ``metrics`` (Prometheus). Imports
``core`` and ``protocol``, never ``client``, ``cli`` or ``bench``.
"""
