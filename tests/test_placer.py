"""`Placer` (app/control/placement/placer.py) places many replicas in one pass and
must pick what a full scan of the fleet picks every time: the node that fits
with the lowest (replicas of the model, replicas, -free GPUs, name)."""

from __future__ import annotations

import random

import pytest

from app.control import state as s
from app.control.placement.placer import Placer, place
from app.control.placement.verdict import Fit, NoFit


def _fleet(rng: random.Random) -> tuple[dict[str, s.NodeInfo], dict[str, s.NodeConf]]:
    nodes = {
        f"n{i:02d}": s.NodeInfo(name=f"n{i:02d}", engines=["vllm"], gpus=[
            s.GpuInfo(index=g, memory_mib=rng.choice([24_000, 80_000]))
            for g in range(rng.choice([1, 2, 4, 8]))])
        for i in range(30)}
    confs = {n: s.NodeConf(cordoned=True) for n in rng.sample(sorted(nodes), 3)}
    return nodes, confs


def _models(rng: random.Random) -> dict[str, s.StoredModel]:
    return {f"m{i}": s.StoredModel.model_validate({
        "name": f"m{i}", "model": f"org/m{i}", "gpus": rng.choice([1, 1, 2]),
        **({"profiles": [{"gpus": 1, "gpu_memory_gib": 40}]} if i % 5 == 0 else {})})
        for i in range(12)}


def _expected(name: str, spec: s.StoredModel, nodes: dict[str, s.NodeInfo],
              replicas: dict[str, s.Replica], confs: dict[str, s.NodeConf]) -> str | None:
    """The full scan, node by node: the oracle."""
    scores = []
    for node, info in nodes.items():
        if isinstance(place(name, spec, {node: info}, replicas, nodeconfs=confs), NoFit):
            continue
        on = [r for r in replicas.values() if r.node == node]
        free = len(info.gpus) - len({g for r in on for g in r.gpus})
        scores.append((sum(r.model == name for r in on), len(on), -free, node))
    return min(scores)[3] if scores else None


@pytest.mark.parametrize("seed", range(5))
def test_a_placer_picks_what_a_full_scan_picks_as_replicas_are_added(seed: int) -> None:
    rng = random.Random(seed)
    nodes, confs = _fleet(rng)
    models = _models(rng)
    replicas: dict[str, s.Replica] = {}
    placer = Placer(nodes, replicas, nodeconfs=confs)
    placed = refused = 0
    for step in range(120):
        name = rng.choice(sorted(models))
        spec = models[name]
        fit = placer.place(name, spec)
        assert fit == place(name, spec, nodes, replicas, nodeconfs=confs)
        want = _expected(name, spec, nodes, replicas, confs)
        if want is None:
            assert isinstance(fit, NoFit) and fit.refusals
            refused += 1
            continue
        assert isinstance(fit, Fit) and fit.node == want, (step, name)
        rep = s.Replica(id=f"r{step}", model=name, node=fit.node, gpus=fit.gpus,
                        weights=spec.model or "")
        replicas[rep.id] = rep
        placer.add(rep)
        placed += 1
    # The run covered both: a fleet filling up, then full for some shapes.
    assert placed > 20 and refused > 0


@pytest.mark.parametrize("seed", range(4))
def test_fits_without_one_replica_answers_what_a_scan_without_it_answers(seed: int) -> None:
    """Once a model fits nowhere, `fits_without` asks one node (the gone
    replica's) instead of the whole fleet: the same answer, quota or not."""
    rng = random.Random(seed)
    nodes, confs = _fleet(rng)
    models = _models(rng)
    for name in rng.sample(sorted(models), 4):
        models[name] = models[name].model_copy(update={"quota": "team"})
    quotas = {"team": s.Quota(max_gpus=rng.choice([6, 12, 40]))}
    replicas: dict[str, s.Replica] = {}
    placer = Placer(nodes, replicas, nodeconfs=confs, quotas=quotas, models=models)
    answers: list[bool] = []
    for step in range(300):
        name = rng.choice(sorted(models))
        spec = models[name]
        fit = placer.place(name, spec)
        if isinstance(fit, NoFit):
            for gone in rng.sample(sorted(replicas), min(8, len(replicas))):
                others = {k: v for k, v in replicas.items() if k != gone}
                scan = place(name, spec, nodes, others, nodeconfs=confs, quotas=quotas,
                             models=models)
                assert placer.fits_without(name, spec, gone) == isinstance(scan, Fit), (
                    step, name, gone)
                answers.append(isinstance(scan, Fit))
            continue
        rep = s.Replica(id=f"r{step}", model=name, node=fit.node, gpus=fit.gpus,
                        weights=spec.model or "")
        replicas[rep.id] = rep
        placer.add(rep)
    # Both answers came up, many times each.
    assert answers.count(True) > 50 and answers.count(False) > 50
