"""Bad input gets a clear 4xx in the right shape, never a 500."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.support.procs import ADMIN, Cluster, GatewayProc, make_key


@pytest.fixture
def gw(solo: Cluster) -> Iterator[GatewayProc]:
    yield solo.gateway("gw-bad", local_agent="false")


def _openai_error(r: httpx.Response, status: int) -> dict[str, object]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert "type" in err
    return dict(err)


def test_v1_errors_are_openai_shaped(gw: GatewayProc) -> None:
    key = make_key(gw)
    auth = {"Authorization": f"Bearer {key}"}
    chat = gw.url + "/v1/chat/completions"
    msg = {"messages": [{"role": "user", "content": "hi"}]}

    err = _openai_error(httpx.post(chat, json={"model": "nope", **msg}, headers=auth), 404)
    assert err["code"] == "model_not_found"

    _openai_error(httpx.post(chat, content=b"{not json", headers=auth), 400)
    _openai_error(httpx.post(chat, content=b"[1, 2]", headers=auth), 400)
    _openai_error(httpx.post(chat, json={"messages": []}, headers=auth), 400)

    err = _openai_error(httpx.post(chat, json={"model": "x", **msg}), 401)
    assert err["code"] == "invalid_api_key"
    err = _openai_error(
        httpx.post(chat, json={"model": "x", **msg}, headers={"Authorization": "Bearer sk-wrong"}),
        401,
    )
    assert err["code"] == "invalid_api_key"
    _openai_error(httpx.get(gw.url + "/v1/models"), 401)

    _openai_error(httpx.get(gw.url + "/v1/nowhere", headers=auth), 404)
    _openai_error(httpx.get(chat, headers=auth), 405)
    _openai_error(httpx.post(chat, content=b"x" * (33 * 1024 * 1024), headers=auth), 413)

    # The official client maps them to its typed errors.
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    bad = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_admin_errors_are_problem_json(gw: GatewayProc) -> None:
    r = httpx.get(gw.url + "/admin/models")
    assert r.status_code == 401
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["status"] == 401
    r = httpx.get(gw.url + "/admin/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401

    auth = {"Authorization": f"Bearer {ADMIN}"}
    r = httpx.put(gw.url + "/admin/models/m1", content=b"{oops", headers=auth)
    assert r.status_code == 422 and r.json()["title"] == "Invalid request body"
    r = httpx.put(gw.url + "/admin/models/m1", json={"model": "w", "gpus": -1}, headers=auth)
    assert r.status_code == 422
    r = httpx.put(gw.url + "/admin/models/m1",
                  json={"model": "w", "replicas": {"min": 3, "max": 1}}, headers=auth)
    assert r.status_code == 422
    r = httpx.put(gw.url + "/admin/models/m1", json={"model": "w", "bogus": 1}, headers=auth)
    assert r.status_code == 422
    r = httpx.put(gw.url + "/admin/models/bad%20name", json={"model": "w"}, headers=auth)
    assert r.status_code == 400
    r = httpx.get(gw.url + "/admin/models/absent", headers=auth)
    assert r.status_code == 404 and r.json()["title"] == "No such model"
    r = httpx.delete(gw.url + "/admin/keys/absent", headers=auth)
    assert r.status_code == 404

    # A name clash is refused and the first model is kept as it was.
    assert httpx.put(gw.url + "/admin/models/m1", json={"model": "w", "aliases": ["a1"]},
                     headers=auth).status_code == 201
    r = httpx.put(gw.url + "/admin/models/m2", json={"model": "v", "aliases": ["a1"]},
                  headers=auth)
    assert r.status_code == 409
    m1 = httpx.get(gw.url + "/admin/models/m1", headers=auth).json()
    assert m1["aliases"] == ["a1"]
    # No node to run it: any gateway can say why (placement is pure).
    assert m1["status"] == {"wanted": 1, "replicas": 0, "ready": 0, "failed": [],
                           "unplaced": "no nodes", "placement": {
                               "nodes_evaluated": 0, "nodes_filtered": {}, "nodes_exhausted": {},
                               "reasons": [], "text": "no nodes"}, "health": {
                               "state": "unplaceable", "reasons": {},
                               "detail": "0 of 1 replicas placed; no nodes"}}


def test_keys_are_shown_once_and_stored_hashed(gw: GatewayProc, solo: Cluster) -> None:
    auth = {"Authorization": f"Bearer {ADMIN}"}
    created = httpx.post(gw.url + "/admin/keys", json={"name": "alice"}, headers=auth).json()
    assert created["key"].startswith("sk-")
    listed = httpx.get(gw.url + "/admin/keys", headers=auth).json()
    assert [k["id"] for k in listed] == [created["id"]]
    assert created["key"] not in httpx.get(gw.url + "/admin/keys", headers=auth).text
    # The store is SQLite in WAL mode: a fresh record sits in state.db-wal until
    # a checkpoint. Read every file of it (no -shm: it is opened with an
    # exclusive lock), the WAL first, so that a checkpoint in between moves the
    # record to a file not yet read rather than hides it.
    files = sorted((solo.tmp / "gw-bad").glob("state.db*"), key=lambda f: f.name != "state.db-wal")
    assert [f.name for f in files][:1] == ["state.db-wal"] and len(files) >= 2, files
    stored = b"".join(f.read_bytes() for f in files)
    # The hash is there (this read the right place), the key is not.
    assert hashlib.sha256(created["key"].encode()).hexdigest().encode() in stored
    assert created["key"].encode() not in stored

    auth_c = {"Authorization": f"Bearer {created['key']}"}
    assert httpx.get(gw.url + "/v1/models", headers=auth_c).status_code == 200
    assert httpx.delete(gw.url + f"/admin/keys/{created['id']}", headers=auth).status_code == 204
    assert httpx.get(gw.url + "/v1/models", headers=auth_c).status_code == 401
    # Secrets never reach the log either.
    assert created["key"] not in gw.output()
    assert ADMIN not in gw.output()
