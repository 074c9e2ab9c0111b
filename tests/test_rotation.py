"""Rotating the shared secret, in-process: the derivations and the plan
(docs/design/security-operations.md, "Rotating the shared secret"). The whole
procedure across real processes is tests/test_rotation_procs.py."""

from __future__ import annotations

import itertools
import re

from app.control import state as s
from app.control.keys import SecretRing, engine_key, secret_id
from app.control.plan.phases import Plan
from app.control.plan.planner import PlanInput, PlanPolicy, plan
from app.wire.tokens import node_token

OLD = "old-secret-0123456789abcdef"
NEW = "new-secret-fedcba9876543210"


def test_a_secret_id_is_short_stable_and_opens_nothing() -> None:
    assert re.fullmatch(r"[0-9a-f]{8}", secret_id(OLD))
    assert secret_id(OLD) == secret_id(OLD) != secret_id(NEW)
    # Not a piece of anything derived: neither the secret nor a key nor a token.
    for derived in (OLD, engine_key(OLD, "r1"), node_token(OLD, "n1")):
        assert secret_id(OLD) not in derived


def test_a_replicas_key_derives_from_the_secret_it_was_placed_under() -> None:
    rotating, done = SecretRing(NEW, OLD), SecretRing(NEW)
    # Placed under the old secret (recorded, or before replicas recorded it):
    # its engine keeps the old key while the previous secret is configured.
    for recorded in (secret_id(OLD), ""):
        assert rotating.engine_key("r1", recorded) == engine_key(OLD, "r1")
        assert rotating.key_secret_id(recorded) == secret_id(OLD)
    assert rotating.engine_key("r2", secret_id(NEW)) == engine_key(NEW, "r2")
    # Without a previous secret, everything is of the current one: before a
    # rotation ("" included: an upgrade rolls nothing), and after its end.
    assert done.engine_key("r1", "") == engine_key(NEW, "r1")
    assert done.engine_key("r1", secret_id(OLD)) == engine_key(NEW, "r1")
    assert done.replica_secret_id("") == secret_id(NEW)
    assert sorted(rotating.engine_keys("r1")) == sorted(
        [engine_key(OLD, "r1"), engine_key(NEW, "r1")])


def test_node_tokens_of_the_previous_secret_open_only_while_it_is_configured() -> None:
    rotating, done = SecretRing(NEW, OLD), SecretRing(NEW)
    assert rotating.check_node_token("n1", node_token(NEW, "n1")) == "current"
    assert rotating.check_node_token("n1", node_token(OLD, "n1")) == "previous"
    assert rotating.check_node_token("n2", node_token(OLD, "n1")) is None
    assert done.check_node_token("n1", node_token(OLD, "n1")) is None
    assert rotating.node_tokens("n1") == [node_token(NEW, "n1"), node_token(OLD, "n1")]


def test_replicas_move_to_the_new_secret_only_once_every_gateway_has_it() -> None:
    rotating = SecretRing(NEW, OLD)
    new, old = secret_id(NEW), secret_id(OLD)
    assert rotating.fleet_secret_id([new, new]) == new
    # A gateway still on the old secret, or one too old to say: not yet.
    assert rotating.fleet_secret_id([new, old]) == old
    assert rotating.fleet_secret_id([new, ""]) == old
    # A gateway without a previous secret can only hold replicas to its own.
    assert SecretRing(OLD).fleet_secret_id([new, old]) == old


def _plan(replicas: dict[str, s.Replica], ready: tuple[str, ...], ring: SecretRing,
          gateways: list[str]) -> Plan:
    counter = itertools.count(1)
    nodes = {"n1": s.NodeInfo(name="n1", gpus=[s.GpuInfo(index=i) for i in range(4)],
                              engines=["vllm"])}
    spec = {"model": "org/m", "gpus": 1, "replicas": {"min": 2, "max": 2}}
    models = {"m": s.StoredModel(name="m", **spec)}  # type: ignore[arg-type]
    statuses = {rid: s.ReplicaStatus(id=rid, node="n1", phase="ready") for rid in ready}
    return plan(PlanInput(
            models, nodes, replicas, now=100.0, statuses=statuses,
            secret_id=ring.fleet_secret_id(gateways),
            unrecorded_secret_id=ring.replica_secret_id("")),
            PlanPolicy(drain_seconds=2.0, new_suffix=lambda: f"{next(counter):04d}"))


def test_a_replica_of_the_previous_secret_rolls_new_before_old() -> None:
    ring = SecretRing(NEW, OLD)
    reps = {  # one recorded under the old secret, one placed before records
        "m-a": s.Replica(id="m-a", model="m", node="n1", gpus=[0], weights="org/m",
                         secret=secret_id(OLD)),
        "m-b": s.Replica(id="m-b", model="m", node="n1", gpus=[1], weights="org/m")}
    # A gateway still derives with the old secret: nothing moves.
    assert _plan(reps, ("m-a", "m-b"), ring, [secret_id(NEW), secret_id(OLD)]).empty
    assert _plan(reps, ("m-a", "m-b"), SecretRing(OLD), [secret_id(OLD)]).empty

    everyone = [secret_id(NEW), secret_id(NEW)]
    p = _plan(reps, ("m-a", "m-b"), ring, everyone)
    # Replacements first, under the new secret; the old ones keep serving.
    assert p.drain == [] and [r.secret for r in p.create] == [secret_id(NEW)] * 2
    for r in p.create:
        reps[r.id] = r
    new = tuple(r.id for r in p.create)
    assert _plan(reps, ("m-a", "m-b"), ring, everyone).empty  # still loading
    p = _plan(reps, ("m-a", "m-b", *new), ring, everyone)
    assert sorted(p.drain) == ["m-a", "m-b"] and p.create == []
    # Once the old ones are gone, the fleet is steady on the new secret.
    steady = {rid: r for rid, r in reps.items() if rid in new}
    assert _plan(steady, new, ring, everyone).empty
    assert _plan(steady, new, SecretRing(NEW), everyone).empty
