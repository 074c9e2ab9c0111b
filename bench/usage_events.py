#!/usr/bin/env python3
"""CPU per chunk of reading a stream's events for usage (`Meter.read_events`,
app/router/usage/limits.py), in-process: a vLLM-style chunk, and an OpenAI-style
one that carries `"usage": null` as every chunk does once usage is asked.

    python bench/usage_events.py
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.router.published import Limits
from app.router.usage.limits import Limiter

CHUNK = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
         "choices": [{"index": 0, "delta": {"content": "hello"}, "logprobs": None,
                      "finish_reason": None}]}


def main(n: int = 200_000) -> None:
    ticket = Limiter().admit("k", "m", Limits())
    ticket.meter.strip_usage = True
    for name, event in (("vllm", CHUNK), ("usage-null", CHUNK | {"usage": None})):
        chunk = b"data: " + json.dumps(event).encode() + b"\n\n"
        t0 = time.process_time()
        for _ in range(n):
            ticket.meter.read_events(chunk)
        print(f"read_events {name}: {(time.process_time() - t0) / n * 1e9:.0f} ns a chunk")


if __name__ == "__main__":
    main()
