"""How an agent talks to the gateways' /agent/v1 API.

`GatewayAPI` is what the agent needs; `GatewayClient` is its HTTP
implementation, which moves to the next gateway when one fails, so a
gateway's death costs an agent one failed request. Tests give the agent an
in-memory `GatewayAPI` instead (docs/architecture.md, DESIGN invariant 7).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import ssl
from collections.abc import Sequence
from typing import Any, Protocol
from urllib.parse import urlsplit

import aiohttp

from app.tls import verify_message

logger = logging.getLogger(__name__)


class GatewayUnreachable(Exception):
    """No gateway answered: connection failures, timeouts, 5xx. A 503 is in
    this class too: a gateway whose state has not loaded yet says so rather
    than answer from nothing, and another gateway may answer."""


class GatewayRefused(Exception):
    """A gateway answered but refused the request (a 4xx other than 401/403):
    a bug or a version mismatch, not an outage, and reported as such."""


class GatewayAPI(Protocol):
    """The agent's side of /agent/v1, one method per call it makes."""

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    async def heartbeat(self, inventory: dict[str, Any]) -> dict[str, Any]:
        """Renews the node; the answer holds the node TTL (`ttl`)."""
        ...

    async def assignments(self, since: str, wait: float) -> dict[str, Any]:
        """This node's replicas: `fingerprint`, `replicas`, and `revision`
        (the store revision the answer was computed at; absent from older
        gateways). Answers at once when the fingerprint differs from `since`,
        else within `wait` seconds."""
        ...

    async def report(self, replicas: list[dict[str, Any]]) -> None:
        """Sends the replicas' observed phases."""
        ...

    def move_on(self) -> None:
        """Use the next gateway from now on (this one answered badly)."""
        ...


def advertise_address(gateway_url: str) -> str:
    """The local address of this host's route to the gateway.

    A UDP connect sends nothing; it only asks the kernel which source address
    it would use. On loopback that is 127.0.0.1, as in every test here.
    """
    parts = urlsplit(gateway_url)
    host = parts.hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((host, parts.port or (443 if parts.scheme == "https" else 80)))
            address = str(sock.getsockname()[0])
        except OSError as exc:
            logger.error(
                "cannot tell this host's address on the way to %s (%s): advertising "
                "127.0.0.1, which only a gateway on this very host can reach; set "
                "--advertise-host", gateway_url, exc)
            return "127.0.0.1"
    if address.startswith("127.") and not _loopback(host):
        logger.error(
            "the route to gateway %s leaves from %s: engines advertised there are reachable "
            "from this host only; set --advertise-host", gateway_url, address)
    return address


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class GatewayClient:
    """HTTP to the gateways' /agent/v1 API, moving on when one fails."""

    def __init__(self, urls: Sequence[str], node: str, token: str,
                 tls: ssl.SSLContext | None = None) -> None:
        if not urls:
            raise ValueError("at least one gateway URL is needed")
        self._urls = [u.rstrip("/") for u in urls]
        self._current = 0
        self._node = node
        self._token = token
        # How https gateways are verified (app/tls.py); None: the system's
        # CAs. Never off: the token goes in every request.
        self._tls = tls or ssl.create_default_context()
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            headers={"Authorization": f"Bearer {self._token}"},
            connector=aiohttp.TCPConnector(ssl=self._tls),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def move_on(self) -> None:
        self._current = (self._current + 1) % len(self._urls)

    async def heartbeat(self, inventory: dict[str, Any]) -> dict[str, Any]:
        return dict(await self.call("PUT", "", body=inventory))

    async def assignments(self, since: str, wait: float) -> dict[str, Any]:
        return dict(await self.call("GET", "/assignments",
                                    params={"since": since, "wait": str(wait)},
                                    timeout=wait + 10.0))

    async def report(self, replicas: list[dict[str, Any]]) -> None:
        await self.call("PUT", "/status", body={"replicas": replicas})

    async def call(
        self, method: str, path: str, *, body: Any = None,
        params: dict[str, str] | None = None, timeout: float = 10.0,
    ) -> Any:
        """One request, tried on each gateway in turn until one answers.

        401/403 ends it at once (the token is the same for every gateway); a
        4xx is tried elsewhere too (in a rolling upgrade another version may
        take it), and raised as `GatewayRefused` if no gateway answered.
        """
        assert self._session is not None
        last: Exception | None = None
        refused: GatewayRefused | None = None
        for _ in range(len(self._urls)):
            base = self._urls[self._current]
            url = f"{base}/agent/v1/nodes/{self._node}{path}"
            try:
                async with self._session.request(
                    method, url, json=body, params=params,
                    timeout=aiohttp.ClientTimeout(total=timeout),
                ) as resp:
                    if resp.status in (401, 403):
                        raise PermissionError(
                            f"gateway {base} refused this agent's token for node {self._node}"
                        )
                    if resp.status >= 500:
                        raise GatewayUnreachable(f"{base} answered {resp.status}")
                    if resp.status >= 400:
                        text = (await resp.text())[:300]
                        refused = GatewayRefused(
                            f"gateway {base} refused the request: {resp.status} {text}")
                        self.move_on()
                        continue
                    return await resp.json()
            except aiohttp.ClientConnectorCertificateError as exc:
                # Said as such, not as an outage: a CA missing from
                # LLMGW_CA_FILE would otherwise look like a dead gateway.
                last = GatewayUnreachable(f"{base}: {verify_message(exc.certificate_error)}")
                self.move_on()
            except (aiohttp.ClientError, TimeoutError, GatewayUnreachable) as exc:
                last = exc
                self.move_on()
        if refused is not None:
            raise refused
        raise GatewayUnreachable(f"no gateway answered: {last}")
