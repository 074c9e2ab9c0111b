"""`llmgw ctl`: the operator's commands, over a gateway's /admin API.

The gateway comes from `--gateway` or LLMGW_GATEWAY (default
http://127.0.0.1:8080), the admin token from LLMGW_ADMIN_TOKEN (else the
all-in-one data directory's `admin-token` file). Tables for people;
`--json` prints the gateway's answer as it is, for scripts. A failure is
one line on stderr ("llmgw ctl: ...") and exit status 1; a usage error 2.

The commands live in fleet.py (nodes, models, ...: reads, mostly),
catalog.py (`model put|delete`, `catalog export|apply`), nodeops.py (`node
cordon|uncordon|drain|conf`, `quota list|set|delete`) and keys.py (`keys
...`); this module only names them, in the order `--help` lists them.
"""

from __future__ import annotations

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


def run(argv: list[str]) -> None:
    """Runs `llmgw ctl ARGV` and exits with its status."""
    app(args=argv, prog_name="llmgw ctl")
