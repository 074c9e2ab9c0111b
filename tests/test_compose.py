"""compose/docker-compose.yml, checked for structure only: there is no Docker
engine here (nor in CI), so nothing is started. What is checked is what
would hurt in the field: a service without a healthcheck (depends_on waits
on nothing), etcd data on the container's own layer (a recreated container
loses the catalog and every client key), endpoints naming services that do
not exist, and a balancer config other than the one tests/test_haproxy.py
runs in front of real gateways."""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.cli import _CUT_SLACK
from app.gateway.settings import Settings
from app.store.etcd.endpoints import parse_endpoints
from tests.support.procs import ROOT
from tests.test_haproxy import SHIPPED_CONFIG

COMPOSE = ROOT / "compose" / "docker-compose.yml"
GATEWAY_UNIT = ROOT / "deploy" / "systemd" / "llmgw-gateway.service"


def stop_takes() -> float:
    """The longest a gateway's clean stop takes with the default settings:
    the notice, the grace, the cut's slack (docs/design/stopping.md)."""
    fields = Settings.model_fields
    notice = fields["shutdown_notice_seconds"].default
    grace = fields["shutdown_grace_seconds"].default
    assert isinstance(notice, float) and isinstance(grace, float)
    return notice + grace + _CUT_SLACK


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    loaded = yaml.safe_load(COMPOSE.read_text())  # resolves the x- anchors and merges
    assert isinstance(loaded, dict) and loaded.get("services"), "no services in the file"
    return loaded


def etcd_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    found = {name: svc for name, svc in compose["services"].items()
             if "etcd" in str(svc.get("image", ""))}
    assert len(found) in (1, 3, 5), f"etcd members: {sorted(found)}"
    return found


def mounts(service: dict[str, Any]) -> dict[str, str]:
    """Target path -> source of each volume in the short `source:target[:mode]` form."""
    out: dict[str, str] = {}
    for volume in service.get("volumes", []):
        assert isinstance(volume, str), f"long-form volume not handled here: {volume!r}"
        source, target = volume.split(":")[:2]
        out[target] = source
    return out


def test_every_service_has_a_healthcheck(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        check = service.get("healthcheck") or {}
        test = check.get("test")
        assert isinstance(test, list) and test[0] in ("CMD", "CMD-SHELL") and len(test) > 1, (
            f"{name}: no healthcheck command")
        assert not check.get("disable"), f"{name}: healthcheck disabled"


def test_every_dependency_waits_for_health(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        for dep, cond in (service.get("depends_on") or {}).items():
            assert dep in compose["services"], f"{name} depends on unknown {dep}"
            assert cond == {"condition": "service_healthy"}, f"{name} -> {dep}: {cond}"


def test_each_etcd_keeps_its_data_on_a_named_volume(compose: dict[str, Any]) -> None:
    named = compose.get("volumes") or {}
    sources = []
    for name, service in etcd_services(compose).items():
        args = shlex.split(service["command"])
        data_dir = args[args.index("--data-dir") + 1]
        source = mounts(service).get(data_dir)
        assert source is not None, f"{name}: nothing mounted on its data dir {data_dir}"
        assert source in named, f"{name}: {source!r} is not a named volume of the file"
        sources.append(source)
    assert len(set(sources)) == len(sources), f"members share a volume: {sources}"


def test_gateways_name_every_etcd_member_by_service_name(compose: dict[str, Any]) -> None:
    members = etcd_services(compose)
    gateways = {name: svc for name, svc in compose["services"].items()
                if "LLMGW_ETCD_ENDPOINTS" in (svc.get("environment") or {})}
    assert len(gateways) >= 2, f"gateways: {sorted(gateways)}"
    for name, service in gateways.items():
        text = service["environment"]["LLMGW_ETCD_ENDPOINTS"]
        endpoints = parse_endpoints(text.split(","))  # what the gateway will accept
        assert {e.host for e in endpoints} == set(members), f"{name}: {text}"
        assert all(e.is_name and e.port == 2379 for e in endpoints), f"{name}: {text}"


def test_the_balancer_mounts_the_haproxy_cfg_test_haproxy_runs(
    compose: dict[str, Any],
) -> None:
    balancers = {name: svc for name, svc in compose["services"].items()
                 if str(svc.get("image", "")).startswith("haproxy")}
    assert len(balancers) == 1, sorted(balancers)
    (service,) = balancers.values()
    source = mounts(service).get("/usr/local/etc/haproxy/haproxy.cfg")
    assert source is not None, "haproxy's config path is not mounted"
    # Relative sources are relative to the compose file's folder.
    assert (COMPOSE.parent / source).resolve() == Path(SHIPPED_CONFIG).resolve()
    assert SHIPPED_CONFIG.is_file()


def test_etcd_compaction_is_chosen_and_the_way_out_of_nospace_is_written(
    compose: dict[str, Any]
) -> None:
    """The leader compacts (LLMGW_ETCD_COMPACTION_INTERVAL), so every member
    says its own auto-compaction is off; and the file says how to get out of
    a NOSPACE alarm (docs/design/security-operations.md, "A month of uptime")."""
    for name, service in etcd_services(compose).items():
        args = shlex.split(service["command"])
        assert "--auto-compaction-retention=0" in args, f"{name}: {args}"
    text = COMPOSE.read_text()
    for words in ("LLMGW_ETCD_COMPACTION_INTERVAL", "etcdctl defrag", "etcdctl alarm disarm"):
        assert words in text, words


def seconds(text: str) -> float:
    """A duration as compose and systemd write them here: "640s", "10m40s", "640"."""
    m = re.fullmatch(r"(?:(\d+)min|(\d+)m)?(?:(\d+)s?)?", text.strip())
    assert m and text.strip(), f"unreadable duration {text!r}"
    minutes = int(m.group(1) or m.group(2) or 0)
    return 60 * minutes + int(m.group(3) or 0)


def test_gateways_are_given_their_whole_stop(compose: dict[str, Any]) -> None:
    gateways = {name: svc for name, svc in compose["services"].items()
                if "LLMGW_ETCD_ENDPOINTS" in (svc.get("environment") or {})}
    for name, service in gateways.items():
        given = seconds(str(service.get("stop_grace_period", "10s")))  # compose's default
        # Docker sends SIGKILL at the end: it must come after the cut.
        assert stop_takes() < given <= stop_takes() + 60, (name, given, stop_takes())


def test_the_gateway_unit_gives_the_whole_stop() -> None:
    unit = GATEWAY_UNIT.read_text()
    found = re.findall(r"^TimeoutStopSec=(\S+)$", unit, re.M)
    assert len(found) == 1, found
    assert stop_takes() < seconds(found[0]) <= stop_takes() + 60, (found, stop_takes())
    # SIGTERM to the gateway; a second one would stop it at once.
    assert re.search(r"^KillSignal=SIGTERM$", unit, re.M)


def test_the_balancer_times_a_request_as_the_gateways_do() -> None:
    """compose/haproxy.cfg's request timeout (headers, and the body it
    buffers) is the gateways' header and body timeouts, and its keep-alive
    theirs, by default (tests/test_haproxy.py runs them shortened)."""
    cfg = SHIPPED_CONFIG.read_text()
    fields = Settings.model_fields
    request = re.findall(r'^\s*timeout http-request "\$\{LLMGW_LB_REQUEST_TIMEOUT-(\w+)\}"',
                         cfg, re.M)
    assert len(request) == 1, request
    assert (seconds(request[0]) == fields["header_timeout"].default
            == fields["body_timeout"].default), request
    keep_alive = re.findall(r"^\s*timeout http-keep-alive (\w+)\s*$", cfg, re.M)
    assert len(keep_alive) == 1, keep_alive
    assert seconds(keep_alive[0]) == fields["keep_alive_timeout"].default, keep_alive
    per_source = re.findall(r'sc0_conn_cur gt "\$\{LLMGW_LB_CONNS_PER_SOURCE-(\d+)\}"', cfg)
    assert len(per_source) == 1, per_source
