"""A profile's `node_selector` (docs/design/placement.md): placement
refuses a node whose labels (`nodeconf/{node}.labels`) do not hold every
pair, saying which; the selector is checked like labels. Pure functions."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from app.control import state as s
from app.control.placement.placer import Placer, place
from app.control.placement.verdict import Fit, NoFit
from tests.test_placement import gpu_node


def selecting(name: str, **selector: str) -> s.ModelSpec:
    return s.ModelSpec.model_validate({"model": f"org/{name}", "profiles": [
        {"name": "p", "gpus": 1, "node_selector": selector}]})


NODES = {n: gpu_node(n, 2) for n in ("us-1", "eu-1", "bare")}
CONFS = {"us-1": s.NodeConf(labels={"zone": "us", "gpu": "h100"}),
         "eu-1": s.NodeConf(labels={"zone": "eu", "gpu": "h100"})}


def test_a_node_whose_labels_do_not_match_is_refused_with_the_pairs() -> None:
    fit = place("m", selecting("m", zone="eu"), NODES, {}, nodeconfs=CONFS)
    assert fit == Fit("eu-1", [0])
    none = place("m", selecting("m", zone="ap", gpu="h100"), NODES, {}, nodeconfs=CONFS)
    assert isinstance(none, NoFit)
    assert none.texts() == {"us-1": "labels do not match node_selector zone=ap",
                            "eu-1": "labels do not match node_selector zone=ap",
                            "bare": "labels do not match node_selector gpu=h100,zone=ap"}


def test_no_selector_places_anywhere_as_before() -> None:
    spec = s.ModelSpec.model_validate({"model": "org/m", "gpus": 1})
    assert place("m", spec, {"bare": NODES["bare"]}, {}, nodeconfs=CONFS) == Fit("bare", [0])


def test_one_pass_keeps_each_selector_apart() -> None:
    placer = Placer(NODES, {}, nodeconfs=CONFS)
    assert placer.place("a", selecting("a", zone="eu")) == Fit("eu-1", [0])
    assert placer.place("b", selecting("b", zone="us")) == Fit("us-1", [0])


@pytest.mark.parametrize(("selector", "said"), [
    ({"-zone": "eu"}, "label name"),
    ({"zone": "e\nu"}, "printable"),
    ({f"k{i}": "v" for i in range(65)}, "at most 64"),
])
def test_the_selector_is_checked_like_labels(selector: dict[str, str], said: str) -> None:
    with pytest.raises(ValidationError) as exc:
        s.ModelSpec.model_validate({"model": "org/m", "profiles": [
            {"name": "p", "node_selector": selector}]})
    assert said in str(exc.value) and "node_selector" in str(exc.value), str(exc.value)
