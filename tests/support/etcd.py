"""A throwaway etcd for tests: fixtures over bench/etcd_server.py.

Tests talk to a real etcd rather than a fake, so the same contract suite that
covers the embedded store covers the real thing (see tests/test_store_contract.py).

`LLMGW_TEST_ETCD=host:port` points the tests at an etcd someone else runs
instead. Tests that stop, pause or kill etcd never use the session's etcd
(the `etcd_server` fixture, shared by every other test): they start one of
their own (`own_etcd`, `throwaway_etcd`), whatever LLMGW_TEST_ETCD says.
Without an etcd binary the tests skip, except under `CI=true`, where a
missing etcd must fail the run rather than hide it.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import pytest

from bench.etcd_server import (
    EtcdServer,
    EtcdTlsFiles,
    find_etcd_binary,
    free_port,
)
from tests.support.procs import Cluster, GatewayProc


class ExternalEtcd:
    """An etcd the tests did not start (LLMGW_TEST_ETCD); never stopped by them.

    It is the session's shared etcd: a test that stops, pauses or kills etcd
    takes `own_etcd` instead, so these fail rather than hide such a test."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.external = True

    def _refuse(self, what: str) -> None:
        pytest.fail(f"a test tried to {what} the shared etcd; use the own_etcd fixture",
                    pytrace=False)

    def stop(self) -> None:
        self._refuse("stop")

    def pause(self) -> None:
        self._refuse("pause")

    def kill(self) -> None:
        self._refuse("kill")

    def resume(self) -> None:
        self._refuse("resume")

    def start(self) -> None:
        self._refuse("start")

    def restart(self) -> None:
        self._refuse("restart")


def missing_etcd(reason: str) -> None:
    """Skip outside CI; under CI=true a missing etcd is a failure, never a skip."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI=true: etcd is required)", pytrace=False)
    pytest.skip(reason)


def etcd_binary() -> str:
    """The etcd to start: fails under CI, skips elsewhere, when there is none."""
    binary = find_etcd_binary()
    if binary is None:
        missing_etcd("no etcd binary on PATH or at /usr/bin/etcd "
                     "(apt-get install etcd-server; scripts/install-test.sh does)")
        raise AssertionError("unreachable")
    return binary


class EtcdFixture:
    """Owns the temporary directory and the server for one test session."""

    def __init__(self) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.server: EtcdServer | ExternalEtcd | None = None

    def start(self) -> EtcdServer | ExternalEtcd:
        external = os.environ.get("LLMGW_TEST_ETCD", "").strip()
        if external:
            self.server = ExternalEtcd(external)
            return self.server
        binary = etcd_binary()
        self._tmp = tempfile.TemporaryDirectory(prefix="llmgw-etcd-")
        server = EtcdServer(binary, Path(self._tmp.name) / "data")
        server.start()
        self.server = server
        return server

    def stop(self) -> None:
        if isinstance(self.server, EtcdServer):
            self.server.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


@contextmanager
def throwaway_etcd(root: Path, host: str = "127.0.0.1", tls: EtcdTlsFiles | None = None,
                   flags: Sequence[str] = ()) -> Iterator[EtcdServer]:
    """An etcd of the caller's own under `root`, stopped on exit: for tests
    that stop, pause or kill it (never the session's shared one), that
    need it to serve TLS, or that start it with more `flags` of etcd's."""
    server = EtcdServer(etcd_binary(), root / f"etcd-{host.replace(':', '_')}" / "data", host,
                        tls, flags)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def unready_gateway(cluster: Cluster, name: str, **settings: str) -> GatewayProc:
    """A gateway process on `cluster`'s etcd endpoints, started without
    waiting for /readyz (Cluster.gateway waits): for etcds it cannot reach."""
    port = free_port()
    env = cluster.base_env()
    env.update({"LLMGW_PORT": str(port), "LLMGW_GATEWAY_ID": name,
                "LLMGW_DATA_DIR": str(cluster.tmp / name),
                "LLMGW_ETCD_ENDPOINTS": cluster.etcd or "", "LLMGW_ETCD_PREFIX": cluster.prefix})
    env.update({f"LLMGW_{k.upper()}": v for k, v in settings.items()})
    gw = GatewayProc(name, ["serve"], env, cluster.tmp / f"{name}.log", port=port,
                     gateway_id=name)
    gw.start()
    cluster.procs.append(gw)
    return gw
