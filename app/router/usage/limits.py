"""Client key limits and usage, router side: decided per request with no I/O.

The request path never waits on the store (DESIGN invariant 2), so gateways
cannot ask each other, or etcd, how much of a key's minute is left. Instead
each gateway admits up to its claim on each limit (`set_claims`), moved by a
background loop toward where the key's requests arrive (app/router/usage/shares.py,
app/gateway/key_shares.py; docs/design/client-keys.md): N gateways together
admit at most `limit + N - 1` per window. The loop reads `key_loads()` and
is woken (`on_short`) when a request is refused on a claim below the limit.
Such a request is not refused yet (`admit_or_wait`): it waits, up to
`CLAIM_WAIT`, for the loop's next steps (one raise, a conditional write,
shared by every request waiting then), checked again after each, and is
refused only if still over this gateway's part at the deadline. An
admitted request never waits. Until the loop first sets claims (a Limiter
alone, in tests), each gateway enforces an equal share, `ceil(limit / N)`.

* requests per minute: a sliding window of admission times (exact, no
  bucket rounding); a request counts when admitted, whatever its outcome.
* tokens per minute: prompt + completion tokens, known only when an answer
  ends, so they are charged then; a request is admitted while the window's
  tokens are under the share, so a gateway overshoots its share by at most
  the tokens of the answers it had in flight when it reached it.
* concurrent requests: this gateway's in-flight requests of the key.
* expiry: the key's Unix time against the (injected) wall clock.

Usage (requests, prompt and completion tokens per key and model) is counted
here and taken in batches by whoever writes it to the store (`take_usage`);
the router never imports the control plane (DESIGN invariant 8). A stream
that ends before the engine's usage event (the client left, the engine
died, a timeout) is charged an estimate, counted as such (`estimate_usage`),
not nothing; one from an engine that never reports usage (llama-cpp-python's
server) is counted: its completion tokens from its events here, its prompt
by the engine afterwards (app/router/usage/prompt_count.py, `add_prompt`).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

from app.router.published import NO_LIMITS, Limits
from app.router.usage.budget import ExternalBudget
from app.router.usage.estimates import counted_completion, estimate_usage
from app.router.usage.meter import Meter
from app.router.usage.overlimit import OverLimit, share
from app.router.usage.shares import DEMAND_WINDOW, FLOOR, KINDS, KeyLoad, share_of

_T = TypeVar("_T")

WINDOW = 60.0  # seconds: the "minute" of requests and tokens per minute
# How long a client refused for concurrency is told to wait: no request's
# end can be predicted, and one second is what a polite retry costs.
_CONCURRENCY_RETRY = 1
# Seconds a request refused on a claim below its key's limit waits for the
# claims loop to raise that claim (docs/design/client-keys.md): a
# raise is one transaction on the store, milliseconds, and the moves that
# take an idle part from another gateway a few watch round trips. Longer:
# a key really at its limit (as the records say) is refused that much later.
CLAIM_WAIT = 0.75


class _KeyState:
    __slots__ = ("asked", "inflight", "limited", "refused", "requests", "token_sum", "tokens",
                 "waiting")

    def __init__(self) -> None:
        self.requests: deque[float] = deque()  # admission times in the window
        self.tokens: deque[tuple[float, int]] = deque()  # (charged at, tokens)
        self.token_sum = 0
        self.inflight = 0
        self.limited = False
        # Times requests were asked for lately (a flood is counted up to the
        # cap: its weight in the split is then as large as it gets anyway),
        # and when each limit last refused one.
        self.asked: deque[float] = deque(maxlen=4096)
        self.refused: dict[str, float] = {}
        # Requests waiting now for a claim to be raised, by the limit they
        # wait on (`Limiter.admit_or_wait`); none at 0.
        self.waiting: dict[str, int] = {}

    def prune(self, now: float, window: float) -> None:
        while self.requests and self.requests[0] <= now - window:
            self.requests.popleft()
        while self.tokens and self.tokens[0][0] <= now - window:
            self.token_sum -= self.tokens.popleft()[1]
        while self.asked and self.asked[0] <= now - DEMAND_WINDOW:
            self.asked.popleft()

    def idle(self) -> bool:
        return not (self.requests or self.tokens or self.inflight or self.asked
                    or self.waiting)

    def wait_on(self, kinds: tuple[str, ...], n: int) -> None:
        for kind in kinds:
            left = self.waiting.get(kind, 0) + n
            if left > 0:
                self.waiting[kind] = left
            else:
                self.waiting.pop(kind, None)


class Limiter:
    """This gateway's view of every key's window. One per gateway.

    `clock` times the windows (monotonic); `wall` is compared with expiry
    times, which are Unix times. Tests pass one fake for both."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 wall: Callable[[], float] = time.time, window: float = WINDOW) -> None:
        self._clock = clock
        self._wall = wall
        self._window = window
        self._keys: dict[str, _KeyState] = {}
        # (key id, model) -> [requests, prompt tokens, completion tokens, estimated]
        self._usage: dict[tuple[str, str], list[int]] = {}
        # Key id -> limit name -> this gateway's claim; None: equal shares.
        self._claims: dict[str, dict[str, int]] | None = None
        # When (this clock) the claims lapse: the lease unproven, the record may
        # be gone and the part taken. Checked per request: a gateway resumed
        # from a pause serves before its claims loop steps.
        self._claims_until = float("inf")
        self.on_short: Callable[[], None] | None = None
        # The claims loop's next step, awaited by a request refused below its
        # key's limit (set by the loop; None: nothing to wait for, refused).
        self.settle: Callable[[], Awaitable[None]] | None = None
        self.claim_wait = CLAIM_WAIT
        # What this gateway admits of a key on no claim, while its claims
        # stand and once they lapsed: FLOOR, unless it is a worker of a
        # gateway of several (app/gateway/key_shares.py, `claim_floors`).
        self.floor = FLOOR
        self.lapsed_floor = FLOOR
        # Tokens served by overflow providers, per key over a day (budget.py).
        self.external = ExternalBudget(clock, self.claims_of, lambda: self.on_short,
                                       self._floor)

    def claims_of(self, key_id: str, now: float | None = None) -> Mapping[str, int] | None:
        """This gateway's claims on `key_id`'s limits, none once they lapsed
        (`now`: this limiter's clock, read if not given); None: no claims loop."""
        if self._claims is None:
            return None
        lapsed = (self._clock() if now is None else now) >= self._claims_until
        return {} if lapsed else self._claims.get(key_id, {})

    def expired(self, expires: float | None) -> bool:
        return expires is not None and self._wall() >= expires

    def admit(self, key_id: str, model: str, limits: Limits, gateways: int = 1) -> Ticket:
        """A ticket for one request of `key_id`, or OverLimit. Release the
        ticket when the request ends, however it ends."""
        return self._admit(key_id, model, limits, gateways, asked=True)

    async def admit_or_wait(self, key_id: str, model: str, limits: Limits,
                            gateways: int = 1) -> Ticket:
        """`admit`, except that a request refused on this gateway's claim
        below the key's limit (`OverLimit.short`) first waits for the claims
        loop to raise it: up to `claim_wait` seconds, checked again after
        each of the loop's steps; OverLimit if still refused then. Also
        while the claims have lapsed: the lease may be proven by the next
        step (a gateway just started has none yet)."""
        try:
            return self._admit(key_id, model, limits, gateways, asked=True)
        except OverLimit as over:
            if not over.short or self.settle is None or self._claims is None:
                raise
            first = over
        return await self._wait(first, key_id, lambda: self._admit(
            key_id, model, limits, gateways, asked=False))

    async def reserve_external(self, key_id: str, limit: int | None, gateways: int,
                               model: str, target: str, tokens: int) -> int:
        """`external.reserve` for a spill of an admitted request, waiting as
        `admit_or_wait` does when refused on this gateway's claim below the
        key's budget (budget.py)."""
        try:
            return self.external.reserve(key_id, limit, gateways, model, target, tokens)
        except OverLimit as over:
            if not over.short or self.settle is None or self._claims is None:
                raise
            first = over
        return await self._wait(first, key_id, lambda: self.external.reserve(
            key_id, limit, gateways, model, target, tokens))

    def _floor(self, now: float | None = None) -> int:
        """What this gateway admits of a key on no claim (at `now`, by default
        the clock's): `floor` while its claims stand, `lapsed_floor` once
        they have lapsed."""
        at = self._clock() if now is None else now
        return self.floor if at < self._claims_until else self.lapsed_floor

    async def _wait(self, over: OverLimit, key_id: str, retry: Callable[[], _T]) -> _T:
        """`retry()` after each of the claims loop's steps, up to
        `claim_wait` seconds, while it is refused below the key's limit."""
        loop = asyncio.get_running_loop()
        end = loop.time() + self.claim_wait
        st = self._keys.setdefault(key_id, _KeyState())  # kept while one waits (idle())
        kinds = (over.limit, *over.also)
        st.wait_on(kinds, 1)
        try:
            while (left := end - loop.time()) > 0 and (settle := self.settle) is not None:
                try:
                    # The step is shared: one waiter's deadline must not
                    # cancel it. (asyncio.timeout, not wait_for, whose 3.11
                    # drops a cancel that comes as the step ends.)
                    async with asyncio.timeout(left):
                        await asyncio.shield(settle())
                except TimeoutError:
                    break
                try:
                    return retry()
                except OverLimit as again:
                    if not again.short:
                        raise
                    st.wait_on(kinds, -1)
                    kinds, over = (again.limit, *again.also), again
                    st.wait_on(kinds, 1)
            raise over
        finally:
            st.wait_on(kinds, -1)

    def _admit(self, key_id: str, model: str, limits: Limits, gateways: int,
               asked: bool) -> Ticket:
        now = self._clock()
        st = self._keys.get(key_id)
        if st is None:
            st = self._keys[key_id] = _KeyState()
        st.prune(now, self._window)
        # A key without limits has NO_LIMITS itself (the publisher's grants):
        # no comparison of two dataclasses a request.
        st.limited = limits is not NO_LIMITS and limits != NO_LIMITS
        if st.limited and asked:
            st.asked.append(now)
        try:
            rpm, tpm = self._check(key_id, st, limits, gateways, now)
        except OverLimit as over:
            for kind in (over.limit, *over.also):
                st.refused[kind] = now
            if over.short and self.on_short is not None:
                self.on_short()  # a claim below the limit: the loop may raise it now
            raise
        if rpm is not None:  # unlimited keys keep no timestamps
            st.requests.append(now)
        st.inflight += 1
        return Ticket(self, key_id, model, st, charge_tokens=tpm is not None)

    def _check(self, key_id: str, st: _KeyState, limits: Limits, gateways: int,
               now: float) -> tuple[int | None, int | None]:
        """OverLimit if a request now would pass one of this gateway's parts
        of the limits; else its parts of requests and tokens per minute."""
        if self._claims is None:
            of = f"{{}} on each of {gateways} gateways" if gateways > 1 else "{} on this gateway"
        else:
            of = "{} held by this gateway now"
        claims = self.claims_of(key_id, now) or {}
        floor = self._floor(now)

        def part(kind: str, limit: int | None) -> int | None:
            # Alone, L + N - 1 is L: the whole limit, with no claim to wait for.
            if limit is None or self._claims is None or gateways <= 1:
                return share(limit, gateways)
            return min(limit, share_of(claims.get(kind), floor))

        def retry(limit: int | None, got: int, after: float) -> float:
            # Below the key's limit, a claim may be raised within a second.
            return _CONCURRENCY_RETRY if got < (limit or 0) else after

        over: list[OverLimit] = []
        rpm = part(KINDS[0], limits.requests_per_minute)
        if rpm is not None and len(st.requests) >= rpm:
            over.append(OverLimit("requests", (
                f"Rate limit reached for requests per minute (RPM) on this key: limit "
                f"{limits.requests_per_minute}, {of.format(rpm)}. Please try again later."),
                # An empty window refused: a worker's part of 0 (no floor).
                retry(limits.requests_per_minute, rpm, st.requests[0] + self._window - now
                      if st.requests else _CONCURRENCY_RETRY),
                KINDS[0], rpm < (limits.requests_per_minute or 0)))
        tpm = part(KINDS[1], limits.tokens_per_minute)
        if tpm is not None and st.token_sum >= tpm:
            over.append(OverLimit("tokens", (
                f"Rate limit reached for tokens per minute (TPM) on this key: limit "
                f"{limits.tokens_per_minute}, {of.format(tpm)}, used {st.token_sum} "
                "here. Please try again later."),
                retry(limits.tokens_per_minute, tpm, self._tokens_free_at(st, tpm) - now),
                KINDS[1], tpm < (limits.tokens_per_minute or 0)))
        conc = part(KINDS[2], limits.concurrent_requests)
        if conc is not None and st.inflight >= conc:
            over.append(OverLimit("requests", (
                f"Too many concurrent requests on this key: limit "
                f"{limits.concurrent_requests}, {of.format(conc)}. Please try again "
                "when one has finished."), _CONCURRENCY_RETRY, KINDS[2],
                conc < (limits.concurrent_requests or 0)))
        if over:
            # One at the key's limit here is the refusal (no raise helps);
            # else every limit refused on below it is raised by one step.
            first = next((o for o in over if not o.short), over[0])
            first.also = tuple(o.limit for o in over if o.short and o is not first)
            raise first
        return rpm, tpm

    def set_claims(self, claims: Mapping[str, Mapping[str, int]],
                   until: float = float("inf")) -> None:
        """This gateway's claims by key id and limit name (app/gateway/key_shares.py),
        standing until `until` (this limiter's clock); a key or limit left
        out is claimed 0 (this gateway admits FLOOR)."""
        self._claims = {k: dict(v) for k, v in claims.items()}
        self._claims_until = until

    def key_loads(self) -> dict[str, KeyLoad]:
        """What this gateway holds of each key with limits, and was asked lately."""
        now = self._clock()
        out = self.external.loads()
        for key_id, st in list(self._keys.items()):
            st.prune(now, self._window)
            if st.idle():
                del self._keys[key_id]
            elif st.limited:
                used = (len(st.requests), st.token_sum, st.inflight)
                ext = out.get(key_id) or KeyLoad({})
                out[key_id] = KeyLoad({**ext.used, **dict(zip(KINDS[:3], used, strict=True))},
                                      len(st.asked), ext.refused | frozenset(
                                          k for k, at in st.refused.items()
                                          if at > now - DEMAND_WINDOW),
                                      {**ext.waiting, **st.waiting})
        return out

    def _tokens_free_at(self, st: _KeyState, tpm: int) -> float:
        """When enough charged tokens leave the window to bring it under `tpm`."""
        left = st.token_sum
        for at, tokens in st.tokens:
            left -= tokens
            if left < tpm:
                return at + self._window
        return self._clock()

    def _finish(self, ticket: Ticket) -> None:
        st, m = ticket.state, ticket.meter
        st.inflight -= 1
        # A stream from an engine that reports no usage, whole to its
        # [DONE]: one token an event but the framing ones (llama-cpp-python
        # sends a role-only event first in a chat, and a last one with the
        # finish reason and no text); its prompt is counted by the engine
        # once this ends, and added then (`add_prompt`).
        ticket.prompt_later = (m.count_at is not None and m.ended
                               and not m.noted and m.body is not None)
        if ticket.prompt_later:
            m.completion_tokens = counted_completion(m.events, m.chat)
        estimated = (m.events > 0 and not m.noted and m.body is not None
                     and not ticket.prompt_later)
        if estimated:
            assert m.body is not None
            m.prompt_tokens, m.completion_tokens = estimate_usage(
                m.body, m.events)
        tokens = m.prompt_tokens + m.completion_tokens
        if ticket.charge_tokens and tokens:
            st.tokens.append((self._clock(), tokens))
            st.token_sum += tokens
        if ticket.external:  # its reservation given back, its tokens charged (budget.py)
            self.external.settle(ticket.key_id, ticket.reserved, tokens)
        if st.idle() and self._keys.get(ticket.key_id) is st:
            del self._keys[ticket.key_id]
        counts = self._usage.setdefault((ticket.key_id, ticket.model), [0, 0, 0, 0])
        counts[0] += 1
        counts[1] += m.prompt_tokens
        counts[2] += m.completion_tokens
        counts[3] += estimated

    def add_prompt(self, ticket: Ticket, tokens: int, estimated: bool) -> None:
        """The prompt tokens of a released ticket whose prompt was counted
        after its end (`Ticket.prompt_later`), or estimated when that count
        failed: added to its key's usage and, if it has a token limit, to its
        window, as of now."""
        if ticket.charge_tokens and tokens:
            st = self._keys.get(ticket.key_id)
            if st is None:
                st = self._keys[ticket.key_id] = _KeyState()
            st.prune(self._clock(), self._window)
            st.tokens.append((self._clock(), tokens))
            st.token_sum += tokens
        counts = self._usage.setdefault((ticket.key_id, ticket.model), [0, 0, 0, 0])
        counts[1] += tokens
        counts[3] += estimated

    def inflight(self, key_id: str) -> int:
        st = self._keys.get(key_id)
        return st.inflight if st is not None else 0

    def take_usage(self) -> dict[tuple[str, str], tuple[int, int, int, int]]:
        """Usage counted since the last call, by (key id, model), as
        (requests, prompt tokens, completion tokens, requests whose tokens
        were estimated); the caller writes it."""
        taken, self._usage = self._usage, {}
        return {k: (v[0], v[1], v[2], v[3]) for k, v in taken.items()}


class Ticket:
    """One admitted request: its place in the key's concurrency, released
    once (`release()` is idempotent), and its `meter`, whose usage is
    charged to the key then (`Limiter._finish`)."""

    __slots__ = ("_done", "_limiter", "charge_tokens", "external", "key_id", "meter", "model",
                 "prompt_later", "reserved", "state")

    def __init__(self, limiter: Limiter, key_id: str, model: str, state: _KeyState,
                 charge_tokens: bool) -> None:
        self._limiter = limiter
        self.key_id = key_id
        self.model = model
        self.state = state
        self.charge_tokens = charge_tokens
        self.meter = Meter()
        # Set on release: the prompt is to be counted by the engine, then
        # added (`Limiter.add_prompt`); the meter's prompt_tokens stays 0
        # until then.
        self.prompt_later = False
        # Served by an overflow provider: its tokens go to the key's external
        # budget too (`Limiter.external`).
        self.external = False
        self.reserved = 0  # of the key's external budget, until settled on release
        self._done = False

    def release(self) -> None:
        if not self._done:
            self._done = True
            self._limiter._finish(self)
