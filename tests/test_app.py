"""The composition root: no globals, so one process can hold several gateways."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from app.gateway.main import create_app
from app.gateway.settings import Settings

ADMIN = "in-process-admin-token-0123"


async def test_three_differently_configured_gateways_in_one_process(tmp_path: Path) -> None:
    apps = [
        create_app(Settings(data_dir=tmp_path / name, gateway_id=name, port=port,
                            admin_token=f"{ADMIN}-{name}", local_agent=False))
        for name, port in (("one", 18001), ("two", 18002), ("three", 18003))
    ]
    gateways = [app.state.gateway for app in apps]
    await asyncio.gather(*(gw.start() for gw in gateways))
    try:
        for app, name in zip(apps, ("one", "two", "three"), strict=True):
            headers = {"Authorization": f"Bearer {ADMIN}-{name}"}
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://gw", headers=headers) as client:
                async def leader(c: httpx.AsyncClient = client) -> dict[str, object]:
                    return dict((await c.get("/admin/leader")).json())

                for _ in range(100):
                    view = await leader()
                    if view["is_leader"]:
                        break
                    await asyncio.sleep(0.05)
                assert view == {"gateway": name, "leader": name, "is_leader": True}
                # Each has its own admin token and its own store.
                other = "one" if name != "one" else "two"
                r = await client.get("/admin/models",
                                     headers={"Authorization": f"Bearer {ADMIN}-{other}"})
                assert r.status_code == 401
                r = await client.put(f"/admin/models/only-{name}", json={"model": "w"})
                assert r.status_code == 201
                names = [m["name"] for m in (await client.get("/admin/models")).json()]
                assert names == [f"only-{name}"]
    finally:
        await asyncio.gather(*(gw.stop() for gw in gateways))


def test_settings_refuse_weak_or_missing_secrets(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="LLMGW_SECRET is required"):
        Settings(etcd_endpoints="127.0.0.1:2379", admin_token="a" * 20)
    with pytest.raises(ValidationError, match="LLMGW_ADMIN_TOKEN is required"):
        Settings(etcd_endpoints="127.0.0.1:2379", secret="s" * 20)
    with pytest.raises(ValidationError, match="at least 16 characters"):
        Settings(secret="changeme")
    with pytest.raises(ValidationError, match="placeholder"):
        Settings(secret="changethis".ljust(16, " "))
    s = Settings(data_dir=tmp_path, port=9999)
    assert s.local_agent is True and s.gateway_id.endswith("-9999")
    s.ensure_local_secrets()
    assert s.secret is not None and len(s.secret.get_secret_value()) >= 32
    assert (tmp_path / "secret").stat().st_mode & 0o077 == 0  # readable by the owner only
    again = Settings(data_dir=tmp_path)
    again.ensure_local_secrets()
    assert again.secret == s.secret  # kept across restarts


def test_the_cli_refuses_bad_endpoints_and_node_names_in_one_line(tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")}
    env |= {"LLMGW_ETCD_ENDPOINTS": "etcd1,etcd2:2379", "LLMGW_SECRET": "s" * 20,
            "LLMGW_ADMIN_TOKEN": "a" * 20, "LLMGW_DATA_DIR": str(tmp_path)}
    r = subprocess.run([sys.executable, "-m", "app.cli", "serve"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "llmgw: invalid setting etcd_endpoints: Value error, etcd endpoint 'etcd1': no port "
        "(want host:port, e.g. etcd1:2379, 10.0.0.5:2379 or [::1]:2379)"]
    r = subprocess.run([sys.executable, "-m", "app.cli", "ctl", "node-token", "--", "-n1"],
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "node name '-n1'" in r.stderr and not r.stdout


async def test_the_mirrors_first_load_is_frozen_once_loaded(tmp_path: Path) -> None:
    """What the mirror loads is most of what a gateway keeps for good: it is
    frozen once loaded, so that no collection walks it again (at 10,000
    nodes a full collection over it held the GIL ~300 ms, stalling the
    router: bench/control_scale.py). Seen to fail: frozen only at startup,
    before the mirror's load in the background, its state stayed tracked."""
    import gc

    app = create_app(Settings(data_dir=tmp_path, gateway_id="gc", port=18004,
                              admin_token=ADMIN, local_agent=False))
    gw = app.state.gateway
    try:
        async with app.router.lifespan_context(app):
            assert await gw.mirror.wait_past(0, 10)
            for _ in range(200):
                freezing = [t for t in asyncio.all_tasks() if t.get_name() == "gc-freeze"]
                if not freezing:
                    break
                await asyncio.sleep(0.05)
            assert not freezing, "the mirror's state was not frozen"
            tracked = {id(o) for o in gc.get_objects()}
            assert gc.get_freeze_count() > 0
            assert id(gw.mirror._kvs) not in tracked
    finally:
        gc.unfreeze()
