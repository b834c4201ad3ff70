"""EPLB's pure placement rule and the expert-location file: the balance a rebalance buys, the
invariants every placement keeps, weights that stay where they are, and the file's errors."""

from __future__ import annotations

import json
import random

import pytest

from pdserve.engine.model_executor.expert_location import expert_locations
from pdserve.engine.model_executor.layers.ep_placement import ExpertPlacement, trivial_placement
from pdserve.engine.model_executor.layers.ep_rebalance import (pack, rank_imbalance, rebalance_layer,
                                                               replica_counts)


def check_invariants(p: ExpertPlacement, num_experts: int, ep_size: int, slots: int) -> None:
    assert p.num_physical == slots and p.ep_size == ep_size
    held = [p.experts_of(r) for r in range(ep_size)]
    assert all(len(h) == slots // ep_size for h in held)  # every rank exactly its capacity
    assert set(p.physical_to_logical) == set(range(num_experts))  # every expert >= 1 replica


@pytest.mark.parametrize("seed", range(5))
def test_rebalance_lowers_imbalance_on_skewed_load(seed):
    rng = random.Random(seed)
    experts, redundant, ep = 16, 4, 4
    load = [rng.choice([1, 2, 3]) for _ in range(experts)]
    for hot in rng.sample(range(experts), 2):
        load[hot] = 200
    old = trivial_placement(experts, redundant, ep)
    new = rebalance_layer(load, old)
    check_invariants(new, experts, ep, experts + redundant)
    assert rank_imbalance(new, load) < rank_imbalance(old, load)
    # the two hot experts got the redundant slots, and their replicas sit on distinct ranks
    reps = [sorted(r for r in range(ep) if e in new.experts_of(r)) for e in range(experts)]
    hot = sorted(range(experts), key=lambda e: -load[e])[:2]
    assert sum(len(reps[e]) for e in hot) == 2 + redundant
    assert all(len(set(reps[e])) == len(reps[e]) for e in hot)


def test_replica_counts_and_pack():
    assert replica_counts([10.0, 1.0, 1.0, 1.0], 6) == [3, 1, 1, 1]
    ranks = pack([10.0, 1.0, 1.0, 1.0], [3, 1, 1, 1], 2)
    assert sorted(len(r) for r in ranks) == [3, 3] and all(r.count(0) <= 2 for r in ranks)


def test_a_balanced_placement_moves_no_weight():
    """Rebalancing an already balanced placement keeps every expert in its slot."""
    old = trivial_placement(8, 0, 2)
    new = rebalance_layer([5.0] * 8, old)
    assert rank_imbalance(new, [5.0] * 8) == 1.0
    moved = sum(a != b for a, b in zip(old.physical_to_logical, new.physical_to_logical))
    assert moved == 0


def test_load_of_the_wrong_width_is_refused():
    with pytest.raises(ValueError, match="load has 3 experts"):
        rebalance_layer([1.0, 2.0, 3.0], trivial_placement(8, 0, 2))


def test_location_file_forms_and_errors(tmp_path):
    layers, moe, experts, redundant, ep = 3, [1, 2], 4, 2, 2

    def write(obj) -> str:
        path = tmp_path / "loc.json"
        path.write_text(json.dumps(obj))
        return str(path)

    row = [3, 2, 1, 0, 0, 3]
    got = expert_locations(write({"physical_to_logical_map": [row] * layers}), layers, moe, experts, redundant, ep)
    assert sorted(got) == moe and got[1].physical_to_logical == tuple(row)
    # the trivial placement's extra slots repeat experts 0 and 1: a hot expert 3 takes them instead
    counts = expert_locations(write({"logical_count": [[1, 1, 1, 100]] * layers}), layers, moe, experts,
                              redundant, ep)
    assert counts[2].physical_to_logical.count(3) == 1 + redundant
    # where the trivial placement is already balanced (expert 0 hot: its two replicas on both ranks), it stays
    kept = expert_locations(write({"logical_count": [[100, 1, 1, 1]] * layers}), layers, moe, experts,
                            redundant, ep)
    assert kept[1] == trivial_placement(experts, redundant, ep)
    bad = [
        ({"physical_to_logical_map": [row] * 2}, "list of 3 rows"),
        ({"physical_to_logical_map": [row[:5]] * layers}, "layer 1: a row has 5 slots"),
        ({"physical_to_logical_map": [[0, 0, 0, 0, 0, 0]] * layers}, "layer 1"),
        ({"logical_count": [[1, 2]] * layers}, "4 counts"),
        ({"physical_to_logical_map": [row] * layers, "logical_count": []}, "exactly one of"),
    ]
    for obj, message in bad:
        with pytest.raises(ValueError, match=message):
            expert_locations(write(obj), layers, moe, experts, redundant, ep)
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read it as JSON"):
        expert_locations(str(tmp_path / "broken.json"), layers, moe, experts, redundant, ep)
