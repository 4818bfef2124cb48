"""Between the engine thread and one HTTP response: outputs that merge while the client is
behind, and writes that give up on a client that stops reading.

The engine never waits on a client. Its sink (:meth:`OutputBuffer.sink`) only schedules
:meth:`OutputBuffer.put` on the event loop (``call_soon_threadsafe``), which merges the
output into the one pending delta of its sequence (choice ``index``); the handler takes
everything pending whenever it is ready to write (:meth:`OutputBuffer.take`). So a reader
that keeps up gets a chunk per token, and one that falls behind gets fewer, larger chunks
(token ids, text and logprobs concatenated; counts and ``finished`` from the latest), and
what a request holds meanwhile is one pending delta per sequence, not one object per token:
an unbounded queue of outputs (what llmd had, and what llama-server's per-slot queue
does) grows for as long as the client stalls.

:func:`write` bounds each write by ``timeout`` seconds: aiohttp's ``StreamResponse.write``
waits for the transport to drain once ~64 KiB are buffered, so a client that stops reading
holds the handler there; past the timeout the connection is aborted (``transport.abort``,
buffered bytes dropped) and :class:`ConnectionResetError` is raised, which the handler treats
as a client that left (its request is aborted and its KV blocks are freed within one step).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Callable

from aiohttp import web

from llmd.daemon.core.outputs import RequestOutput


class _Pending:
    """One sequence's not-yet-written outputs, merged (lists appended in place)."""

    __slots__ = ("last", "token_ids", "texts", "logprobs")

    def __init__(self, out: RequestOutput):
        self.last = out
        self.token_ids, self.texts, self.logprobs = list(out.new_token_ids), [out.new_text], list(out.logprobs)

    def add(self, out: RequestOutput) -> None:
        self.last = out
        self.token_ids += out.new_token_ids
        self.texts.append(out.new_text)
        self.logprobs += out.logprobs

    def output(self) -> RequestOutput:
        return dataclasses.replace(self.last, new_token_ids=self.token_ids, new_text="".join(self.texts),
                                   logprobs=self.logprobs)


class OutputBuffer:
    """The outputs of one request's sequences not yet taken by its handler (event loop only).

    Attributes:
        merged: outputs merged into an earlier pending one (the client was behind), total.
    """

    def __init__(self):
        self._pending: dict[int, _Pending] = {}
        self._ready = asyncio.Event()
        self.merged = 0

    def sink(self, loop: asyncio.AbstractEventLoop) -> Callable[[RequestOutput], None]:
        """The engine-thread sink: hands each output to :meth:`put` on ``loop``, never blocks."""
        return lambda out: loop.call_soon_threadsafe(self.put, out)

    def put(self, out: RequestOutput) -> None:
        """Merge ``out`` into its sequence's pending delta (event loop)."""
        p = self._pending.get(out.index)
        if p is None:
            self._pending[out.index] = _Pending(out)
        else:
            p.add(out)
            self.merged += 1
        self._ready.set()

    @property
    def num_pending(self) -> int:
        """Pending deltas: at most one per sequence, however far behind the client is."""
        return len(self._pending)

    async def take(self) -> list[RequestOutput]:
        """Wait until something is pending; return one merged output per sequence, in the
        order the sequences first had something pending."""
        while not self._pending:
            self._ready.clear()
            await self._ready.wait()
        outs = [p.output() for p in self._pending.values()]
        self._pending.clear()
        return outs


async def write(request: web.Request, resp: web.StreamResponse, data: bytes, timeout: float) -> None:
    """``resp.write(data)``, given up after ``timeout`` seconds of a client not draining.

    Raises:
        ConnectionResetError: the write timed out (the connection is aborted first) or the
            client went away.
    """
    try:
        async with asyncio.timeout(timeout):
            await resp.write(data)
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
        raise ConnectionResetError(f"client did not read for {timeout:g} s; connection closed") from None
