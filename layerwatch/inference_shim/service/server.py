"""uvicorn, with the signals `layerwatch serve` answers (docs/service.md, "Signals and shutdown").

SIGTERM or SIGINT drains: no new generation request is admitted (503, and /readyz 503), the
admitted ones get up to `drain_timeout_seconds` to finish, and whatever is still running then is
cut off (streams end with an error event and `data: [DONE]`, other requests get a 503 error body)
before uvicorn's own shutdown closes the connections. A second SIGTERM or SIGINT during the drain
cuts off at once. SIGHUP checks the gate file now (ShimService.hangup) and never stops the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from types import FrameType

import uvicorn

from layerwatch import ports
from layerwatch.inference_shim.service.shim import ShimService

log = logging.getLogger(__name__)

# After the cut, the cut-off answers are written out; a request still reading its body or being
# tokenized is not waited for longer than this (uvicorn's graceful shutdown timeout follows).
CUT_ANSWER_SECONDS = 2.0
POLL_SECONDS = 0.05


class ShimServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: ShimService) -> None:
        super().__init__(config)
        self.service = service
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Task | None = None
        self._cut_now = asyncio.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_signal_handler(signal.SIGHUP, self.service.hangup)
        for sock in sockets or ():  # reserved before the model loaded (layerwatch.ports.reserve)
            ports.listen(sock, self.config.backlog)
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._loop is None or self.should_exit:  # not serving yet, or already shutting down
            super().handle_exit(sig, frame)
            return
        # A signal handler: hand over to the event loop, which this thread runs.
        self._loop.call_soon_threadsafe(self._on_stop_signal, sig)

    def _on_stop_signal(self, sig: int) -> None:
        if self._drain is None:
            self._drain = asyncio.get_running_loop().create_task(self._drain_then_exit(sig))
        else:
            log.warning("%s during the drain: cutting off the requests in flight now", signal.Signals(sig).name)
            self._cut_now.set()

    async def _drain_then_exit(self, sig: int) -> None:
        admission, timeout = self.service.admission, self.service.drain_timeout_seconds
        admission.draining = True
        log.warning(
            "%s received: draining; no new requests, %d in flight get up to %g s to finish",
            signal.Signals(sig).name,
            admission.admitted,
            timeout,
        )
        cut_now = asyncio.ensure_future(self._cut_now.wait())
        idle = asyncio.ensure_future(self._until_idle())
        await asyncio.wait([idle, cut_now], timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        cut_now.cancel()
        if admission.admitted:
            log.warning("drain ended with %d request(s) in flight: cutting them off", admission.admitted)
            self.service.worker.cut(
                f"The server shut down before this request finished (drain timeout {timeout:g} s); retry it."
            )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(idle), CUT_ANSWER_SECONDS)
        idle.cancel()
        super().handle_exit(sig, None)  # uvicorn's shutdown, and its exit status for the signal

    async def _until_idle(self) -> None:
        while self.service.admission.admitted:
            await asyncio.sleep(POLL_SECONDS)
