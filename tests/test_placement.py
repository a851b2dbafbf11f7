"""Placement of tensor-parallel groups on nodes (launch/placement.py): pure, no Ray.
The real multi-node run is tests/test_cluster.py::test_tp_groups_stay_on_one_node."""

import doctest
import random
import warnings
from collections import Counter

import pytest

from raytrain_platform.launch import placement
from raytrain_platform.launch.placement import NODE_ID_LABEL, describe_tp_placement, place_tp_groups

CPU1 = {"CPU": 1.0}


def _nodes(selectors: list[dict]) -> list[str]:
    return [s[NODE_ID_LABEL] for s in selectors]


def _assert_whole_groups(selectors: list[dict], tp_size: int) -> None:
    """Every group of tp_size consecutive bundles on one node, so every node a multiple
    of tp_size workers (what keeps Ray Train's node-grouped ranks whole)."""
    nodes = _nodes(selectors)
    for start in range(0, len(nodes), tp_size):
        assert len(set(nodes[start:start + tp_size])) == 1, nodes
    assert all(count % tp_size == 0 for count in Counter(nodes).values()), nodes


def test_doctests():
    assert doctest.testmod(placement).failed == 0


def test_splits_what_pack_would_split_into_whole_groups():
    """Two 3-CPU nodes, 4 one-CPU workers, tp 2: PACK alone lands 3 + 1; here 2 + 2."""
    got = place_tp_groups({"n1": {"CPU": 3.0}, "n2": {"CPU": 3.0}}, CPU1, num_workers=4, tp_size=2)
    assert _nodes(got) == ["n1", "n1", "n2", "n2"]
    _assert_whole_groups(got, 2)


def test_pack_uses_the_fewest_nodes_largest_first():
    free = {"small": {"CPU": 4.0}, "big": {"CPU": 9.0}, "mid": {"CPU": 4.0}}
    assert _nodes(place_tp_groups(free, CPU1, num_workers=8, tp_size=4)) == ["big"] * 8
    # big holds 2 groups of 4 (9 CPUs), then the next largest; equal room: by node id
    assert _nodes(place_tp_groups(free, CPU1, num_workers=12, tp_size=4)) == ["big"] * 8 + ["mid"] * 4


def test_spread_deals_one_group_per_node_in_turn():
    free = {"a": {"CPU": 8.0}, "b": {"CPU": 4.0}}
    got = place_tp_groups(free, CPU1, num_workers=8, tp_size=2, strategy="SPREAD")
    assert _nodes(got) == ["a", "a", "b", "b", "a", "a", "b", "b"]
    # b is full after two groups: the rest go to a
    got = place_tp_groups(free, CPU1, num_workers=12, tp_size=2, strategy="SPREAD")
    assert Counter(_nodes(got)) == {"a": 8, "b": 4}
    _assert_whole_groups(got, 2)


def test_gpus_limit_the_room():
    free = {"a": {"CPU": 32.0, "GPU": 2.0}, "b": {"CPU": 32.0, "GPU": 4.0}, "cpu-only": {"CPU": 64.0}}
    got = place_tp_groups(free, {"CPU": 1.0, "GPU": 1.0}, num_workers=6, tp_size=2)
    assert Counter(_nodes(got)) == {"b": 4, "a": 2}


def test_fractional_cpus_count_exactly():
    """0.75 free CPU holds three workers of 0.25, not 2.9999 of them."""
    free = {"a": {"CPU": 0.75}, "b": {"CPU": 0.5}}
    got = place_tp_groups(free, {"CPU": 0.25}, num_workers=4, tp_size=2)
    assert Counter(_nodes(got)) == {"a": 2, "b": 2}


@pytest.mark.parametrize("free, tp_size, strategy", [
    ({"a": {"CPU": 3.0}, "b": {"CPU": 3.0}}, 1, "PACK"),  # no TP
    ({"head": {"CPU": 0.0, "memory": 1e9}, "a": {"CPU": 8.0}}, 2, "PACK"),  # one node can take workers
    ({"a": {"CPU": 3.0}, "b": {"CPU": 3.0}}, 2, "STRICT_PACK"),  # one node by definition
])
def test_nothing_to_pin(free, tp_size, strategy, recwarn):
    assert place_tp_groups(free, CPU1, num_workers=4, tp_size=tp_size, strategy=strategy) is None
    assert not recwarn.list


def test_groups_larger_than_any_node_warn_with_the_numbers():
    with pytest.warns(UserWarning) as caught:
        got = place_tp_groups({"a": {"CPU": 3.0}, "b": {"CPU": 3.0}}, CPU1, num_workers=4, tp_size=4)
    assert got is None
    [w] = caught
    message = str(w.message)
    assert "parallel.tp_size = 4" in message and "room for 3 and 3 workers" in message, message
    assert "0 whole group(s)" in message and "1 group(s)" in message, message


def test_too_little_free_room_warns():
    with pytest.warns(UserWarning, match=r"2 group\(s\) .* room for 3 and 1 workers: 1 whole group"):
        assert place_tp_groups({"a": {"CPU": 3.0}, "b": {"CPU": 1.0}}, CPU1, num_workers=4, tp_size=2) is None


def test_strict_spread_warns_that_every_group_spans_nodes():
    with pytest.warns(UserWarning, match="STRICT_SPREAD .* every tensor-parallel group of 2 spans 2 nodes"):
        assert place_tp_groups({"a": {"CPU": 3.0}, "b": {"CPU": 3.0}}, CPU1, num_workers=2, tp_size=2,
                               strategy="STRICT_SPREAD") is None


def test_any_placement_it_returns_is_whole_and_fits():
    """Random clusters: whenever it places, every group is whole, every node within its
    room, every worker placed; it declines, with a warning, exactly when whole groups do
    not fit on two or more nodes with room."""
    rng = random.Random(0)
    placed = declined = 0
    for _ in range(500):
        tp_size = rng.choice([2, 4, 8])
        num_workers = tp_size * rng.randint(1, 6)
        cpus = rng.choice([0.5, 1.0, 2.0])
        free = {f"n{i}": {"CPU": float(rng.randint(0, 20))} for i in range(rng.randint(2, 5))}
        rooms = {node: int(res["CPU"] / cpus) for node, res in free.items()}
        fits = sum(r // tp_size for r in rooms.values()) >= num_workers // tp_size
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = place_tp_groups(free, {"CPU": cpus}, num_workers=num_workers, tp_size=tp_size,
                                  strategy=rng.choice(["PACK", "SPREAD"]))
        several = sum(r > 0 for r in rooms.values()) > 1
        assert bool(caught) == (several and not fits), (free, cpus, num_workers, tp_size, got)
        if got is None:
            declined += 1
            assert not (several and fits), (free, cpus, num_workers, tp_size)
            continue
        placed += 1
        assert len(got) == num_workers
        _assert_whole_groups(got, tp_size)
        assert all(count <= rooms[node] for node, count in Counter(_nodes(got)).items())
    assert placed > 100 and declined > 50, (placed, declined)


def test_describe_says_how_many_groups_go_where():
    selectors = [{NODE_ID_LABEL: node} for node in ["0123456789abcdef"] * 4 + ["fedcba9876543210"] * 2]
    assert describe_tp_placement(selectors, tp_size=2) == (
        "placement: 3 tensor-parallel groups of 2 workers, each group on one node: "
        "2 on node 01234567, 1 on node fedcba98")
