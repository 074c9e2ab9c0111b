"""`llmgw ctl model put|delete` and `llmgw ctl catalog export|apply` against
a real all-in-one gateway serving model "m" on the fake vLLM, run as an
operator runs them; the catalog checked over the admin API."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
import typer
import yaml

from app.ctl.catalog import parse_catalog
from app.ctl.common import TIMEOUT
from tests.support.procs import FAKE_BIN, Cluster, GatewayProc, serve_one
from tests.test_ctl import admin_get, ctl, ok_json, ok_on, one_line_error, run_on


@pytest.fixture(scope="module")
def gw(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProc]:
    """One gateway for the module, its one GPU held by model "m"."""
    c = Cluster(tmp_path_factory.mktemp("ctl-catalog"), None, "")
    try:
        gw = c.gateway("gw-cat", local_node="gpu-1", local_gpus="1",
                       vllm_bin=str(FAKE_BIN / "vllm"))
        serve_one(gw)
        yield gw
    finally:
        c.close()


run = run_on
get = admin_get


def ok(gw: GatewayProc, *args: str, stdin: str | None = None) -> list[str]:
    return ok_on(gw, *args, stdin=stdin).splitlines()


def status_of(gw: GatewayProc, name: str) -> int:
    with gw.admin() as admin:
        return admin.get(f"/admin/models/{name}").status_code


def test_put_from_a_file_and_from_stdin_then_again(gw: GatewayProc, tmp_path: Path) -> None:
    spec = tmp_path / "a.yaml"
    spec.write_text("model: acme/a\ngpus: 1\naliases: [a-small]\n"
                    "replicas: {min: 0, max: 0}  # kept, never run\n")
    said = ok(gw, "model", "put", "a", str(spec))
    assert said == ["model a created", "a: 0/0 ready, 0 placed, health ok"], said
    stored = get(gw, "/admin/models/a")
    assert (stored["model"], stored["gpus"], stored["aliases"], stored["replicas"]) == (
        "acme/a", 1, ["a-small"], {"min": 0, "max": 0})

    # JSON on stdin; its one GPU is m's, so the status line says why it waits.
    said = ok(gw, "model", "put", "org/b", "-",
              stdin=json.dumps({"model": "acme/b", "gpus": 1}))
    assert said[0] == "model org/b created" and len(said) == 2, said
    assert said[1].startswith("org/b: 0/1 ready, 0 placed, health unplaceable (0 of 1 "
                              "replicas placed; no node fits); not placed: gpu-1: "), said
    assert get(gw, "/admin/models/org/b")["status"]["unplaced"] in said[1]

    spec.write_text("model: acme/a\ngpus: 1\naliases: [a-big]\nreplicas: {min: 0, max: 0}\n")
    assert ok(gw, "model", "put", "a", str(spec))[0] == "model a updated"
    assert get(gw, "/admin/models/a")["aliases"] == ["a-big"]
    answer = json.loads("\n".join(ok(gw, "model", "put", "a", str(spec), "--json")))
    # The same spec again: nothing written.
    assert answer["result"] == "unchanged" and answer["model"]["status"]["wanted"] == 0

    # show prints what put takes back: the round trip changes nothing.
    shown = ok(gw, "model", "show", "a")
    assert shown[0] == "# a: 0/0 ready, 0 placed, health ok", shown
    assert yaml.safe_load("\n".join(shown)) == {
        "model": "acme/a", "aliases": ["a-big"], "gpus": 1, "replicas": {"min": 0, "max": 0}}
    before = get(gw, "/admin/models/a")
    assert ok(gw, "model", "put", "a", "-", stdin="\n".join(shown))[0] == "model a unchanged"
    after = get(gw, "/admin/models/a")
    assert after["etag"] == before["etag"]  # not written again
    assert {k: v for k, v in after.items() if k not in ("status", "etag")} == {
        k: v for k, v in before.items() if k not in ("status", "etag")}

    assert ok(gw, "model", "delete", "org/b") == ["model org/b deleted"]
    assert ok(gw, "model", "delete", "a") == ["model a deleted"]
    assert status_of(gw, "a") == status_of(gw, "org/b") == 404
    said_again = one_line_error(run(gw, "model", "delete", "a"))
    assert "404" in said_again and "model 'a' is not in the catalog" in said_again


def test_a_bad_spec_is_one_line_naming_the_field(gw: GatewayProc, tmp_path: Path) -> None:
    # The gateway's rules across fields (app/control/catalog.py).
    said = one_line_error(run(gw, "model", "put", "c", "-",
                              stdin="model: acme/c\nreplicas: {min: 0, max: 2}\n"))
    assert said.startswith("llmgw ctl: model c: ") and " answered 422: " in said, said
    assert "idle_timeout: replicas.min 0 needs an idle_timeout" in said
    # The schema's 422 names the field too, not only "does not match the schema".
    said = one_line_error(run(gw, "model", "put", "c", "-", stdin='{"model": "x", "gpu": 1}'))
    assert "422" in said and "gpu: Extra inputs are not permitted" in said, said
    said = one_line_error(run(gw, "model", "put", "c", "-", stdin="model: x\ngpus: many\n"))
    assert "gpus: Input should be a valid integer" in said, said

    broken = tmp_path / "c.yaml"
    broken.write_text("model: [acme/c\n")
    said = one_line_error(run(gw, "model", "put", "c", str(broken)))
    assert f"{broken} is not valid YAML or JSON" in said
    said = one_line_error(run(gw, "model", "put", "c", "-", stdin="just text"))
    assert "stdin: expected a model's spec" in said
    said = one_line_error(run(gw, "model", "put", "c", "-", stdin="models: {c: {model: x}}"))
    assert "llmgw ctl catalog apply" in said
    said = one_line_error(run(gw, "model", "put", "c", str(tmp_path / "none.yaml")))
    assert "cannot read" in said and "none.yaml" in said
    assert status_of(gw, "c") == 404


def test_export_apply_and_prune(gw: GatewayProc, tmp_path: Path) -> None:
    ok(gw, "model", "put", "x", "-", stdin="model: acme/x\ngpus: 1\nreplicas: {min: 0, max: 0}")
    ok(gw, "model", "put", "y", "-", stdin='{"model": "acme/y", "gpus": 1, "aliases": ["why"],'
                                           ' "replicas": {"min": 0, "max": 0}}')
    before = get(gw, "/admin/catalog")
    assert sorted(before["models"]) == ["m", "x", "y"]
    created = {m["name"]: m["created"] for m in get(gw, "/admin/models")}
    etags = {m["name"]: m["etag"] for m in get(gw, "/admin/models")}

    exported = "\n".join(ok(gw, "catalog", "export"))
    assert json.loads(exported) == before
    as_yaml = tmp_path / "catalog.yaml"
    as_yaml.write_text("\n".join(ok(gw, "catalog", "export", "--yaml")) + "\n")
    assert yaml.safe_load(as_yaml.read_text()) == before

    # The export applied to the catalog it came from changes nothing.
    assert ok(gw, "catalog", "apply", str(as_yaml)) == [
        "model m unchanged", "model x unchanged", "model y unchanged"]
    assert ok(gw, "catalog", "apply", "-", stdin=exported) == [
        "model m unchanged", "model x unchanged", "model y unchanged"]
    assert get(gw, "/admin/catalog") == before
    assert {m["name"]: m["created"] for m in get(gw, "/admin/models")} == created

    # Edited: x changed, y left out, z new.
    edited: dict[str, Any] = yaml.safe_load(as_yaml.read_text())
    edited["models"]["x"]["aliases"] = ["ex"]
    del edited["models"]["y"]
    edited["models"]["z"] = {"model": "acme/z", "gpus": 1, "replicas": {"min": 0, "max": 0}}
    as_yaml.write_text(yaml.safe_dump(edited))
    # The dry run reads the catalog and says what apply would do, model by model.
    dry = ok(gw, "catalog", "apply", str(as_yaml), "--dry-run", "--prune")
    assert dry == ["model m: unchanged", "model x: would be updated",
                   "model z: would be created", "model y: would be deleted",
                   f"{as_yaml}: 3 models, valid (dry run: nothing changed)"], dry
    dry = ok(gw, "catalog", "apply", str(as_yaml), "--dry-run")
    assert dry[-2:] == [f"model y: would be kept: not in {as_yaml} (--prune deletes it)",
                        f"{as_yaml}: 3 models, valid (dry run: nothing changed)"], dry
    assert get(gw, "/admin/catalog") == before
    assert {m["name"]: m["etag"] for m in get(gw, "/admin/models")} == etags

    assert ok(gw, "catalog", "apply", str(as_yaml)) == [
        "model m unchanged", "model x updated", "model z created",
        f"model y kept: not in {as_yaml} (--prune deletes it)"]
    assert sorted(get(gw, "/admin/catalog")["models"]) == ["m", "x", "y", "z"]
    assert get(gw, "/admin/models/x")["aliases"] == ["ex"]

    assert ok(gw, "catalog", "apply", str(as_yaml), "--prune") == [
        "model m unchanged", "model x unchanged", "model z unchanged", "model y deleted"]
    assert get(gw, "/admin/catalog") == edited
    assert status_of(gw, "y") == 404


def test_apply_checks_the_file_first_and_stops_at_the_first_error(
        gw: GatewayProc, tmp_path: Path) -> None:
    before = get(gw, "/admin/catalog")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"models": {"p": {"model": "acme/p", "gpus": 1},
                                          "q": {"model": "acme/q", "engine": "llamacpp",
                                                "gpus": 1}}}))
    for args in ([str(bad)], [str(bad), "--dry-run"]):
        said = one_line_error(run(gw, "catalog", "apply", *args))
        assert f"{bad}: models.q.gpus: engine llamacpp runs on CPU nodes" in said, said
    said = one_line_error(run(gw, "catalog", "apply", "-", stdin="m: {model: acme/m}"))
    assert "stdin: " in said and "expected a mapping {models:" in said, said
    assert get(gw, "/admin/catalog") == before  # nothing was put

    # Valid here, refused by the gateway (its model roots): p is put, r is
    # not, s is never tried.
    stops = tmp_path / "stops.yaml"
    stops.write_text(yaml.safe_dump({"models": {
        "p": {"model": "acme/p", "gpus": 1, "replicas": {"min": 0, "max": 0}},
        "r": {"model": "/srv/elsewhere/r", "gpus": 1},
        "s": {"model": "acme/s", "gpus": 1}}}, sort_keys=False))
    done = run(gw, "catalog", "apply", str(stops))
    said = one_line_error(done)
    assert done.stdout.splitlines() == ["model p created"]
    assert said.startswith("llmgw ctl: model r: ") and "422" in said, said
    assert "model: '/srv/elsewhere/r' is not under a model root" in said
    assert (status_of(gw, "p"), status_of(gw, "r"), status_of(gw, "s")) == (200, 404, 404)
    ok(gw, "model", "delete", "p")


def test_apply_is_not_held_to_the_seeds_limit(capsys: pytest.CaptureFixture[str]) -> None:
    """A seed is one transaction (127 models at most); apply puts one model
    at a time, so a bigger file is valid for it, and still checked."""
    many = {"models": {f"m{i}": {"model": f"acme/m{i}", "gpus": 1} for i in range(130)}}
    assert len(parse_catalog(many, "big.yaml")) == 130
    many["models"]["m7"]["gpus"] = 99
    with pytest.raises(typer.Exit):
        parse_catalog(many, "big.yaml")
    said = capsys.readouterr().err
    assert said.startswith("llmgw ctl: big.yaml: models.m7.gpus: ") and "130 models" not in said


def test_show_then_put_if_match_refuses_a_model_changed_since(
        gw: GatewayProc, tmp_path: Path) -> None:
    ok(gw, "model", "put", "e", "-", stdin="model: acme/e\ngpus: 1\nreplicas: {min: 0, max: 0}")
    shown = ok(gw, "model", "show", "e")
    tag = shown[1].split()[2].rstrip(":")
    assert shown[1] == f"# etag {tag}: put it back with --if-match '{tag}'", shown
    assert ok_json("model", "show", "e", gateway=gw.url)["etag"] == tag
    edited = tmp_path / "e.yaml"
    edited.write_text("\n".join(shown).replace("gpus: 1", "gpus: 2") + "\n")

    # Someone else's edit lands between show and put: the put is refused.
    ok(gw, "model", "put", "e", "-", stdin="model: acme/e\ngpus: 3\nreplicas: {min: 0, max: 0}")
    said = one_line_error(run(gw, "model", "put", "e", str(edited), "--if-match", tag))
    now = get(gw, "/admin/models/e")["etag"]
    assert "412" in said and now in said, said
    assert get(gw, "/admin/models/e")["gpus"] == 3

    # Shown again, put with the ETag shown (unquoted, as a shell may leave it).
    assert ok(gw, "model", "put", "e", str(edited), "--if-match", now.strip('"'))[0] == (
        "model e updated")
    assert get(gw, "/admin/models/e")["gpus"] == 2
    said = one_line_error(run(gw, "model", "put", "e", str(edited), "--create"))
    assert "412" in said, said
    said = one_line_error(run(gw, "model", "delete", "e", "--if-match", now))
    assert "412" in said, said
    assert ok(gw, "model", "delete", "e", "--if-match", get(gw, "/admin/models/e")["etag"]) == [
        "model e deleted"]


class Recorder(BaseHTTPRequestHandler):
    """A stand-in gateway: one model "a" at ETag "7"; records each write."""

    writes: ClassVar[list[tuple[str, str, dict[str, str]]]] = []

    def do_GET(self) -> None:
        if self.path == "/admin/catalog":
            self.reply(200, {"models": {"a": {"model": "acme/a", "gpus": 1}}})
            return
        self.reply(200, [{"name": "a", "created": 1.0, "etag": '"7"', "status": {},
                          "model": "acme/a", "gpus": 1}])

    def do_PUT(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.writes.append(("PUT", self.path, {k.lower(): v for k, v in self.headers.items()}))
        self.reply(200, {})

    def do_DELETE(self) -> None:
        self.writes.append(("DELETE", self.path, {k.lower(): v for k, v in self.headers.items()}))
        self.send_response(204)
        self.end_headers()

    def reply(self, status: int, body: Any) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *_: Any) -> None:
        pass


def test_every_write_carries_a_deadline_and_apply_conditions_each_on_what_it_read(
        tmp_path: Path) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        catalog = tmp_path / "c.yaml"
        catalog.write_text("models:\n  a: {model: acme/a, gpus: 2}\n  b: {model: acme/b}\n")
        before = time.time()
        done = ctl("catalog", "apply", str(catalog), gateway=url)
        assert done.returncode == 0, done.stderr
        done = ctl("catalog", "apply", "-", "--prune", gateway=url, stdin="models: {}")
        assert done.returncode == 0, done.stderr
    finally:
        server.shutdown()
        server.server_close()
    writes = {(m, p): h for m, p, h in Recorder.writes}
    assert sorted(writes) == [("DELETE", "/admin/models/a"), ("PUT", "/admin/models/a"),
                              ("PUT", "/admin/models/b")], sorted(writes)
    assert writes["PUT", "/admin/models/a"]["if-match"] == '"7"'
    assert writes["PUT", "/admin/models/b"]["if-none-match"] == "*"
    assert writes["DELETE", "/admin/models/a"]["if-match"] == '"7"'
    for headers in writes.values():
        deadline = float(headers["x-request-deadline"])
        assert before + TIMEOUT - 1 < deadline < time.time() + TIMEOUT, headers


def test_apply_puts_adapters_after_their_base_and_prunes_them_first(
    gw: GatewayProc, tmp_path: Path,
) -> None:
    start = get(gw, "/admin/catalog")
    with_adapter: dict[str, Any] = {"models": dict(start["models"]) | {
        # Sorted by name (as YAML dumps them) the adapter comes first.
        "a-sql": {"adapter": {"base": "zz-base", "weights": "acme/sql-lora"}},
        "zz-base": {"model": "acme/base", "gpus": 1, "replicas": {"min": 0, "max": 0}}}}
    file = tmp_path / "adapters.yaml"
    file.write_text(yaml.safe_dump(with_adapter))
    out = ok(gw, "catalog", "apply", str(file))
    assert out[-2:] == ["model zz-base created", "model a-sql created"], out
    assert get(gw, "/admin/models/a-sql")["adapter"]["base"] == "zz-base"
    file.write_text(yaml.safe_dump(start))
    out = ok(gw, "catalog", "apply", str(file), "--prune")
    assert out[-2:] == ["model a-sql deleted", "model zz-base deleted"], out
    assert get(gw, "/admin/catalog") == start


def test_apply_puts_overflows_first_and_prunes_them_last(gw: GatewayProc,
                                                          tmp_path: Path) -> None:
    """A model's overflow must exist before it and outlive it (Catalog,
    *Spill-over*): apply orders its writes so a file's order never matters."""
    before = get(gw, "/admin/catalog")
    idle = {"gpus": 1, "replicas": {"min": 0, "max": 0}, "overflow": "b-remote"}
    with_spill: dict[str, Any] = {"models": {
        **before["models"], "a": {"model": "acme/a", **idle},
        "b-remote": {"external": {"url": "https://llm.example.com", "model": "gpt-x"}},
        "c": {"model": "acme/c", **idle}}}
    path = tmp_path / "spill.yaml"
    path.write_text(yaml.safe_dump(with_spill))
    out = ok(gw, "catalog", "apply", str(path))
    assert out.index("model b-remote created") < out.index("model a created"), out
    assert get(gw, "/admin/catalog") == with_spill
    path.write_text(yaml.safe_dump(before))
    out = ok(gw, "catalog", "apply", str(path), "--prune")
    assert out[-3:] == ["model a deleted", "model c deleted", "model b-remote deleted"], out
    assert get(gw, "/admin/catalog") == before
def test_putting_back_what_show_printed_changes_nothing(gw: GatewayProc, tmp_path: Path) -> None:
    """`model show NAME > f; model put NAME f`: the spec round-trips, so no
    write (the ETag and the catalog serial stay), no rollout, the replica
    stays (docs/design/admin-writes.md, "Catalog writes")."""
    before = get(gw, "/admin/models/m")
    replica = [r["id"] for r in get(gw, "/admin/replicas") if r["model"] == "m"]
    shown = tmp_path / "m.yaml"
    shown.write_text("\n".join(ok(gw, "model", "show", "m")) + "\n")
    said = ok(gw, "model", "put", "m", str(shown))
    assert said[0] == "model m unchanged", said
    after = get(gw, "/admin/models/m")
    assert after["etag"] == before["etag"]
    assert after["created"] == before["created"]
    time.sleep(1.5)  # a few leader ticks: nothing rolls
    assert [r["id"] for r in get(gw, "/admin/replicas") if r["model"] == "m"] == replica
    assert "rolling m" not in gw.output()
