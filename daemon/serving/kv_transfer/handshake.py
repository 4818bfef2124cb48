"""vLLM's ``kv_transfer_params`` handshake (the NixlConnector schema) on ``/v1/completions`` and
``/v1/chat/completions``, as vllm-router, vLLM's ``toy_proxy_server.py`` and llm-d drive it:

1. The router sends the prompt to a **producer** with ``max_tokens: 1`` (``min_tokens: 1``,
   ``stream: false``) and ``"kv_transfer_params": {"do_remote_decode": true, ...}`` (the other
   fields null). The producer prefills, samples its one token, pins the prompt's blocks and
   answers with ``kv_transfer_params``: ``do_remote_prefill: true``, ``do_remote_decode:
   false``, ``remote_engine_id``, ``remote_host``, ``remote_port``, ``remote_block_ids``,
   ``remote_request_id``, and llmd's own ``llmd_transfer_id`` (``secrets.token_urlsafe(32)``:
   the only key to the pin), ``llmd_fingerprint`` and ``llmd_expires_in_s``.
2. The router sends the original request with those params to a **consumer**, which pulls the
   KV (:mod:`.tcp`, by transfer id only), imports it and decodes; the pulled KV is checked
   again on the engine thread (``KVExchange.accept``). Whatever fails (a fingerprint that
   differs, params of a non-llmd producer, the pull) the consumer computes the prefill itself,
   logs why and counts it (``/v1/stats`` ``kv_transfer.recomputed_*``): a reply always comes.

A daemon with ``--kv-role both`` ignores the field. Bad params are 400s naming the field.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from dataclasses import dataclass, field

from llmd.daemon.core.kv_transfer import fingerprint_mismatch
from llmd.daemon.serving.kv_transfer.config import KVTransferConfig
from llmd.daemon.serving.kv_transfer.connector import KVPullError, RemoteKV
from llmd.daemon.serving.validation import ApiError, json_typed

log = logging.getLogger("llmd.kv_transfer")
PARAM = "kv_transfer_params"


@dataclass
class KVRequest:
    """One HTTP request's part in the handshake.

    Attributes:
        submit_kw: the engine loop's ``kv`` keywords (``kv_export`` / ``kv_import`` / ``kv_fallback``).
        transfer_id: a producer request's transfer id (None on a consumer).
    """

    config: KVTransferConfig
    submit_kw: dict = field(default_factory=dict)
    transfer_id: str | None = None

    def response_params(self, pinned: dict | None) -> dict | None:
        """The producer's ``kv_transfer_params`` from the engine's final output's (``pinned``:
        block ids, request id, fingerprint), or None when nothing was pinned (a consumer request,
        a 1-token prompt)."""
        if self.transfer_id is None or pinned is None:
            return None
        c = self.config
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": c.engine_id,
                "remote_host": c.host, "remote_port": c.port, "remote_block_ids": pinned["remote_block_ids"],
                "remote_request_id": pinned["remote_request_id"], "llmd_transfer_id": self.transfer_id,
                "llmd_fingerprint": pinned["fingerprint"], "llmd_expires_in_s": pinned["expires_in_s"]}


def parse_params(body: dict) -> dict | None:
    """``kv_transfer_params`` (None when absent or null). Raises ApiError: not an object, a
    ``do_remote_*`` flag that is not a boolean, or both flags true."""
    kv = body.get(PARAM)
    if kv is None:
        return None
    if not isinstance(kv, dict):
        raise ApiError(f"{PARAM} must be an object, got {json_typed(kv)}", PARAM)
    for flag in ("do_remote_decode", "do_remote_prefill"):
        if kv.get(flag) is not None and not isinstance(kv[flag], bool):
            raise ApiError(f"{PARAM}.{flag} must be a boolean, got {json_typed(kv[flag])}", f"{PARAM}.{flag}")
    if kv.get("do_remote_decode") and kv.get("do_remote_prefill"):
        raise ApiError(f"{PARAM}: do_remote_decode and do_remote_prefill cannot both be true", PARAM)
    return kv


def _check_single(parsed, prompts: list, flag: str) -> None:
    if len(prompts) != 1:
        raise ApiError(f"{PARAM}.{flag} takes one prompt, got a batch of {len(prompts)}", "prompt")
    if parsed.n != 1 or parsed.params.use_beam_search:
        raise ApiError(f"{PARAM}.{flag} needs n = 1 without beam search (one sequence)", "n")


def _remote(cfg: KVTransferConfig, kv: dict) -> RemoteKV | str:
    """The producer's address and transfer id, or why they cannot be used. Raises ApiError for
    fields of the wrong JSON type."""
    host, port, tid = kv.get("remote_host"), kv.get("remote_port"), kv.get("llmd_transfer_id")
    for name, v, types, what in (("remote_host", host, str, "a string"), ("remote_port", port, int, "an integer"),
                                 ("llmd_transfer_id", tid, str, "a string")):
        if v is not None and (isinstance(v, bool) or not isinstance(v, types)):
            raise ApiError(f"{PARAM}.{name} must be {what}, got {json_typed(v)}", f"{PARAM}.{name}")
    if port is not None and not 1 <= port <= 65535:
        raise ApiError(f"{PARAM}.remote_port must be in [1, 65535], got {port}", f"{PARAM}.remote_port")
    if not host or port is None:
        return "the params name no producer (remote_host / remote_port missing)"
    if not tid:
        return "the params carry no llmd_transfer_id (the producer is not an llmd daemon?)"
    if not cfg.allows(host, port):
        return (f"producer {host}:{port} is not allowed (--kv-producer lists the producers a consumer pulls from; "
                "without it, loopback ones only)")
    return RemoteKV(host, port, tid, kv.get("remote_engine_id"), kv.get("remote_request_id"))


async def _own_fingerprint(cfg: KVTransferConfig, engine_loop) -> dict:
    """The consumer's fingerprint, computed once on a worker thread (it reads the weights)."""
    if cfg.fingerprint is None:
        exchange = engine_loop.engine.kv_exchange
        cfg.fingerprint = await asyncio.to_thread(lambda: exchange.fingerprint)
    return cfg.fingerprint


async def prepare(cfg: KVTransferConfig | None, engine_loop, body: dict, parsed, prompts: list) -> KVRequest | None:
    """The request's :class:`KVRequest` (a consumer's pull happens here, before the engine sees
    the request: nothing is allocated while bytes travel), or None without a handshake.

    Raises:
        ApiError: malformed params; a flag this daemon's role cannot serve; a producer request
            with ``stream: true``, ``n`` > 1, beam search or several prompts.
    """
    if cfg is None or cfg.role == "both" or body.get(PARAM) is None:
        return None
    kv = parse_params(body)
    if kv.get("do_remote_decode"):
        if cfg.role != "producer":
            raise ApiError(f"{PARAM}.do_remote_decode: this daemon is a consumer (--kv-role consumer); send the "
                           "prefill request to a producer", f"{PARAM}.do_remote_decode")
        _check_single(parsed, prompts, "do_remote_decode")
        if parsed.stream:
            raise ApiError(f"{PARAM}.do_remote_decode needs stream: false (the params come in the response body)",
                           "stream")
        tid = secrets.token_urlsafe(32)
        return KVRequest(cfg, {"kv_export": (tid, cfg.pin_timeout)}, tid)
    if not kv.get("do_remote_prefill"):
        return None
    if cfg.role != "consumer":
        raise ApiError(f"{PARAM}.do_remote_prefill: this daemon is a producer (--kv-role producer); send the "
                       "decode request to a consumer", f"{PARAM}.do_remote_prefill")
    _check_single(parsed, prompts, "do_remote_prefill")
    remote = _remote(cfg, kv)
    if isinstance(remote, str):
        return KVRequest(cfg, {"kv_fallback": ("no_producer", remote)})
    theirs = kv.get("llmd_fingerprint")
    if isinstance(theirs, dict):
        mismatch = fingerprint_mismatch(await _own_fingerprint(cfg, engine_loop), theirs)
        if mismatch:
            return KVRequest(cfg, {"kv_fallback": ("mismatch", f"the producer's KV layout differs: {mismatch}")})
    eng = engine_loop.engine
    max_bytes = (eng.max_model_len + eng.config.block_size) * eng.bytes_per_token + (1 << 20)
    try:
        payload = await cfg.connector.pull(remote, max_bytes, cfg.pull_timeout)
    except KVPullError as e:
        return KVRequest(cfg, {"kv_fallback": ("pull_failed", str(e))})
    return KVRequest(cfg, {"kv_import": payload})
