"""uvicorn's server as `llmgw serve` runs it: our stop on a signal
(docs/design/stopping.md), and a main loop that ticks once a second.

A signal makes `/readyz` say 503 at once and the lead pass on; a notice
period follows in which the gateway still accepts, then a grace period for
what is open, then a cut that ends streams with an error event; a second
signal stops at once. uvicorn's main loop wakes every 0.1 s to see whether
a signal asked it to stop (ten wakes a second of an idle gateway); this one
ticks once a second, the Date header's step, and the signal wakes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import uvicorn

from app.gateway.pause import Pause

if TYPE_CHECKING:
    from app.gateway.gateway import Gateway
    from app.gateway.settings import Settings

logger = logging.getLogger(__name__)


class StoppingServer(uvicorn.Server):
    """uvicorn's server for `config` with our stop of `gateway`; `stopped`
    is called once it is over."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway, settings: Settings,
                 stopped: Callable[[], None]) -> None:
        super().__init__(config)
        self.gateway, self.stopped = gateway, stopped
        self.notice = settings.shutdown_notice_seconds
        self.grace = settings.shutdown_grace_seconds
        self.forced = asyncio.Event()  # a second signal came
        self.loop: asyncio.AbstractEventLoop | None = None
        self.tick = Pause()  # main_loop's wait for its next tick

    def handle_exit(self, sig: int, frame: Any) -> None:
        # /readyz must say 503 from the next request on, and the lead pass
        # on now; main_loop looks at should_exit at once.
        self.gateway.signalled()
        if self.should_exit:
            self.force_exit = True  # a second SIGTERM or SIGINT: stop at once
            if self.loop is not None:  # a signal handler: only this is safe
                self.loop.call_soon_threadsafe(self.forced.set)
        super().handle_exit(sig, frame)
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.tick.wake)

    async def main_loop(self) -> None:
        """uvicorn's, ticking once a second rather than every 0.1 s; a
        signal wakes it (handle_exit)."""
        self.loop = asyncio.get_running_loop()
        counter = 0  # a multiple of 10: each tick sets the Date header, as uvicorn's 10th
        while not await self.on_tick(counter):
            counter = (counter + 10) % 864000
            await self.tick.wait(1.0)

    async def shutdown(self, sockets: Any = None) -> None:
        self.loop = asyncio.get_running_loop()
        if self.force_exit:
            self.forced.set()
        # /readyz says 503 at once, agents' long polls end and move to
        # another gateway, the lead passes on; requests are still served.
        self.gateway.begin_shutdown()
        if self.gateway.ready:  # never ready: no balancer sends it anything
            logger.info("stopping: still accepting for %g s (LLMGW_SHUTDOWN_NOTICE_SECONDS)",
                        self.notice)
            await self._wait(self.notice)
        logger.info("stopping: open requests have %g s (LLMGW_SHUTDOWN_GRACE_SECONDS)",
                    self.grace)
        cutting = asyncio.create_task(self._cut_after(self.grace))
        try:
            # Stops accepting, closes idle connections, waits for the open
            # ones (up to timeout_graceful_shutdown), then the lifespan's
            # end: last usage writes, Gateway.stop().
            await super().shutdown(sockets)
        finally:
            cutting.cancel()
        # Before uvicorn raises the signal it caught again (the process then
        # ends as killed by it): the pid file goes with a clean stop.
        self.stopped()

    async def _wait(self, seconds: float) -> None:
        """Sleeps `seconds`, or less on a second signal."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.forced.wait(), seconds)

    async def _cut_after(self, seconds: float) -> None:
        await self._wait(seconds)
        if not self.force_exit:
            cut = self.gateway.proxy.cut_open()
            if cut:
                logger.warning("stopping: grace period over, %d open requests cut", cut)
