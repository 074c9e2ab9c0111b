"""Names shared by every shape in the state: how a model, alias, node or
profile may be spelled, and the engines and phases there are."""

from __future__ import annotations

import re
from typing import Literal

# OpenAI model ids often hold a slash ("org/model"); spaces, control
# characters and a leading dot or slash do not belong in a key or a URL.
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}$")

Engine = Literal["vllm", "llamacpp"]
Phase = Literal["starting", "ready", "failed", "stopping", "stopped"]


def check_name(value: str, what: str = "name") -> str:
    if not _NAME.match(value) or "//" in value or value.endswith("/"):
        raise ValueError(
            f"{what} {value!r} must be 1-128 characters of letters, digits and ._:/@+- "
            "starting with a letter or digit"
        )
    return value


def check_labels(labels: dict[str, str]) -> dict[str, str]:
    """A node's labels, or a profile's node_selector that matches them."""
    for k, val in labels.items():
        check_name(k, "label name")
        if len(val) > 256 or any(ord(c) < 0x20 or ord(c) == 0x7f for c in val):
            raise ValueError(f"label {k!r}: its value must be at most 256 printable characters")
    return labels
