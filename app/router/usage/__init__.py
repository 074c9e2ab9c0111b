"""Client keys' limits, and the usage that charges them.

A request is admitted by `limits.Limiter` (its key's requests, tokens and
concurrency per minute, shared across gateways by `shares`) before it is
sent; the `limits.Ticket` it gets holds its place in the key's
concurrency and a `meter.Meter`, which reads the answer as it passes: the
usage the engine reports (`answer_usage`, `stream_usage`), or an estimate
when none comes (`estimates`), or the engine's own count of a prompt
(`prompt_count`). The ticket charges the meter's tokens when released.
All of it is decided in memory with an injected clock: no I/O on the
request path (docs/design/client-keys.md).

Modules:
- `limits`: `Limiter` (admission, waits for a raise) and `Ticket` (one admitted request).
- `meter`: `Meter`, one request's usage read from its answer as it passes.
- `overlimit`: `OverLimit`, the refusal and when to retry, and a key's share.
- `shares`: a key's share of its limits on this gateway, from every gateway's demand.
- `budget`: a key's external-token budget per day, reserved before a spill.
- `estimates`: usage estimated from a body when no count comes; a spill's reservation.
- `answer_usage`: the usage of a whole JSON answer, read without parsing all of it.
- `stream_usage`: the usage event a llama.cpp stream owes its client, before [DONE].
- `prompt_count`: a llama.cpp stream's prompt counted by its engine, off the request.
"""

# The compiled copy of these modules, when one matches them (app/compiled.py).
from app.compiled import package_path

__path__ = package_path(__name__, __path__)
