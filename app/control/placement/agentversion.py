"""The agent versions a gateway places replicas on (docs/design/node-operations.md):
from LLMGW_MIN_AGENT_VERSION (default: this gateway's
own major.minor.0) to this gateway's own version. An agent outside keeps
the replicas it has, but the leader places nothing new there, and the
placement's reason on that node says why; an inventory without a version
(built by hand) is not refused.

Versions compare as app/wire/versions.py says: PEP 440 through `packaging`, else
by their release numbers alone (pre/post/dev parts ignored).
"""

from __future__ import annotations

from dataclasses import dataclass

from app import __version__
from app.wire.versions import RELEASE, parse


def minor_floor(version: str) -> str:
    """major.minor.0 of `version`."""
    m = RELEASE.match(version)
    parts = (m.group(1).split(".") if m else ["0"]) + ["0"]
    return f"{parts[0]}.{parts[1]}.0"


@dataclass(frozen=True)
class Window:
    minimum: str
    maximum: str

    def refusal(self, version: str) -> str | None:
        """Why an agent at `version` gets no new replicas, or None."""
        if not version:
            return None
        try:
            ok = parse(self.minimum) <= parse(version) <= parse(self.maximum)
        except ValueError:
            ok = False
        if ok:
            return None
        return (f"agent version {version} is outside the supported window "
                f"[{self.minimum}, {self.maximum}]")


def default_window(minimum: str | None = None) -> Window:
    """This gateway's window: `minimum` (LLMGW_MIN_AGENT_VERSION, checked by
    app/gateway/settings/nodes.py at start; default this gateway's major.minor.0) up to
    this gateway's version."""
    return Window(minimum or minor_floor(__version__), __version__)
