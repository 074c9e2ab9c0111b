"""Each gateway's claims on a client key's limits (app/router/shares.py, the
pure decisions; app/gateway/key_shares.py, the loop), in-process: three limiters,
three mirrors of one embedded store, one injected clock, the loop's steps
driven by hand. The cross-process checks are in tests/test_key_shares_procs.py."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from app.control import state as s
from app.control.mirror import Mirror
from app.gateway.key_shares import SERIAL, KeyShares
from app.router.entries import Limits
from app.router.limits import Limiter, OverLimit, Ticket
from app.router.shares import next_claim, split, targets
from app.store.embedded import EmbeddedStore
from tests.support.proxy_rig import FakeClock

GWS = ("gw0", "gw1", "gw2")
HOLD = 8.0  # seconds a vanished record's part stays held (the gateways' lease TTL)


def test_split_is_deterministic_proportional_and_sums_to_the_total() -> None:
    rng = random.Random(7)
    for _ in range(500):
        total = rng.randrange(0, 50)
        gws = rng.sample(["a", "b", "c", "d", "e"], rng.randrange(1, 6))
        weights = {g: rng.choice([0, 0, 1, 3, 10]) for g in gws}
        parts = split(total, gws, weights)
        assert sum(parts.values()) == total
        assert parts == split(total, list(reversed(gws)), dict(reversed(weights.items())))
        if any(weights.values()):  # nobody without demand gets any of it
            assert all(parts[g] == 0 for g in gws if weights[g] == 0)
            for g in gws:  # within one of its exact part
                assert abs(parts[g] - total * weights[g] / sum(weights.values())) < 1
    assert split(12, GWS, {}) == {"gw0": 4, "gw1": 4, "gw2": 4}
    assert split(4, GWS, {}) == {"gw0": 2, "gw1": 1, "gw2": 1}


def test_targets_keep_what_each_holds_and_give_the_rest_to_demand() -> None:
    # All on gw0: it gets the whole limit.
    assert targets(12, GWS, {"gw0": 4}, {"gw0": 9}) == {"gw0": 12, "gw1": 0, "gw2": 0}
    # The client moved to gw1: gw0 keeps its window, gw1 gets what is left.
    assert targets(12, GWS, {"gw0": 10, "gw1": 1}, {"gw1": 5}) == {
        "gw0": 10, "gw1": 2, "gw2": 0}
    # Over the limit (floors): nobody is given more.
    assert targets(4, GWS, {"gw0": 4, "gw1": 1}, {"gw1": 3}) == {"gw0": 4, "gw1": 1, "gw2": 0}
    # A claim is raised only into room and on a refusal, lowered only for
    # another's refusal and never below what is held.
    assert next_claim(4, 12, 4, 10, refused_here=True, refused_elsewhere=False) == 10
    assert next_claim(4, 12, 4, 10, refused_here=False, refused_elsewhere=False) == 4
    assert next_claim(4, 12, 4, 2, refused_here=True, refused_elsewhere=False) == 4
    assert next_claim(12, 2, 7, 0, refused_here=False, refused_elsewhere=True) == 7
    assert next_claim(12, 2, 7, 0, refused_here=False, refused_elsewhere=False) == 12


class Fleet:
    """Three gateways' limiters and claim loops over one store."""

    def __init__(self, store: EmbeddedStore, mirrors: list[Mirror], clock: FakeClock,
                 lease: int) -> None:
        self.store = store
        self.mirrors = mirrors
        self.clock = clock
        self.limiters = [Limiter(clock=clock, wall=clock) for _ in GWS]
        # Until when each gateway can prove its lease (Elector.proven_until).
        self.until = [float("inf") for _ in GWS]
        self.loops = [KeyShares(store, m, lim, gw, lambda: lease, refresh=0.5, clock=clock,
                                until=lambda i=i: self.until[i], hold=HOLD, monotonic=clock)
                      for i, (m, lim, gw) in enumerate(zip(mirrors, self.limiters, GWS,
                                                           strict=True))]
        for loop in self.loops:
            loop.start()

    async def caught_up(self) -> None:
        head = (await self.store.range(SERIAL)).revision
        for m in self.mirrors:
            assert await m.wait_for(head, 2)

    async def steps(self, rounds: int = 2) -> None:
        """Each loop steps in turn, the mirrors catching up between, as the
        loops do over a real store (milliseconds apart)."""
        for _ in range(rounds):
            for loop in self.loops:
                await loop.step()
                await self.caught_up()

    def ask(self, gw: int, limits: Limits) -> Ticket | None:
        try:
            return self.limiters[gw].admit("k1", "m", limits, len(GWS))  # three live
        except OverLimit:
            return None

    def claims(self, kind: str) -> list[int]:
        return [loop.claims.get("k1", {}).get(kind, 0) for loop in self.loops]


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[Fleet]:
    store = await EmbeddedStore.open(tmp_path / "state.db", expiry_interval=None)
    mirrors = [Mirror(store) for _ in GWS]
    for m in mirrors:
        m.start()
    try:
        lease = await store.grant(30)
        for gw in GWS:
            await store.put(s.GATEWAYS + gw, s.GatewayInfo(
                id=gw, url="http://x", version="t", started=0).model_dump_json().encode())
        await store.put(s.KEYS + "h", s.ClientKey(
            id="k1", name="t", created=0, limits=s.KeyLimits(
                requests_per_minute=12, tokens_per_minute=300,
                concurrent_requests=4)).model_dump_json().encode())
        f = Fleet(store, mirrors, FakeClock(), lease)
        await f.caught_up()
        yield f
    finally:
        for m in mirrors:
            await m.stop()
        await store.close()


RPM = Limits(requests_per_minute=12)
CONC = Limits(concurrent_requests=4)


async def test_a_client_all_on_one_gateway_gets_its_whole_limit_after_one_step(
    fleet: Fleet,
) -> None:
    # Before any claim: the floor, one request (a lone Limiter's ceil(12/3)
    # was 4 here: the third of the limit this replaces).
    got = sum(1 for _ in range(12) if (t := fleet.ask(0, RPM)) and (t.release() or True))
    assert got == 1
    await fleet.steps(1)
    got += sum(1 for _ in range(12) if (t := fleet.ask(0, RPM)) and (t.release() or True))
    assert got == 12
    assert fleet.claims("requests_per_minute") == [12, 0, 0]
    # Concurrency the same way: 4 held at once on one gateway.
    held = [t for _ in range(4) if (t := fleet.ask(0, CONC)) is not None]
    assert len(held) == 1
    await fleet.steps(1)
    held += [t for _ in range(4) if (t := fleet.ask(0, CONC)) is not None]
    assert len(held) == 4
    # The other gateways still admit their floor: L + N - 1 at most in all.
    extra = [fleet.ask(1, CONC), fleet.ask(2, CONC), fleet.ask(1, CONC)]
    assert [t is not None for t in extra] == [True, True, False]


async def test_claims_never_sum_past_the_limit_and_admissions_stay_within_l_plus_n_minus_1(
    fleet: Fleet,
) -> None:
    """Random interleavings of requests, ends and steps (two gateways stepping
    on the same stale snapshot included): at every moment the gateways'
    claims sum to at most the limit, and what they hold to at most L + N - 1."""
    rng = random.Random(3)
    limits = Limits(requests_per_minute=12, concurrent_requests=4)
    held: list[list[Ticket]] = [[], [], []]
    hot = 0  # where most of the traffic goes: moves now and then
    for i in range(400):
        r = rng.random()
        if r < 0.05:
            hot = rng.randrange(3)
        if r < 0.55:
            gw = hot if rng.random() < 0.8 else rng.randrange(3)
            if (t := fleet.ask(gw, limits)) is not None:
                held[gw].append(t)
        elif r < 0.75:
            gw = rng.randrange(3)
            if held[gw]:
                held[gw].pop(rng.randrange(len(held[gw]))).release()
        elif r < 0.85:  # a step on a snapshot that may miss the others' last writes
            await fleet.loops[rng.randrange(3)].step()
        else:
            await fleet.caught_up()
            await fleet.loops[rng.randrange(3)].step()
        fleet.clock.now += rng.random() * 0.5
        inflight = sum(len(h) for h in held)
        window = sum(len(lim._keys["k1"].requests) for lim in fleet.limiters
                     if "k1" in lim._keys)
        assert inflight <= 4 + 3 - 1, i
        assert window <= 12 + 3 - 1, i
        for kind, limit in (("requests_per_minute", 12), ("concurrent_requests", 4)):
            assert sum(fleet.claims(kind)) <= limit, (i, kind, fleet.claims(kind))


async def test_a_moved_client_gets_the_claim_as_the_old_gateway_lets_go(fleet: Fleet) -> None:
    held = [t for _ in range(4) if (t := fleet.ask(0, CONC)) is not None]
    await fleet.steps(1)
    held += [t for _ in range(4) if (t := fleet.ask(0, CONC)) is not None]
    assert len(held) == 4 and fleet.claims("concurrent_requests") == [4, 0, 0]
    # The client moves to gw1: its floor, then refusals while gw0's requests run.
    moved = [t for _ in range(4) if (t := fleet.ask(1, CONC)) is not None]
    assert len(moved) == 1
    await fleet.steps()
    assert fleet.claims("concurrent_requests") == [4, 0, 0]  # gw0 holds all 4
    for t in held:
        t.release()
    fleet.clock.now += 6  # gw0's recent demand fades
    for _ in range(3):
        moved += [t for _ in range(4) if (t := fleet.ask(1, CONC)) is not None]
        await fleet.steps()
    moved += [t for _ in range(4) if (t := fleet.ask(1, CONC)) is not None]
    assert len(moved) == 4 and fleet.claims("concurrent_requests")[1] == 4


async def test_a_dead_gateways_claim_returns_with_its_lease(fleet: Fleet) -> None:
    held = [t for _ in range(4) if (t := fleet.ask(0, CONC)) is not None]
    await fleet.steps(1)
    held += [t for _ in range(4) if (t := fleet.ask(0, CONC)) is not None]
    assert fleet.claims("concurrent_requests") == [4, 0, 0]
    # gw0 dies: its record goes with its lease (deleted here as the lease would).
    await fleet.store.delete(s.KEY_SHARES + "gw0")
    await fleet.store.delete(s.GATEWAYS + "gw0")
    fleet.loops = fleet.loops[1:]
    fleet.limiters = fleet.limiters[1:]
    await fleet.caught_up()
    got = [t for _ in range(4) if (t := fleet.ask(0, CONC)) is not None]  # gw1 now
    await fleet.steps(1)
    # Its part stays held for HOLD after its record went: a gateway cut off
    # from the store (not dead) is given that long to write it again.
    got += [t for _ in range(4) if (t := fleet.ask(0, CONC)) is not None]
    assert len(got) == 1 and fleet.claims("concurrent_requests") == [0, 0]
    fleet.clock.now += HOLD
    assert fleet.ask(0, CONC) is None  # refused: the loop raises now
    await fleet.steps(1)
    got += [t for _ in range(4) if (t := fleet.ask(0, CONC)) is not None]
    assert len(got) == 4


async def _all_on_gw0(fleet: Fleet) -> list[Ticket]:
    held = [t for _ in range(4) if (t := fleet.ask(0, CONC)) is not None]
    await fleet.steps(1)
    held += [t for _ in range(4) if (t := fleet.ask(0, CONC)) is not None]
    assert len(held) == 4 and fleet.claims("concurrent_requests") == [4, 0, 0]
    return held


async def test_a_gateway_that_cannot_prove_its_lease_admits_on_no_claim(fleet: Fleet) -> None:
    """Once a gateway cannot prove its lease (the store unreachable past
    its TTL and the others' hold), its record may be gone and its part
    taken: it admits on no claim, before its loop even steps (a gateway
    resumed from a pause serves requests first), and claims again only
    through a refusal and a raise. Seen to fail: claims kept past the
    lease, gw0 admitted a third request on its claim of 4 while gw1 held
    the part gw0's vanished record had left."""
    held = await _all_on_gw0(fleet)
    for t in held[:2]:
        t.release()
    fleet.until[0] = fleet.clock.now + 1  # as of its last renewal
    await fleet.loops[0].step()
    held.append(fleet.ask(0, CONC))  # type: ignore[arg-type]
    assert held[-1] is not None  # its claim stands: 3 held
    fleet.clock.now += 1  # no renewal since: the store unreachable, or a pause
    assert fleet.ask(0, CONC) is None  # holds 3, on no claim: past the floor
    await fleet.loops[0].step()
    assert fleet.claims("concurrent_requests")[0] == 0
    # The lease proven again: the claim comes back through a raise, no more
    # than the others leave.
    fleet.until[0] = float("inf")
    for t in held[2:]:
        t.release()
    fleet.clock.now += 6
    assert fleet.ask(0, CONC) is not None  # the floor
    assert fleet.ask(0, CONC) is None
    await fleet.steps(1)
    assert fleet.ask(0, CONC) is not None
    assert 2 <= fleet.claims("concurrent_requests")[0] <= 4


async def test_vanished_records_keep_their_part_until_their_gateways_write_again(
    fleet: Fleet,
) -> None:
    """etcd back from an outage past the TTL drops every gateway's lease at
    once, and with them every record, gateways alive: the first to write
    again must not take the parts the others still hold and have not yet
    written back. Seen to fail: gw1 raised to the whole limit out of gw0's
    vanished record, 8 streams held at once on a limit of 4 (bound 6);
    the short chaos schedule saw 5 on a limit of 2 (bound 4) this way."""
    held = await _all_on_gw0(fleet)
    for gw in GWS:  # the leases dropped: records and registrations go
        await fleet.store.delete(s.KEY_SHARES + gw)
        await fleet.store.delete(s.GATEWAYS + gw)
    await fleet.caught_up()
    # gw1 writes again first and is asked past its floor: nothing to raise into.
    got = [t for _ in range(4) if (t := fleet.ask(1, CONC)) is not None]
    await fleet.loops[1].step()
    await fleet.caught_up()
    got += [t for _ in range(4) if (t := fleet.ask(1, CONC)) is not None]
    assert len(got) == 1 and fleet.claims("concurrent_requests") == [4, 0, 0]
    # gw0 writes its record again (what it holds, its claim): still nothing,
    # however long after (the held requests are in its record now).
    await fleet.loops[0].step()
    await fleet.caught_up()
    fleet.clock.now += HOLD + 1
    await fleet.steps()
    got += [t for _ in range(4) if (t := fleet.ask(1, CONC)) is not None]
    assert len(got) == 1, fleet.claims("concurrent_requests")
    assert len(held) + len(got) <= 4 + 3 - 1
    # gw0's requests end and its demand fades: the client gets it all on gw1.
    for t in held:
        t.release()
    fleet.clock.now += 6
    for _ in range(3):
        got += [t for _ in range(4) if (t := fleet.ask(1, CONC)) is not None]
        await fleet.steps()
    got += [t for _ in range(4) if (t := fleet.ask(1, CONC)) is not None]
    assert len(got) == 4 and fleet.claims("concurrent_requests")[1] == 4


async def test_two_raises_from_one_snapshot_do_not_both_land(fleet: Fleet) -> None:
    # Both refused, both step before either sees the other's write.
    for gw in (0, 1):
        for _ in range(3):
            fleet.ask(gw, RPM)
    assert await fleet.loops[0].step()
    assert await fleet.loops[1].step()  # wrote, but its raise was refused
    assert sum(fleet.claims("requests_per_minute")) <= 12
    assert fleet.claims("requests_per_minute")[1] == 0
    await fleet.caught_up()
    await fleet.steps()
    assert sum(fleet.claims("requests_per_minute")) <= 12
    assert fleet.claims("requests_per_minute")[1] > 0


def test_a_lone_gateway_admits_the_whole_limit_before_any_claim() -> None:
    """With one gateway the bound L + N - 1 is L: nothing is shared, so a
    key's first burst is not cut to the floor while a claim is raised (an
    all-in-one `llmgw serve` with a limited key)."""
    clock = FakeClock()
    lone = Limiter(clock=clock, wall=clock)
    lone.set_claims({})  # the claim loop has run once: no claims yet
    held = [t for _ in range(5) if (t := _try(lone, CONC, gateways=1)) is not None]
    assert len(held) == 4
    got = sum(1 for _ in range(13) if (t := _try(lone, RPM, gateways=1)) and (t.release() or True))
    assert got == 12
    # With a second gateway live the claims rule again: the floor until raised.
    two = Limiter(clock=clock, wall=clock)
    two.set_claims({})
    assert [t is not None for t in (_try(two, CONC, 2), _try(two, CONC, 2))] == [True, False]


def _try(limiter: Limiter, limits: Limits, gateways: int) -> Ticket | None:
    try:
        return limiter.admit("k1", "m", limits, gateways)
    except OverLimit:
        return None


async def test_the_external_budget_is_claimed_as_the_other_limits_are(fleet: Fleet) -> None:
    """Spill-over's `external_tokens_per_day` (app/router/budget.py) moves
    between gateways through the same claims."""
    rev = await fleet.store.put(s.KEYS + "h", s.ClientKey(
        id="k1", name="t", created=0, limits=s.KeyLimits(
            external_tokens_per_day=100)).model_dump_json().encode())
    for m in fleet.mirrors:
        assert await m.wait_for(rev, 2)
    budget = fleet.limiters[0].external
    budget.check("k1", 100, 3, "m", "x")  # no claim yet: the floor, nothing charged
    ticket = fleet.ask(0, Limits(external_tokens_per_day=100))
    assert ticket is not None
    ticket.external = True
    ticket.note({"prompt_tokens": 5, "completion_tokens": 1})
    ticket.release()
    with pytest.raises(OverLimit) as over:
        budget.check("k1", 100, 3, "m", "x")
    assert over.value.short and over.value.code == "external_budget_exceeded"
    await fleet.steps(1)
    budget.check("k1", 100, 3, "m", "x")  # raised on that refusal: admitted
    claims = fleet.claims("external_tokens_per_day")
    assert claims[0] == 100 and sum(claims) <= 100, claims
    assert fleet.loops[0].written is not None
    assert fleet.loops[0].written.keys["k1"].used["external_tokens_per_day"] == 6
