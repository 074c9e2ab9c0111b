"""Upgrades refused before anything is installed (app/agent/upgrade.py,
app/agent/codeorigin.py, app/api/nodes.py): by the gateway (an admin's
index, a version outside its window, no hash), and by an agent whose
restart would not run what pip installs."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import httpx
import pytest

from app import __version__
from app.agent.codeorigin import code_origin_problem
from app.agent.upgrade import UpgradeConfig, UpgradeError, Upgrader, parse_source
from app.control import state as s
from app.control.placement import agentversion
from tests.support.etcd import EtcdServer, ExternalEtcd
from tests.support.procs import until
from tests.test_agent_api import _join, gateways
from tests.test_upgrade import build_wheel, stand_in_python


async def test_the_gateway_refuses_an_index_a_version_outside_its_window_and_no_hash(
    etcd_server: EtcdServer | ExternalEtcd, etcd_prefix: str, tmp_path: Path
) -> None:
    sha = "a" * 64
    async with gateways(etcd_server, etcd_prefix, tmp_path, 1) as [(_app, c)]:
        await _join(c, "n1")

        async def upgrade(body: dict[str, Any]) -> httpx.Response:
            return await c.post("/admin/nodes/n1/upgrade", json=body)

        r = await upgrade({"version": __version__, "sha256": sha,
                           "index_url": "https://evil.example/simple"})
        assert r.status_code == 422 and "index_url" in r.text, r.text
        assert "LLMGW_AGENT_UPGRADE_SOURCE" in r.text
        r = await upgrade({"version": "99.0.0", "sha256": sha})
        assert r.status_code == 422, r.text
        window = f"[{agentversion.minor_floor(__version__)}, {__version__}]"
        assert f"agent version 99.0.0 is outside the supported window {window}" in r.text
        r = await upgrade({"version": __version__})
        assert r.status_code == 422 and "sha256" in r.text, r.text
        # Within the window, with a hash: relayed (n1 reports no API here),
        # once this gateway's mirror holds the node (the join is not awaited there).
        gw = _app.state.gateway
        await until(lambda: gw.mirror.get(s.NODES + "n1") is not None, "node mirrored")
        r = await upgrade({"version": __version__, "sha256": sha})
        assert r.status_code == 502 and "reports no agent API" in r.text, r.text


# --- the code a re-executed agent imports (codeorigin.py) ------------------------------


def package(root: Path) -> Path:
    (root / "app").mkdir(parents=True)
    (root / "app" / "__init__.py").write_text("")
    return root


def test_an_agent_run_from_its_sources_is_refused_before_anything_installs(
    tmp_path: Path
) -> None:
    site = str(package(tmp_path / "site"))
    empty = tmp_path / "elsewhere"
    empty.mkdir()
    # Installed, started elsewhere: the restart imports what pip installs.
    assert code_origin_problem(str(empty), [site], [site]) is None
    # The image: its working directory holds the `app/` it was built from.
    image = str(package(tmp_path / "opt-llmgw"))
    why = code_origin_problem(image, [site], [site])
    assert why is not None and f"import llmgw from {image}/app, not from {site}" in why
    # A checkout on PYTHONPATH, or a path-based editable install.
    why = code_origin_problem(str(empty), [image, site], [site])
    assert why is not None and f"{image}/app" in why
    # Not importable by path at all (an editable install's import hook).
    why = code_origin_problem(str(empty), [], [site])
    assert why is not None and "editable" in why
    # Where pip cannot write (the image's root-owned site-packages).
    why = code_origin_problem(str(empty), [site], [site], can_write=lambda d: False)
    assert why is not None and f"cannot write to {site}" in why


async def test_an_upgrade_from_a_checkout_is_refused_with_the_reason(tmp_path: Path) -> None:
    # This test runs in the repository, whose ./app a restarted agent would
    # import: before, this upgrade answered 200 and changed nothing.
    assert (Path.cwd() / "app" / "__init__.py").exists()
    wheel = build_wheel("0.1.0", tmp_path / "wheels")
    cfg = UpgradeConfig(source=parse_source(str(tmp_path / "wheels")),
                        python=stand_in_python(tmp_path))
    up = Upgrader(cfg, lambda v: None)
    with pytest.raises(UpgradeError) as err:
        await up.upgrade("0.1.0", hashlib.sha256(wheel.read_bytes()).hexdigest())
    assert (err.value.status, err.value.title) == (409, "Upgrade would not take effect")
    assert f"import llmgw from {Path.cwd()}/app" in err.value.detail
    assert not (tmp_path / "runs").exists()
