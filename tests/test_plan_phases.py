"""The phases of a reconcile pass (app/control/plan/phases.py, placing.py),
each tested by calling it; tests/test_placement.py tests the whole pass."""

from __future__ import annotations

from app.control import state as s
from app.control.plan.phases import (
    Mine,
    Owned,
    Plan,
    Sweep,
    Trimmed,
    placing_order,
    sort_out,
    sweep,
    trim,
)
from app.control.plan.placing import Fitting, Fleet, Placing, place_missing


def gpu_node(name: str, gpus: int) -> s.NodeInfo:
    return s.NodeInfo(name=name, gpus=[s.GpuInfo(index=i) for i in range(gpus)],
                      engines=["vllm"])


def model(name: str, **kw: object) -> s.StoredModel:
    return s.StoredModel(name=name, **{"model": f"org/{name}", **kw})  # type: ignore[arg-type]


def rep(rid: str, node: str = "n1", model: str = "m", gpu: int = 0,
        weights: str = "", draining_since: float | None = None) -> s.Replica:
    return s.Replica(id=rid, model=model, node=node, gpus=[gpu],
                     weights=weights or f"org/{model}", draining_since=draining_since)


def test_sweep_deletes_a_gone_node_s_replicas_past_grace_and_the_drains_that_are_over() -> None:
    replicas = {
        "kept": rep("kept", node="away"),        # absent 30 s of 60: kept, counted
        "gone": rep("gone", node="lost"),        # absent 60 s: deleted, not counted
        "idle": rep("idle", draining_since=99.0),  # nothing in flight: over
        "busy": rep("busy", gpu=1, draining_since=99.0),  # one in flight: not yet
        "capped": rep("capped", gpu=2, draining_since=90.0),  # past the cap, whatever
        "unheard": rep("unheard", gpu=3, draining_since=99.0),  # no count: waits for the cap
    }
    swept = sweep(replicas, {"n1": gpu_node("n1", 4)}, Sweep(
        absent_for={"away": 30.0, "lost": 60.0}, node_grace=60.0,
        inflight={"idle": 0, "busy": 1, "capped": 3}, now=100.0, drain_seconds=10.0))
    assert swept.delete == ["gone", "idle", "capped"]
    # A finished drain is deleted but its GPUs stay counted for this pass.
    assert sorted(swept.live) == ["busy", "capped", "idle", "kept", "unheard"]


def test_ready_means_reported_ready_on_a_node_heard_from() -> None:
    live = {"a": rep("a"), "b": rep("b", gpu=1), "c": rep("c", node="away"), "d": rep("d")}
    statuses = {"a": s.ReplicaStatus(id="a", node="n1", phase="ready"),
                "b": s.ReplicaStatus(id="b", node="n1", phase="starting"),
                "c": s.ReplicaStatus(id="c", node="away", phase="ready")}
    swept = sweep(live, {"n1": gpu_node("n1", 2)}, Sweep(
        absent_for={}, node_grace=60.0, inflight={}, now=0.0, drain_seconds=10.0,
        statuses=statuses))
    assert swept.ready == {"a"} and sorted(swept.live) == ["a", "b", "c", "d"]


def test_orphans_are_the_replicas_of_a_deleted_or_external_model_not_yet_draining() -> None:
    live = {"z": rep("z", model="deleted"), "x": rep("x", model="ext"),
            "m": rep("m"), "d": rep("d", model="deleted", draining_since=1.0)}
    models = {"m": model("m"), "ext": s.StoredModel(name="ext")}
    swept = sweep(live, {"n1": gpu_node("n1", 4)}, Sweep(
        absent_for={}, node_grace=60.0, inflight={}, now=2.0, drain_seconds=10.0,
        models=models))
    assert swept.orphans == ["x", "z"]
    # Each model's replicas, draining ones included, in the order given.
    assert swept.by_model == {"deleted": ["z", "d"], "ext": ["x"], "m": ["m"]}


def test_models_are_placed_by_their_first_profile_s_priority_then_name_external_ones_not() -> None:
    models = {
        "b": model("b"), "a": model("a"), "ext": s.StoredModel(name="ext"),
        "hi": model("hi", profiles=[{"priority": 10}, {"name": "low", "priority": 0}]),
        "mid": model("mid", profiles=[{"priority": 0}, {"name": "x", "priority": 50}]),
    }
    assert [name for name, _ in placing_order(models)] == ["hi", "a", "b", "mid"]


def test_sort_out_splits_current_from_stale_ready_then_busiest_first() -> None:
    live = {
        "idle": rep("idle"), "busy": rep("busy", gpu=1), "unknown": rep("unknown", gpu=2),
        "starting": rep("starting", gpu=3), "old": rep("old", weights="org/old"),
        "moving": rep("moving", node="n2"), "dying": rep("dying", node="n3"),
        "rotated": s.Replica(id="rotated", model="m", node="n1", gpus=[4], weights="org/m",
                             secret="s0"),
        "leaving": rep("leaving", gpu=5, draining_since=1.0),  # neither: already going
    }
    mine = sort_out(model("m"), list(live), Owned(
        live, ready={"idle", "busy", "unknown", "old", "moving", "dying", "rotated", "leaving"},
        loads={"idle": 0.0, "busy": 7.0}, nodeconfs={"n2": s.NodeConf(draining=True)},
        failed={"dying"}, secret_id="", unrecorded_secret_id=""))
    # A load not known counts as the busiest; one not ready serves nothing.
    assert mine.current == ["unknown", "busy", "idle", "starting"]
    assert mine.stale == ["dying", "moving", "old", "rotated"]
    assert mine.avoid == {"n3"}
    # A replica recording no secret is of the one `unrecorded_secret_id` names.
    assert sort_out(model("m"), ["idle"], Owned(
        live, ready=(), loads={}, nodeconfs={}, failed=(), secret_id="s1",
        unrecorded_secret_id="s1")).current == ["idle"]


def test_trim_drains_the_surplus_and_keeps_ready_old_replicas_for_new_ones_not_ready() -> None:
    mine = Mine(current=["c1", "c2", "c3"], stale=["s1", "s2", "s3"], avoid=set())
    # Two wanted: the third current drains; c2 is not ready, so one ready
    # stale replica (s1, s3 is ready too but one is enough) stands in.
    kept = trim(mine, 2, ready={"c1", "s1", "s3"})
    assert (kept.current, kept.keep, kept.drain) == (["c1", "c2"], ["s1"], ["c3", "s2", "s3"])
    # Four wanted, one more than there is, the three ready: one stand-in,
    # for the replica still to be placed.
    kept = trim(mine, 4, ready={"c1", "c2", "c3", "s2", "s3"})
    assert (kept.current, kept.keep, kept.drain) == (["c1", "c2", "c3"], ["s2"], ["s1", "s3"])


def fleet(nodes: list[s.NodeInfo], live: dict[str, s.Replica],
          models: dict[str, s.StoredModel]) -> Fleet:
    fitting = Fitting(nodeconfs={}, quotas={}, models=models)
    by_name = {n.name: n for n in nodes}
    return Fleet(models, by_name, live, fitting.placer(by_name, live), fitting, 100.0)


def test_place_missing_places_away_from_failed_nodes_and_counts_each_placed_replica() -> None:
    spec = model("m", replicas={"min": 3, "max": 3})
    f = fleet([gpu_node("n1", 2), gpu_node("n2", 1)], {"r1": rep("r1")}, {"m": spec})
    out = Plan()
    suffix = iter(["a", "b", "c"])
    place_missing(out, f, Placing("m", spec, 3, Trimmed(current=[], keep=[], drain=[]), {"n1"},
                                  ()), new_suffix=lambda: next(suffix), secret_id="s1")
    # n2 first (away from n1), then n1 beside its failed replica, whose GPU
    # stays held; a third finds no room and says why.
    assert [(r.id, r.node, r.gpus, r.secret) for r in out.create] == [
        ("m-a", "n2", [0], "s1"), ("m-b", "n1", [1], "s1")]
    assert set(f.live) == {"r1", "m-a", "m-b"}
    assert out.unplaced == {
        "m": "n1: needs 1 free GPUs, has 0 of 2; n2: needs 1 free GPUs, has 0 of 1"}


def test_a_spec_put_back_as_show_printed_it_keeps_its_replicas_current() -> None:
    """`model show` then `model put` (the all-in-one's llama.cpp model, a
    profile with vLLM's own fields): the spec read back from show's YAML
    holds each replica placed from it current (no rollout)."""
    import yaml

    from app.control import catalog
    for given in ({"model": "/w/SmolLM2.gguf", "aliases": ["small"], "engine": "llamacpp"},
                  {"model": "org/m", "revision": "0123", "profiles": [
                      {"name": "a", "gpu_memory_utilization": 0.9, "max_model_len": 4096,
                       "engine_args": ["--max_num_seqs=8"]}]}):
        stored = s.StoredModel.model_validate_json(catalog.stored_value(
            "m", 1.0, s.ModelSpec.model_validate(given)))
        prof = stored.profile_list[0]
        assert stored.model is not None
        rep = s.Replica(id="m-1", model="m", node="n", gpus=[0] * prof.gpu_count,
                        engine=prof.engine, weights=stored.model,
                        weights_revision=stored.revision, profile=prof.name,
                        engine_args=prof.engine_flags, secret="k")
        shown = yaml.safe_dump(stored.spec_dump(), sort_keys=False, allow_unicode=True)
        back = s.StoredModel.model_validate_json(catalog.stored_value(
            "m", 1.0, s.ModelSpec.model_validate(yaml.safe_load(shown))))
        mine = sort_out(back, ["m-1"], Owned({"m-1": rep}, ready={"m-1"}, loads={},
                                             nodeconfs={}, failed=set(), secret_id="k",
                                             unrecorded_secret_id="k"))
        assert (mine.current, mine.stale) == (["m-1"], []), given
