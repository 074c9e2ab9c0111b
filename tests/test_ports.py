"""app/ports.py: a free port for a process that binds it later, drawn
below the kernel's ephemeral range, where no outgoing connection takes it
meanwhile (a test's gateway failed its start with "Address already in use"
while its peers connected to etcd)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from app import ports


def test_a_port_is_below_the_ephemeral_range_and_free() -> None:
    low, high = ports.ephemeral_range()
    assert low < high
    for _ in range(20):
        port = ports.free_port()
        assert 10000 <= port < low, (port, low)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: it binds


def test_an_ipv6_host_gets_a_port_of_its_own_family() -> None:
    port = ports.free_port("::1")
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", port))


def test_a_taken_port_is_passed_over(monkeypatch: pytest.MonkeyPatch) -> None:
    other = ports.free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports.free_port()))
        taken.listen()
        busy = taken.getsockname()[1]
        draws = iter([busy, busy, other])
        monkeypatch.setattr(random, "randrange", lambda a, b: next(draws))
        assert ports.free_port() == other


def test_no_room_below_the_range_falls_back_to_the_kernels_pick(tmp_path: Path) -> None:
    low_range = tmp_path / "range"
    low_range.write_text("10500\t60999\n")
    assert ports.ephemeral_range(low_range) == (10500, 60999)
    port = ports.free_port(path=low_range)
    assert port >= ports.ephemeral_range()[0]  # the kernel's own pick, not a draw


def test_an_unreadable_range_is_linuxs_default(tmp_path: Path) -> None:
    assert ports.ephemeral_range(tmp_path / "none") == (32768, 60999)
    (tmp_path / "bad").write_text("x y")
    assert ports.ephemeral_range(tmp_path / "bad") == (32768, 60999)
