"""Removing entries from a node's model cache (app/agent/weights.py), in
process, on real files and symlinks in a temporary cache: what a running
replica reaches through links is kept, and a folder swapped for a link
after the check never leads the removal outside the cache."""

from __future__ import annotations

import os
from pathlib import Path

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
