"""The leader's reconcile pass as a pure function (docs/design/control-plane.md, "Reconciler"):
from the state read (`PlanInput`) and the leader's settings
(`PlanPolicy`), what to create, drain and delete (`Plan`).

app/control/reconciler.py reads the mirror, calls `plan()` and applies
its answer fenced; tests call `plan()` directly. Nothing here does I/O or
reads a clock: the pass's time comes in its input. Where each new replica
goes is placement's decision (app/control/placement/).

- `phases`: the pass's phases but the last: sweep, orphans, order, sort out, trim
- `placing`: the last phase: placing a model's missing replicas, or saying what it waits for
- `planner`: `plan()`, its input and policy, and `wanted()`, the replicas a model should have
- `scaling`: load-based scaling between a model's min and max, one pass at a time
"""
