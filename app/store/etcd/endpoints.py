"""etcd endpoints as an operator writes them, and the gRPC target they become.

`LLMGW_ETCD_ENDPOINTS` names members by host name (compose: `etcd1:2379`),
IPv4 address or bracketed IPv6 address (`[::1]:2379`). gRPC's static
`ipv4:`/`ipv6:` targets take addresses only, and its `dns:` target takes one
name, so the names are resolved by us (app/store/etcd/channel.py) and the
channel is built on the addresses (docs/design/store.md).
`https://` endpoints are the same members over TLS, all or none of them.

Everything here is pure: parsing refuses bad input at start with a message
naming the endpoint, and `grpc_target` is a function of the addresses.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Sequence
from dataclasses import dataclass

# RFC 1123 labels, plus "_": compose service names may contain it and Docker's
# DNS resolves them. A trailing dot (a fully qualified name) is allowed.
_NAME = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,62})(\.[A-Za-z0-9_][A-Za-z0-9_-]{0,62})*\.?")
_EXAMPLE = "host:port, e.g. etcd1:2379, 10.0.0.5:2379 or [::1]:2379"


@dataclass(frozen=True, slots=True)
class EtcdEndpoint:
    """One member's client address: `host` is a name or an IP (no brackets);
    `tls` for an `https://` endpoint (its certificate is checked against
    `host`, as the operator wrote it: app/store/etcd/tls.py)."""

    host: str
    port: int
    tls: bool = False

    @property
    def is_name(self) -> bool:
        return ip_version(self.host) is None

    def __str__(self) -> str:
        address = f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"
        return "https://" + address if self.tls else address


def ip_version(host: str) -> int | None:
    """4 or 6 for an IP literal, None for anything else (a host name)."""
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).version
    except ValueError:
        return None


def parse_endpoint(text: str) -> EtcdEndpoint:
    """`host:port`, `[ipv6]:port`, optionally written as `http://...`;
    `https://...` is the same member over TLS.

    Raises ValueError naming the endpoint and what is wrong with it.
    """
    raw = text.strip()

    def bad(why: str) -> ValueError:
        return ValueError(f"etcd endpoint {text!r}: {why} (want {_EXAMPLE})")

    rest = raw
    tls = False
    if "://" in rest:
        scheme, rest = rest.split("://", 1)
        if scheme.lower() not in ("http", "https"):
            raise bad(f"unknown scheme {scheme!r}")
        tls = scheme.lower() == "https"
        rest = rest.rstrip("/")
    if not rest:
        raise bad("empty")
    if rest.startswith("["):
        host, sep, port_text = rest[1:].partition("]:")
        if not sep:
            raise bad("a bracketed IPv6 address needs a port after it")
        if ip_version(host) != 6:
            raise bad(f"{host!r} in brackets is not an IPv6 address")
    else:
        host, sep, port_text = rest.rpartition(":")
        if not sep:
            raise bad("no port")
        if ":" in host:
            raise bad("an IPv6 address needs brackets")
        if re.fullmatch(r"[0-9.]+", host) and ip_version(host) != 4:
            raise bad(f"{host!r} is not an IPv4 address")
        if ip_version(host) is None and not _NAME.fullmatch(host):
            raise bad(f"{host!r} is not a host name or an IP address")
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise bad(f"port {port_text!r} is not a number from 1 to 65535")
    return EtcdEndpoint(host, int(port_text), tls)


def parse_endpoints(texts: Sequence[str]) -> list[EtcdEndpoint]:
    """Every endpoint, all of one scheme: one gateway speaks TLS to all of
    etcd or to none of it (a member in clear would carry the same keys)."""
    if not texts:
        raise ValueError("EtcdStore needs at least one endpoint")
    endpoints = [parse_endpoint(t) for t in texts]
    if len({ep.tls for ep in endpoints}) > 1:
        raise ValueError(
            "etcd endpoints mix https:// and plain (http:// or no scheme) members: "
            f"{', '.join(t.strip() for t in texts)}; all must use one scheme")
    return endpoints


def grpc_target(addresses: Sequence[tuple[str, int]]) -> str:
    """One gRPC target for every resolved (ip, port), in order, without repeats.

    All IPv4: `ipv4:a:p,b:p` (what etcd3aio builds). Any IPv6: `ipv6:` with
    IPv4 addresses written as IPv4-mapped (`[::ffff:a]:p`), since a target has
    one scheme. The mapped form needs a dual-stack IPv6 socket, which a host
    without IPv6 lacks: that is why the plain `ipv4:` form is kept whenever
    no member has an IPv6 address.
    """
    unique = list(dict.fromkeys(addresses))
    if not unique:
        raise ValueError("no etcd address to connect to")
    if all(ip_version(ip) == 4 for ip, _ in unique):
        return "ipv4:" + ",".join(f"{ip}:{port}" for ip, port in unique)
    return "ipv6:" + ",".join(
        f"[{ip if ip_version(ip) == 6 else '::ffff:' + ip}]:{port}" for ip, port in unique
    )
