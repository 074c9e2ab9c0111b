"""A TCP forwarder that can keep answers back: while held (`hold()` until
`release()`), bytes from
the target wait (in the socket buffers, in order) and bytes to it pass. Put
in front of etcd, a request reaches etcd and is applied, and its answer
arrives only once released: a write whose outcome its sender cannot know.
Runs its own event loop in a thread, so it serves subprocesses and
in-process tests alike."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from tests.support.procs import free_port


class HoldingProxy:
    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self.port = free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._released = asyncio.Event()
        self._released.set()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    def start(self) -> HoldingProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", self.port), self._loop).result(5)
        return self

    def hold(self) -> None:
        self._loop.call_soon_threadsafe(self._released.clear)

    def release(self) -> None:
        self._loop.call_soon_threadsafe(self._released.set)

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self._target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer, held=False),
                             self._pipe(up_reader, writer, held=True))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    held: bool) -> None:
        try:
            while data := await reader.read(65536):
                if held:
                    await self._released.wait()
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(ConnectionError, OSError):
                writer.close()
