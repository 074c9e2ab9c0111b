"""Removing entries from a node's model cache (app/agent/weights.py), in
process, on real files and symlinks in a temporary cache: what a running
replica reaches through links is kept, and a folder swapped for a link
after the check never leads the removal outside the cache."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from app.agent import weights
from tests.test_node_ops import make_cache


def refused(cache: Path, path: str, in_use: dict[Path, list[str]]) -> weights.Refused:
    with pytest.raises(weights.Refused) as err:
        weights.remove(cache, [path], in_use)
    return err.value


def test_blobs_a_replica_reaches_through_a_linked_snapshot_are_kept(tmp_path: Path) -> None:
    cache, _ = make_cache(tmp_path)
    # The replica's weights: a path that is a link to the snapshot folder,
    # whose files are links into blobs/.
    served = tmp_path / "served-m"
    served.symlink_to(cache / "models--acme--m" / "snapshots" / "abc123")
    in_use = weights.in_use_paths(cache, {str(served): ["r1"]})
    for path in ("models--acme--m/blobs/b1", "models--acme--m/blobs",
                 "models--acme--m/snapshots/abc123", "models--acme--m"):
        err = refused(cache, path, in_use)
        assert (err.status, err.path) == (409, path)
        assert "holds the weights of replica r1" in err.reason
    assert (cache / "models--acme--m" / "blobs" / "b1").read_bytes()[:1] == b"w"
    # Another model's files go.
    assert weights.remove(cache, ["models--other--x/blobs/b1"], in_use) == [
        "models--other--x/blobs/b1"]
    assert not (cache / "models--other--x" / "blobs" / "b1").exists()


def test_files_a_folder_of_links_outside_the_cache_names_are_kept(tmp_path: Path) -> None:
    # `--local-dir` style weights: a folder outside the cache whose files
    # link to the cache's blobs.
    cache, _ = make_cache(tmp_path)
    local = tmp_path / "local-m"
    local.mkdir()
    (local / "model.safetensors").symlink_to(cache / "models--other--x" / "blobs" / "b1")
    in_use = weights.in_use_paths(cache, {str(local): ["r2"]})
    for path in ("models--other--x", "models--other--x/blobs/b1"):
        assert refused(cache, path, in_use).status == 409
    assert (local / "model.safetensors").read_bytes() == b"w" * 2048


def test_a_folder_swapped_for_a_link_after_the_check_leads_nowhere_outside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, outside = make_cache(tmp_path)
    (outside / "blobs").mkdir()
    (outside / "blobs" / "b1").write_text("outside the cache")
    checked = weights.check

    def check_then_swap(cache_: Path, raw: str, in_use: dict[Path, list[str]]) -> Path:
        target = checked(cache_, raw, in_use)
        # Between the check and the removal: the model folder becomes a link out.
        folder = cache / "models--other--x"
        os.rename(folder, tmp_path / "moved")
        folder.symlink_to(outside, target_is_directory=True)
        return target

    monkeypatch.setattr(weights, "check", check_then_swap)
    err = refused(cache, "models--other--x/blobs", {})
    assert err.status == 409 and "changed into a symlink" in err.reason
    assert (outside / "blobs" / "b1").read_text() == "outside the cache"
    assert (outside / "keep.txt").exists()


def test_a_folder_swapped_for_a_link_is_not_followed_by_the_removal(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The entry itself swapped: the link is removed, never what it points to.
    cache, outside = make_cache(tmp_path)
    checked = weights.check

    def check_then_swap(cache_: Path, raw: str, in_use: dict[Path, list[str]]) -> Path:
        target = checked(cache_, raw, in_use)
        os.rename(target, tmp_path / "moved")
        target.symlink_to(outside, target_is_directory=True)
        return target

    monkeypatch.setattr(weights, "check", check_then_swap)
    assert weights.remove(cache, ["models--other--x"], {}) == ["models--other--x"]
    assert not os.path.lexists(cache / "models--other--x")
    assert (outside / "keep.txt").read_text() == "not the cache's"


def test_removal_inside_the_cache_goes_as_before(tmp_path: Path) -> None:
    cache, outside = make_cache(tmp_path)
    in_use = weights.in_use_paths(cache, {"acme/m": ["r1"]})
    assert refused(cache, "models--acme--m/snapshots/abc123", in_use).status == 409
    # A folder and, in the same request, a path inside it: both named, fine.
    assert weights.remove(cache, ["models--other--x", "models--other--x/blobs"], in_use) == [
        "models--other--x", "models--other--x/blobs"]
    assert not (cache / "models--other--x").exists()
    assert (cache / "models--acme--m" / "blobs" / "b1").exists()
    assert (outside / "keep.txt").exists()


def test_what_links_into_a_snapshot_stand_on_is_kept(tmp_path: Path) -> None:
    """Weights that reach the blobs through a snapshot's own links: a folder
    of links to the snapshot's files, a GGUF path that links to one of
    them. Resolving each link to its end skipped the snapshot's links on
    the way, so the snapshot went and the weights' links dangled. Every
    link on the way is kept: the snapshot's file, its folder, `snapshots/`,
    the model folder, the blob. Seen to fail: DELETE `snapshots/` removed
    them (200)."""
    cache, _ = make_cache(tmp_path)
    snap = cache / "models--acme--m" / "snapshots" / "abc123"
    local = tmp_path / "local-m"
    local.mkdir()
    (local / "model.safetensors").symlink_to(snap / "model.safetensors")
    gguf = tmp_path / "m.gguf"
    gguf.symlink_to(snap / "model.safetensors")
    for served, rid in ((local, "r1"), (gguf, "r2")):
        in_use = weights.in_use_paths(cache, {str(served): [rid]})
        for path in ("models--acme--m/snapshots/", "models--acme--m/snapshots/abc123",
                     "models--acme--m/snapshots/abc123/model.safetensors",
                     "models--acme--m/blobs/b1", "models--acme--m"):
            err = refused(cache, path, in_use)
            assert (err.status, err.path) == (409, path), err
            assert f"holds the weights of replica {rid}," in err.reason
        assert (local / "model.safetensors").read_bytes() == b"w" * (1 << 20)
        assert gguf.read_bytes() == b"w" * (1 << 20)
    # Links through a link in the cache (a folder of its own): kept too.
    (cache / "models--acme--m" / "snapshots" / "main").symlink_to("abc123")
    (local / "model.safetensors").unlink()
    (local / "model.safetensors").symlink_to(
        cache / "models--acme--m" / "snapshots" / "main" / "model.safetensors")
    in_use = weights.in_use_paths(cache, {str(local): ["r1"]})
    for path in ("models--acme--m/snapshots/main", "models--acme--m/snapshots/abc123"):
        assert refused(cache, path, in_use).status == 409


def test_a_refusal_names_each_replica_once(tmp_path: Path) -> None:
    """A replica the agent runs is also one it is assigned, and two
    weights may reach the same files: each replica is named once, every
    one whose weights the path holds. Seen to fail: "replica r1, r1"."""
    cache, _ = make_cache(tmp_path)
    served = tmp_path / "served-m"
    served.symlink_to(cache / "models--acme--m" / "snapshots" / "abc123")
    in_use = weights.in_use_paths(cache, {"acme/m": ["r1", "r1"], str(served): ["r2", "r1"]})
    err = refused(cache, "models--acme--m", in_use)
    assert err.reason == "holds the weights of replicas r1, r2, which this node runs"
    err = refused(cache, "models--acme--m/snapshots", in_use)
    assert err.reason == "holds the weights of replicas r1, r2, which this node runs"


@contextlib.asynccontextmanager
async def node_api(tmp_path: Path, cache: Path,
                   running: dict[str, str]) -> AsyncIterator[httpx.AsyncClient]:
    """A node's API over a real agent whose replicas (id -> weights) run,
    as assigned: each is both in its assignment and among its engines."""
    from app.agent.agent import Agent
    from app.agent.config import AgentConfig
    from app.agent.engines import EngineProcess, EngineSpec
    from app.agent.nodeapi import NodeApi, NodeApiConfig
    from app.agent.running import Running

    agent = Agent(AgentConfig(gateways=["http://127.0.0.1:9"], node="n", token="t", gpus=[],
                              engines=["vllm"], work_dir=tmp_path, advertise_host="127.0.0.1"))
    for rid, w in running.items():
        spec = EngineSpec(replica_id=rid, model="m", weights=w, engine="vllm", gpus=(0,),
                          key="k")
        agent.desired[rid] = spec
        agent.running[rid] = Running(EngineProcess(spec, "127.0.0.1", 9,
                                                   tmp_path / f"{rid}.log"))
    api = NodeApi(NodeApiConfig(node="n", token="node-token", work_dir=tmp_path,
                                cache_dir=cache), agent)
    url = await api.start("127.0.0.1", 0)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10, headers={
                "Authorization": "Bearer node-token"}) as c:
            yield c
    finally:
        await api.stop()


async def test_a_running_replica_is_named_once_by_the_nodes_409(tmp_path: Path) -> None:
    cache, _ = make_cache(tmp_path / "c")
    async with node_api(tmp_path, cache, {"r1": "acme/m"}) as c:
        r = await c.request("DELETE", "/node/v1/weights",
                            json={"paths": ["models--acme--m/snapshots/"]})
    assert r.status_code == 409, r.text
    assert r.json()["detail"] == (
        "'models--acme--m/snapshots/': holds the weights of replica r1, which this node "
        "runs; nothing removed")


async def test_a_removal_refused_midway_says_what_it_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every path is checked before any is removed; one that changes after
    its check (its folder swapped for a link) is refused at its removal,
    after the paths before it went: the answer names those, not "nothing
    removed". Seen to fail: "...; nothing removed", the first path gone."""
    cache, outside = make_cache(tmp_path / "c")
    checked = weights.check

    def check_then_swap(cache_: Path, raw: str, in_use: dict[Path, list[str]]) -> Path:
        target = checked(cache_, raw, in_use)
        if raw == "models--other--x/blobs":
            folder = cache / "models--other--x"
            os.rename(folder, tmp_path / "moved")
            folder.symlink_to(outside, target_is_directory=True)
        return target

    monkeypatch.setattr(weights, "check", check_then_swap)
    async with node_api(tmp_path, cache, {}) as c:
        r = await c.request("DELETE", "/node/v1/weights", json={"paths": [
            "models--acme--m/blobs/b1", "models--other--x/blobs", "models--acme--m"]})
    assert r.status_code == 409, r.text
    problem = r.json()
    assert problem["detail"].endswith(
        "changed into a symlink or a file since it was checked; list the cache again; "
        "removed before it: 'models--acme--m/blobs/b1'"), problem["detail"]
    assert problem["path"] == "models--other--x/blobs"
    assert problem["removed"] == ["models--acme--m/blobs/b1"]
    assert not (cache / "models--acme--m" / "blobs" / "b1").exists()
    assert (cache / "models--acme--m" / "snapshots").exists()  # the path after it: kept
    assert (outside / "keep.txt").exists()


async def test_a_disk_error_midway_says_what_was_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk error (EIO, stood in for shutil's rmtree: root ignores
    permissions) removing the second path: a 500 naming it, saying it may
    be partly removed and which paths went before it."""
    cache, _ = make_cache(tmp_path / "c")
    rmtree = weights.shutil.rmtree

    def failing(path: str, *, dir_fd: int | None = None) -> None:
        if path == "models--other--x":
            raise OSError(errno.EIO, "Input/output error")
        rmtree(path, dir_fd=dir_fd)

    monkeypatch.setattr(weights.shutil, "rmtree", failing)
    async with node_api(tmp_path, cache, {}) as c:
        r = await c.request("DELETE", "/node/v1/weights", json={"paths": [
            "models--acme--m/blobs", "models--other--x"]})
    assert r.status_code == 500, r.text
    problem = r.json()
    assert problem["detail"] == (
        "'models--other--x': [Errno 5] Input/output error; it may be partly removed; "
        "removed before it: 'models--acme--m/blobs': list the cache again")
    assert (problem["path"], problem["removed"]) == ("models--other--x",
                                                     ["models--acme--m/blobs"])
    assert not (cache / "models--acme--m" / "blobs").exists()
