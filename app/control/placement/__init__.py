"""Placement: where one more replica of a model goes, and when it goes
nowhere, why, as data (docs/design/placement.md).

Pure functions of the mirrored state, no I/O. One decision, `place_any()`
over `placer_of()` (placer.py), is asked by the leader's pass (app/control/
plan/), the gateways' publisher (whether the router holds requests for a
model or refuses them), the admin API (a model's status) and /metrics
(`llmgw_model_unplaceable`), with the same inputs, so every gateway says
what the leader decides. A refusal is a `NoFit` (verdict.py): nodes
FILTERED by a named constraint or EXHAUSTED on a named dimension, counted,
a few named; text is rendered only at the edges.

- `agentversion`: the agent versions new replicas may go to (a placement filter)
- `displace`: which lower-priority replicas give way to a higher-priority minimum
- `fleet`: what the fleet holds as placement sees it: free GPUs, pools, quotas, health
- `placer`: the placer: feasibility, fit, score, pick; `place_any`, `placer_of`
- `verdict`: what placement answers: `Fit`, or `NoFit` with its structured refusals
"""
