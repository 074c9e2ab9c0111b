"""llama-cpp-python's OpenAI server (`python -m llama_cpp.server`), as the
agent starts it: the same server and arguments, its access log without the
agent's liveness probe.

A ready engine is asked every second whether it is alive (health.py).
llama-cpp-python's server has no health route, so the probe is `GET /docs`,
and its access log would write a line for it every second: 86,400 a day,
burying what the engine said before a failure (the last lines a death's
detail shows, `llmgw ctl logs`). The server takes no option for its access
log, so a filter is put on uvicorn's access logger before the server starts
it (uvicorn's logging configuration replaces a logger's handlers, never its
filters). Every other request is logged as before.
"""

from __future__ import annotations

import logging
import runpy

from app.agent.health import LIVENESS_PATHS

PROBE = LIVENESS_PATHS["llamacpp"]


class NoProbe(logging.Filter):
    """Drops uvicorn's access line of a GET of the probe's path. The line's
    arguments are (client, method, path and query, HTTP version, status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        return not (isinstance(args, tuple) and len(args) >= 3
                    and args[1] == "GET" and args[2] == PROBE)


def main() -> None:
    logging.getLogger("uvicorn.access").addFilter(NoProbe())
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
