"""Prefill/decode disaggregation in the serving layer: ``--kv-role`` (:mod:`.config`), vLLM's
``kv_transfer_params`` handshake (:mod:`.handshake`), the connector interface
(:mod:`.connector`) and llmd's transport, a binary pull over the TCP listener (:mod:`.tcp`,
bytes in :mod:`.wire`). The engine side (pins, export, import) is
:mod:`llmd.daemon.core.kv_exchange`."""
