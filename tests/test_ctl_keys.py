"""`llmgw ctl keys ...` against a real all-in-one gateway serving the fake
vLLM, run as an operator runs it; the keys it makes used with the official
`openai` client."""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from app.ctl.keys import parse_duration
from tests.support.procs import FAKE_BIN, Cluster, GatewayProc, serve_one, wait_for
from tests.test_ctl import ok_on, one_line_error, run_on

KEY = re.compile(r"sk-llmgw-[A-Za-z0-9_-]{20,}")


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    """One gateway for the module, with model "m" served; usage written
    every 0.2 s so a test reads it at once."""
    c = Cluster(tmp_path_factory.mktemp("ctl-keys"), None, "")
    try:
        gw = c.gateway("gw-keys", local_node="gpu-1", local_gpus="1",
                       vllm_bin=str(FAKE_BIN / "vllm"), key_usage_interval="0.2")
        serve_one(gw)
        yield gw
    finally:
        c.close()


def run(gw: GatewayProc, *args: str) -> subprocess.CompletedProcess[str]:
    return run_on(gw, "keys", *args)


def ok(gw: GatewayProc, *args: str) -> str:
    return ok_on(gw, "keys", *args)


def client(gw: GatewayProc, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0, timeout=10)


def test_a_created_key_is_shown_once_and_works_until_revoked(gw: GatewayProc) -> None:
    said = ok(gw, "create", "alice [/x]", "--model", "m", "--model", "other", "--rpm", "100",
              "--tpm", "50000", "--concurrency", "4", "--expires-in", "30d")
    (key,) = KEY.findall(said)
    assert "will not be shown again" in said
    assert key in said.splitlines()  # on a line of its own, for copying
    assert client(gw, key).models.list().data  # the official client, with this key

    (rec,) = [k for k in json.loads(ok(gw, "list", "--json")) if k["name"] == "alice [/x]"]
    assert key.startswith(rec["prefix"]) and len(rec["prefix"]) == 16
    fields = {label: value.strip() for label, value in
              (line.split(maxsplit=1) for line in said.split("\n\n")[0].splitlines())}
    assert (fields["id"], fields["prefix"]) == (rec["id"], rec["prefix"])
    assert fields["name"] == "alice [/x]"  # as given: not read as rich markup
    assert rec["models"] == ["m", "other"]
    assert rec["limits"] == {"requests_per_minute": 100, "tokens_per_minute": 50000,
                             "concurrent_requests": 4, "external_tokens_per_day": None}
    assert abs(rec["expires"] - (time.time() + 30 * 86400)) < 120 and not rec["expired"]

    table = ok(gw, "list")
    (row,) = [line for line in table.splitlines() if rec["id"] in line]
    for part in ("alice [/x]", "m, other", "100 rpm, 50000 tpm, 4 concurrent"):
        assert part in row, (part, row)
    shown = ok(gw, "show", rec["id"])
    assert "100 rpm, 50000 tpm, 4 concurrent" in shown and rec["prefix"] in shown
    assert json.loads(ok(gw, "show", rec["id"], "--json"))["id"] == rec["id"]
    # Only `create` prints the key.
    for text in (table, shown, ok(gw, "list", "--json"), ok(gw, "show", rec["id"], "--json")):
        assert key not in text

    assert ok(gw, "revoke", rec["id"]) == f"key {rec['id']} revoked\n"
    with pytest.raises(openai.AuthenticationError):
        client(gw, key).models.list()
    assert rec["id"] not in ok(gw, "list")
    said_again = one_line_error(run(gw, "revoke", rec["id"]))
    assert "404" in said_again and "No such key" in said_again and rec["id"] in said_again


def test_usage_counts_a_request_per_model(gw: GatewayProc) -> None:
    created: dict[str, Any] = json.loads(ok(gw, "create", "bob", "--json"))
    assert KEY.fullmatch(created["key"]) and created["expires"] is None
    answer = client(gw, created["key"]).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "hi"}])
    assert answer.usage is not None

    def counted() -> Any:
        data = json.loads(ok(gw, "usage", created["id"], "--json"))
        return data if data["total"]["requests"] == 1 else None

    data = wait_for(counted, 10, "the usage written")
    want = {"requests": 1, "prompt_tokens": answer.usage.prompt_tokens,
            "completion_tokens": answer.usage.completion_tokens, "estimated": 0}
    assert data["models"] == {"m": want} and data["total"] == want
    assert list(data["gateways"]) == ["gw-keys"]

    table = ok(gw, "usage", created["id"])
    assert f"key {created['id']} (bob)" in table
    rows = [[cell.strip() for cell in line.split("│")[1:-1]]
            for line in table.splitlines() if line.count("│") == 6]
    numbers = [str(want[f]) for f in ("requests", "prompt_tokens", "completion_tokens",
                                      "estimated")]
    assert rows == [["m", *numbers], ["TOTAL", *numbers]], table
    assert "gw-keys last wrote " in table and created["key"] not in table

    # A revoked key's usage stays readable.
    ok(gw, "revoke", created["id"])
    after = json.loads(ok(gw, "usage", created["id"], "--json"))
    assert after["revoked"] and after["total"] == want
    assert f"key {created['id']} (revoked)" in ok(gw, "usage", created["id"])


def test_an_expired_key_says_so(gw: GatewayProc) -> None:
    created = json.loads(ok(gw, "create", "brief", "--expires-in", "1s", "--json"))
    assert 0 < created["expires"] - created["created"] <= 1.01

    def row() -> str | None:
        lines = [line for line in ok(gw, "list").splitlines() if created["id"] in line]
        return lines[0] if lines and "(expired)" in lines[0] else None

    assert "brief" in wait_for(row, 10, "the key listed as expired", interval=0.3)
    shown = ok(gw, "show", created["id"])
    assert re.search(r"^expires +\S+ \S+ \(expired\)", shown, re.M), shown


def test_bad_input_is_one_clear_line(gw: GatewayProc) -> None:
    bad = run(gw, "create", "x", "--expires-in", "soon")
    assert bad.returncode == 2 and "--expires-in" in bad.stderr and "'soon'" in bad.stderr
    bad = run(gw, "create", "x", "--rpm", "-1")
    assert bad.returncode == 2 and "--rpm" in bad.stderr, bad.stderr
    # The gateway's 422, in one line.
    said = one_line_error(run(gw, "create", "x", "--expires", "1000"))
    assert "422" in said and "expires is in the past" in said
    said = one_line_error(run(gw, "usage", "no-such-id"))
    assert "404" in said and "'no-such-id'" in said
    assert not any(k["name"] == "x" for k in json.loads(ok(gw, "list", "--json")))


@pytest.mark.parametrize(("text", "seconds"), [
    ("30d", 30 * 86400), ("12h", 43200), ("90m", 5400), ("45s", 45), ("3600", 3600),
    ("1.5h", 5400), (" 2D ", 172800),
])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "0", "0d", "-5m", "5w", "d", "1h30m", "soon", "1e3",
                                  "9" * 400])
def test_bad_durations(text: str) -> None:
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)
