"""What the agent knows of one assigned replica's engine (app/agent/agent.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.agent.engines import EngineProcess
from app.wire.names import Phase


@dataclass
class Running:
    """One assigned replica's engine and what the agent knows of it."""

    proc: EngineProcess
    phase: Phase = "starting"
    detail: str = ""
    # Clock times of this replica's recent engine deaths (see health.py).
    deaths: list[float] = field(default_factory=list)
    retry_at: float = 0.0
    # Crash-looping: left failed, not restarted until its assignment changes.
    given_up: bool = False
    # Ready once since it started: liveness probes from then on, not readiness.
    was_ready: bool = False
    probe_failures: int = 0
    # Clock time of its start (or adoption: the clocks of two runs differ);
    # None once ready. Bounds how long it may stay `starting`.
    started_at: float | None = None
    # The key it holds changed since the engine was last found to accept
    # one: the next observe checks it (health.serves_model).
    key_unchecked: bool = False
