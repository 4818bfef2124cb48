"""llmd.daemon.core: the engine thread's world (no aiohttp, no click).

Plain data (``request``, ``outputs``, ``stats``, ``errors``), the one prompt path
(``input_processor``), n-way fan-out (``parallel``), the step's three stages (``scheduler`` →
``model_runner`` + ``input_batch`` + ``sampler`` → ``detokenizer``) and the :class:`Engine`
that owns them (``engine``), with its settings (``config``) and capacity math (``kv_size``).
Nothing here imports ``serving``, ``client``, ``cli`` or ``bench``.
"""
