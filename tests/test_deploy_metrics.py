"""deploy/prometheus/alerts.yml and deploy/grafana/llmgw.json: promtool
accepts the rules, and every series an alert or a dashboard query names is
one a real gateway serves, scraped after requests through the vLLM stand-in
(docs/design/metrics.md)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import openai
import yaml

from tests.support.procs import FAKE_BIN, ROOT, Cluster, make_key, put_model, routes, wait_for
from tests.support.scrape import samples, scrape_text, served_names

ALERTS = ROOT / "deploy" / "prometheus" / "alerts.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "llmgw.json"
# Every series of ours is prefixed; label names and PromQL's words are not.
_SERIES = re.compile(r"\bllmgw_[A-Za-z0-9_:]*")
# Label values ("5..", a legend's text) are no series names.
_QUOTED = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'')


def alert_exprs(text: str) -> list[str]:
    rules = [r for g in yaml.safe_load(text)["groups"] for r in g["rules"]]
    assert rules and all(isinstance(r.get("expr"), str) for r in rules)
    return [str(r["expr"]) for r in rules]


def dashboard_exprs(text: str) -> list[str]:
    """Every panel target's `expr` and every templating query, rows' panels included."""
    board = json.loads(text)
    found: list[str] = []

    def panels(items: list[dict[str, Any]]) -> None:
        for p in items:
            found.extend(t["expr"] for t in p.get("targets", []) if "expr" in t)
            panels(p.get("panels", []))

    panels(board["panels"])
    for var in board.get("templating", {}).get("list", []):
        query = var.get("query")
        if var.get("type") == "query":
            found.append(query["query"] if isinstance(query, dict) else str(query))
    return found


def series_in(expr: str) -> set[str]:
    return set(_SERIES.findall(_QUOTED.sub('""', expr)))


def unknown_series(exprs: list[str], served: set[str]) -> set[str]:
    """The series named in `exprs` that `served` lacks; each expression
    must name one of ours at least."""
    for e in exprs:
        assert series_in(e), f"no llmgw_ series in {e!r}"
    return {name for e in exprs for name in series_in(e)} - served


def promtool() -> str:
    """Never skipped: scripts/install.sh installs it (Debian's `prometheus`)."""
    found = shutil.which("promtool")
    assert found, "promtool is missing: apt-get install prometheus (scripts/install.sh does)"
    return found


def test_promtool_accepts_the_alert_rules(tmp_path: Path) -> None:
    done = subprocess.run([promtool(), "check", "rules", str(ALERTS)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(alert_exprs(ALERTS.read_text()))} rules found" in done.stdout
    # It does check: a copy with a broken expression is refused.
    broken = tmp_path / "alerts.yml"
    broken.write_text(ALERTS.read_text().replace("sum(llmgw_leader) > 1",
                                                 "sum(llmgw_leader) > > 1"))
    done = subprocess.run([promtool(), "check", "rules", str(broken)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "FAILED" in done.stdout + done.stderr


def test_alerts_and_dashboard_name_only_series_a_gateway_serves(solo: Cluster) -> None:
    gw = solo.gateway("deploy", local_node="gpu-1", local_gpus="2",
                      vllm_bin=str(FAKE_BIN / "vllm"))
    key = make_key(gw)
    put_model(gw, "m", {"model": "acme/m", "gpus": 1})
    wait_for(lambda: routes(gw, key, "m"), 30, "routing")
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [
        {"role": "user", "content": "hello there"}]
    client.chat.completions.create(model="m", messages=messages)
    assert list(client.chat.completions.create(model="m", messages=messages, stream=True))

    def engines_polled() -> str | None:
        text = scrape_text(gw.url)
        return text if ("llmgw_num_requests_running", (("model", "m"),)) in samples(
            text) else None

    served = served_names(wait_for(engines_polled, 10, "the engines' load in /metrics"))
    alerts, board = ALERTS.read_text(), DASHBOARD.read_text()
    assert unknown_series(alert_exprs(alerts), served) == set()
    assert unknown_series(dashboard_exprs(board), served) == set()
    # What the dashboard shows: each of these in some query.
    shown = {n for e in dashboard_exprs(board) for n in series_in(e)}
    assert {"llmgw_requests_total", "llmgw_time_to_first_token_seconds_bucket",
            "llmgw_prompt_tokens_total", "llmgw_replicas", "llmgw_node_gpus",
            "llmgw_leader", "llmgw_store_unreachable", "llmgw_store_nospace"} <= shown

    # A name wrong in a copy is caught, in either file.
    wrong = alerts.replace("llmgw_held_timeouts_total", "llmgw_held_timeout_total")
    assert unknown_series(alert_exprs(wrong), served) == {"llmgw_held_timeout_total"}
    wrong = board.replace("llmgw_time_to_first_token_seconds_bucket",
                          "llmgw_time_to_first_token_bucket")
    assert unknown_series(dashboard_exprs(wrong), served) == {
        "llmgw_time_to_first_token_bucket"}
