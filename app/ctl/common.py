"""What every `llmgw ctl` command shares: the gateway and its admin token,
one admin API call, a failure in one line, output as a table or as JSON."""

from __future__ import annotations

import json
import os
import ssl
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table

from app.tls import client_context, verify_message

DEADLINE_HEADER = "X-Request-Deadline"  # app/api/writes.py
TIMEOUT = 60.0  # the gateway waits up to LLMGW_NODE_API_TIMEOUT (30 s) on an agent

# Where the gateway is when neither --gateway nor LLMGW_GATEWAY says: the URL
# scripts/quickstart.sh leaves in the all-in-one's data directory (it may
# serve on another port, LLMGW_PORT), else the all-in-one's default port.
GATEWAY_FILE = "gateway-url"
LOCAL_GATEWAY = "http://127.0.0.1:8080"
Gateway = Annotated[str, typer.Option(
    "--gateway", envvar="LLMGW_GATEWAY", show_default=False,
    help=f"a gateway's URL (LLMGW_GATEWAY; default: the URL in the data directory's "
         f"{GATEWAY_FILE} file, else {LOCAL_GATEWAY})")]
AsJson = Annotated[bool, typer.Option("--json", help="print the gateway's JSON answer")]
DEFAULT_GATEWAY = ""  # none given: `gateway_url` finds it


def fail(message: str) -> NoReturn:
    """A failure: one line on stderr, exit status 1."""
    sys.stderr.write(f"llmgw ctl: {message}\n")
    raise typer.Exit(1)


def data_dir_file(name: str) -> str:
    data_dir = Path(os.environ.get("LLMGW_DATA_DIR", "~/.local/share/llmgw")).expanduser()
    path = data_dir / name
    return path.read_text().strip() if path.exists() else ""


def gateway_url(given: str) -> str:
    """The gateway to talk to: `given` (--gateway, LLMGW_GATEWAY), else the
    data directory's GATEWAY_FILE, else LOCAL_GATEWAY."""
    return given or data_dir_file(GATEWAY_FILE) or LOCAL_GATEWAY


def _admin_token() -> str:
    token = os.environ.get("LLMGW_ADMIN_TOKEN", "") or data_dir_file("admin-token")
    if not token:
        fail("set LLMGW_ADMIN_TOKEN (the gateways' admin token)")
    return token


@dataclass(frozen=True)
class Answer:
    """An admin API call's answer: its status, raw body and headers
    (names lower-cased)."""

    status: int
    body: bytes
    headers: dict[str, str]

    def json(self) -> Any:
        """The body as JSON; None for an empty one (a 204)."""
        return json.loads(self.body or b"null")


def send(gateway: str, method: str, path: str, body: Any = None,
         params: dict[str, str] | None = None, timeout: float = TIMEOUT,
         about: str = "", headers: dict[str, str] | None = None) -> Answer:
    """One admin API call (`headers`: sent besides the token's, an Accept
    or a condition). Fails with the gateway's
    problem detail (each field named when the body did not match the schema),
    after `about` ("model m: ") when given. A write carries this call's
    deadline (X-Request-Deadline: now + `timeout`), so that a gateway does
    not apply it once this has given up (docs/design/admin-writes.md, "Catalog writes")."""
    gateway = gateway_url(gateway)
    if shown(gateway) != gateway:
        fail(f"the gateway URL {shown(gateway)} holds credentials (user:password@), which "
             "llmgw ctl neither sends nor prints: the admin token goes in LLMGW_ADMIN_TOKEN")
    url = gateway.rstrip("/") + path + (f"?{urllib.parse.urlencode(params)}" if params else "")
    data = json.dumps(body).encode() if body is not None else None
    sent = {"Authorization": f"Bearer {_admin_token()}", "Content-Type": "application/json",
            **(headers or {})}
    if method not in ("GET", "HEAD"):
        sent[DEADLINE_HEADER] = f"{time.time() + timeout:.3f}"
    req = urllib.request.Request(url, data=data, method=method, headers=sent)
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=_tls()) as resp:
            return Answer(resp.status, resp.read(),
                          {k.lower(): v for k, v in resp.headers.items()})
    except urllib.error.HTTPError as exc:
        said = _problem_said(exc.read())
        if exc.code == 401:
            said += " (check LLMGW_ADMIN_TOKEN)"
        fail(f"{about}{gateway} answered {exc.code}: {said}")
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, ssl.SSLCertVerificationError):
            reason = verify_message(reason)
        fail(f"{about}cannot reach the gateway at {gateway}: {reason}")


def shown(url: str) -> str:
    """`url` as it may be printed: any user:password@ replaced by ***@.
    Everything up to the last "@" counts (a password may hold "@", ":" or
    an unencoded "/"; a gateway's URL has no "@" of its own), so that no
    part of a credential is ever printed."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    at = rest.rfind("@")
    if at < 0:
        return url
    return f"{scheme}{sep}***@{rest[at + 1:]}"


def _tls() -> ssl.SSLContext:
    """How an https gateway is verified: LLMGW_CA_FILE (a PEM bundle), else
    the system's CAs. Never off: the admin token goes in every request."""
    try:
        return client_context(os.environ.get("LLMGW_CA_FILE") or None)
    except ValueError as exc:
        fail(str(exc))


def _problem_said(raw: bytes) -> str:
    try:
        problem = json.loads(raw)
    except ValueError:
        problem = None
    if not isinstance(problem, dict):
        return " ".join(raw.decode(errors="replace")[:200].split())
    said = str(problem.get("title", ""))
    detail = problem.get("detail")
    errors = problem.get("errors")
    if isinstance(errors, list) and detail == _SCHEMA_MISMATCH:
        # The schema's 422 says only that the body did not match: name each field.
        detail = "; ".join(
            f"{'.'.join(str(p) for p in e.get('loc', [])[1:]) or 'body'}: {e.get('msg', '')}"
            for e in errors if isinstance(e, dict)) or detail
    if detail:
        said = f"{said}: {detail}" if said else str(detail)
    return " ".join(said.split())  # one line, whatever the gateway wrote


_SCHEMA_MISMATCH = "the body does not match the schema"  # app/api/errors.py


def request(gateway: str, method: str, path: str, body: Any = None,
            params: dict[str, str] | None = None, timeout: float = TIMEOUT) -> Any:
    """One admin API call, its JSON answer; fails with the gateway's problem detail."""
    return send(gateway, method, path, body, params, timeout).json()


def sub_app(help_text: str) -> typer.Typer:
    """A group of commands (`llmgw ctl keys ...`), as the root is made: no
    completion, no locals in tracebacks (they would print the admin token)."""
    return typer.Typer(no_args_is_help=True, add_completion=False,
                       pretty_exceptions_show_locals=False, help=help_text)


def console() -> Console:
    """Where tables go. No rich markup: cells hold what engines and
    operators wrote ("[rank0]: ...", a key named "[/x]"), shown as written.
    Piped (no terminal), rows are never wrapped at 80 columns, so that
    `grep` and `awk` see one line per row; `COLUMNS` still sets a width."""
    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(highlight=False, markup=False, width=1000 if wide else None)


def out(data: Any, as_json: bool, table: Table | None = None) -> None:
    """The answer as JSON, or `table` for people (see `console`)."""
    if as_json or table is None:
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    else:
        console().print(table)


def when(unix_time: float, seconds: bool = False) -> str:
    """A Unix time for people, in local time."""
    return time.strftime("%Y-%m-%d %H:%M" + (":%S" if seconds else ""),
                         time.localtime(unix_time))
