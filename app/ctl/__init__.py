"""`llmgw ctl`: the operator's commands, over a gateway's /admin API.

The gateway comes from `--gateway` or LLMGW_GATEWAY, else the URL
scripts/quickstart.sh left in the all-in-one data directory (LLMGW_DATA_DIR)
as `gateway-url`, else http://127.0.0.1:8080; the admin token from
LLMGW_ADMIN_TOKEN (else that directory's `admin-token` file). Tables for people;
`--json` prints the gateway's answer as it is, for scripts. Both are
global options, as with kubectl and gh: before the command
(`llmgw ctl --gateway URL nodes`) or after it; one after it wins. A failure
is one line on stderr ("llmgw ctl: ...") and exit status 1; a usage error 2.
A gateway URL is never printed with its credentials (user:password@), nor
used with them.

The commands live in the modules below; this module only names them, in
the order `--help` lists them. They import app/wire/ and never the control
plane or the gateway (import-linter, pyproject.toml).

- `catalog`: `model put|delete`, `catalog export|apply`
- `common`: what every command shares: the gateway, its token, one admin API call, output
- `fleet`: nodes, models, replicas, a node's logs, weights, upgrade, engine build, fabric
  tests, node tokens (reads, mostly)
- `keys`: `keys ...`: client keys, over /admin/keys
- `nodeops`: `node cordon|uncordon|drain|conf`, `quota list|set|delete`
- `waiting`: `catalog apply --wait`: polls until every model applied is ready
"""

from __future__ import annotations

from typing import Any

import typer

from app.ctl import catalog, fleet, keys, nodeops
from app.ctl.common import sub_app

app = sub_app("Operator commands, over a gateway's admin API.")

app.command()(fleet.nodes)
app.command()(fleet.models)
app.command()(fleet.replicas)
app.command()(fleet.logs)
app.command()(fleet.weights)
app.command("fabric-test")(fleet.fabric_test)
app.command()(fleet.upgrade)
app.command("engine-build")(fleet.engine_build)
app.command("node-token")(fleet.node_token_cmd)
app.add_typer(catalog.model_app, name="model")
app.add_typer(catalog.catalog_app, name="catalog")
app.add_typer(nodeops.node_app, name="node")
app.add_typer(nodeops.quota_app, name="quota")
app.add_typer(keys.app, name="keys")


# Options every command that talks to a gateway takes (app/ctl/common.py),
# and whether each takes a value.
GLOBAL_OPTIONS = {"--gateway": True, "--json": False}


def hoist_globals(argv: list[str], root: Any) -> list[str]:
    """`argv` with the global options given before the command (or between
    a group and its command: `keys --gateway URL list`) moved after it,
    where click parses a command's options. Left where they stand: options
    after the command (they come later, so they win), and everything after
    `--`. A command without the option (`node-token`) talks to no gateway:
    the option is dropped for it. `root`: typer's click command tree (a
    group has `commands`; typer vendors its own click, hence no types)."""
    cmd, i, path, moved = root, 0, [], []
    while i < len(argv) and hasattr(cmd, "commands"):
        tok = argv[i]
        name, eq, _ = tok.partition("=")
        if name in GLOBAL_OPTIONS:
            takes_value = GLOBAL_OPTIONS[name] and not eq
            if takes_value and i + 1 >= len(argv):
                return argv  # click says the value is missing
            moved += argv[i:i + 1 + takes_value]
            i += 1 + takes_value
            continue
        sub = cmd.commands.get(tok)
        if sub is None:
            break  # --help, a typo: click answers it
        path.append(tok)
        cmd, i = sub, i + 1
    if hasattr(cmd, "commands"):
        return path + argv[i:]  # no command named: the group's help or error
    taken = {o for p in cmd.params for o in p.opts}
    kept: list[str] = []
    j = 0
    while j < len(moved):
        name = moved[j].partition("=")[0]
        width = 2 if GLOBAL_OPTIONS[name] and "=" not in moved[j] else 1
        if name in taken:
            kept += moved[j:j + width]
        j += width
    return path + kept + argv[i:]


def run(argv: list[str]) -> None:
    """Runs `llmgw ctl ARGV` and exits with its status."""
    app(args=hoist_globals(argv, typer.main.get_command(app)), prog_name="llmgw ctl")
