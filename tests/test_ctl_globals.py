"""`llmgw ctl`'s global options, before the command or after it (as with
kubectl and gh), and a gateway URL's credentials never printed. The real
CLI against a real gateway."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from app.ctl import app, hoist_globals
from app.ctl.common import shown
from tests.support.procs import Cluster, free_port
from tests.test_ctl import ctl, one_line_error


def test_global_options_go_before_or_after_the_command(solo: Cluster) -> None:
    gw = solo.gateway("gw", local_agent="false")
    dead = f"http://127.0.0.1:{free_port()}"
    # The README's own example; LLMGW_GATEWAY points elsewhere, the option wins.
    for args in (("--gateway", gw.url, "nodes"), (f"--gateway={gw.url}", "nodes"),
                 ("nodes", "--gateway", gw.url), ("--gateway", dead, "nodes", "--gateway", gw.url)):
        done = ctl(*args, gateway=dead)
        assert done.returncode == 0, (args, done.stderr)
        assert "NODE" in done.stdout, done.stdout
    # --json too, and between a group and its command.
    done = ctl("--json", "--gateway", gw.url, "keys", "create", "alice")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["name"] == "alice"
    done = ctl("keys", "--gateway", gw.url, "--json", "list", gateway=dead)
    assert done.returncode == 0, done.stderr
    assert [k["name"] for k in json.loads(done.stdout)] == ["alice"]
    done = ctl("--json", "model", "show", "nope", "--gateway", gw.url)
    assert "404" in one_line_error(done)
    # A command that talks to no gateway ignores it.
    done = ctl("--gateway", gw.url, "node-token", "n1", LLMGW_SECRET="keyfile-secret-0123456789")
    assert done.returncode == 0, done.stderr
    # Usage errors stay usage errors.
    assert ctl("--gateway").returncode == 2
    assert ctl("--gateway", gw.url, "nosuch").returncode == 2


def test_hoisting_keeps_everything_else_in_place() -> None:
    root = typer.main.get_command(app)
    assert hoist_globals(["--gateway", "U", "nodes"], root) == ["nodes", "--gateway", "U"]
    assert hoist_globals(["--json", "keys", "--gateway=U", "show", "k1", "--", "--json"],
                         root) == ["keys", "show", "--json", "--gateway=U", "k1", "--", "--json"]
    assert hoist_globals(["--gateway", "U", "--help"], root) == ["--help"]
    assert hoist_globals(["nodes", "--json"], root) == ["nodes", "--json"]


def test_a_gateway_url_with_credentials_is_neither_used_nor_printed(solo: Cluster) -> None:
    gw = solo.gateway("gw", local_agent="false")
    port = gw.url.rsplit(":", 1)[1]
    url = f"http://admin:hunter2-pass@127.0.0.1:{port}"
    for done in (ctl("--gateway", url, "nodes"), ctl("models", gateway=url),
                 ctl("keys", "list", "--gateway", url),
                 ctl("nodes", gateway=f"http://admin:hun/ter2-pass@127.0.0.1:{port}"),  # a "/"
                 ctl("nodes", gateway=f"http://hunter2-pass@127.0.0.1:{free_port()}")):
        said = one_line_error(done)
        assert "hunter2" not in done.stdout + done.stderr and "ter2-pass" not in said
        assert "***@127.0.0.1" in said and "holds credentials" in said, said


def test_shown_hides_every_part_of_a_credential() -> None:
    assert shown("https://u:p@gw:8080/x") == "https://***@gw:8080/x"
    assert shown("https://u:p@ss@gw:8080") == "https://***@gw:8080"
    assert shown("http://gw:8080") == "http://gw:8080"
    assert shown("u:p@gw") == "***@gw"


def test_without_gateway_given_ctl_goes_where_the_data_directory_says(
    solo: Cluster, tmp_path: Path,
) -> None:
    """scripts/quickstart.sh leaves its gateway's URL in the data directory
    (it may serve on another port, LLMGW_PORT): ctl finds it there; an
    explicit LLMGW_GATEWAY or --gateway still wins."""
    gw = solo.gateway("gw", local_agent="false")
    data = tmp_path / "llmgw-data"
    data.mkdir()
    (data / "gateway-url").write_text(gw.url + "\n")
    done = ctl("nodes", LLMGW_DATA_DIR=str(data))
    assert done.returncode == 0 and "NODE" in done.stdout, done.stderr
    dead = f"http://127.0.0.1:{free_port()}"
    assert dead in one_line_error(ctl("nodes", gateway=dead, LLMGW_DATA_DIR=str(data)))
    assert dead in one_line_error(ctl("nodes", "--gateway", dead, LLMGW_DATA_DIR=str(data)))
