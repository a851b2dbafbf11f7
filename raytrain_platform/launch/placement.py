"""Keep each tensor-parallel group on one node: TP all-reduces twice per block, forward
and backward, and needs a node's fast links (NVLink, shared memory), never the network.

A TP group is ``tp_size`` consecutive ranks (parallel/dims.py), and Ray Train numbers
the workers node by node (its ``_sort_workers_by_gpu_id_grouped_by_node``). So a group
stays inside a node exactly when every node runs a multiple of ``tp_size`` workers.
Ray's own strategies do not promise that (PACK fills a node's free CPUs and puts the
rest elsewhere: 4 workers on two 3-CPU nodes land 3 + 1). `place_tp_groups` decides
how many whole groups each node takes and pins every worker's placement-group bundle
there with the node-id label every Ray node carries (``ScalingConfig.label_selector``
becomes the placement group's ``bundle_label_selector``).

Pure: no Ray here; launch/resources.py reads the cluster and passes the numbers in.

>>> selectors = place_tp_groups({"a": {"CPU": 3.0}, "b": {"CPU": 3.0}}, {"CPU": 1.0},
...                             num_workers=4, tp_size=2)
>>> selectors
[{'ray.io/node-id': 'a'}, {'ray.io/node-id': 'a'}, {'ray.io/node-id': 'b'}, {'ray.io/node-id': 'b'}]
>>> describe_tp_placement(selectors, tp_size=2)
'placement: 2 tensor-parallel groups of 2 workers, each group on one node: 1 on node a, 1 on node b'
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Mapping

__all__ = ["NODE_ID_LABEL", "describe_tp_placement", "place_tp_groups"]

# ray._raylet.RAY_NODE_ID_KEY: a label Ray gives every node (`ray start` ones included),
# spelled out here so that this module does not import Ray.
NODE_ID_LABEL = "ray.io/node-id"


def _room(available: Mapping[str, float], demand: Mapping[str, float]) -> int:
    """How many workers of `demand` fit in `available` (a node's free resources)."""
    # 1e-6: Ray counts resources in units of 1e-4; 0.75 / 0.25 must be 3, not 2.9999.
    return min((int(available.get(key, 0.0) / need + 1e-6) for key, need in demand.items() if need > 0),
               default=0)


def _assign(group_slots: dict[str, int], groups: int, spread: bool) -> list[str]:
    """The node of each group: the nodes with the most room first, filled (PACK: fewest
    nodes) or dealt one group at a time (SPREAD). Needs sum(group_slots) >= groups."""
    left = dict(group_slots)
    nodes = sorted(left, key=lambda node: (-left[node], node))
    order: list[str] = []
    while len(order) < groups:
        for node in nodes:
            take = min(left[node], groups - len(order), 1 if spread else groups)
            order += [node] * take
            left[node] -= take
    return order


def place_tp_groups(available: Mapping[str, Mapping[str, float]], demand: Mapping[str, float], *,
                    num_workers: int, tp_size: int, strategy: str = "PACK") -> list[dict[str, str]] | None:
    """One label selector per worker (``{"ray.io/node-id": node}``) that puts whole TP
    groups on nodes, or None: when `tp_size` is 1, when at most one node has room for a
    worker (Ray keeps them together anyway), under STRICT_PACK (one node by definition),
    and, with a warning naming the numbers, when the nodes' free resources cannot take
    every group whole (or under STRICT_SPREAD, which puts each worker on its own node).

    `available`: node id -> its free resources now; `demand`: one worker's resources.

    A warning rather than an error: a TP group across nodes is slow but correct, and the
    free resources are a snapshot (a busy node frees up, an autoscaler adds nodes), so
    the run is left to Ray's placement and the in-worker check (launch/worker.py) warns
    again if a group does span nodes.

    >>> free = {"a": {"CPU": 4.0}, "b": {"CPU": 8.0}, "c": {"CPU": 4.0}}
    >>> [s[NODE_ID_LABEL] for s in place_tp_groups(free, {"CPU": 1.0}, num_workers=12, tp_size=4)]
    ['b', 'b', 'b', 'b', 'b', 'b', 'b', 'b', 'a', 'a', 'a', 'a']
    """
    if tp_size <= 1 or strategy == "STRICT_PACK":
        return None
    rooms = {node: r for node, res in available.items() if (r := _room(res, demand)) > 0}
    if len(rooms) <= 1:
        return None
    groups = num_workers // tp_size
    if strategy == "STRICT_SPREAD":
        warnings.warn(f"scaling.placement_strategy STRICT_SPREAD puts each of the {num_workers} workers "
                      f"on its own node: every tensor-parallel group of {tp_size} spans {tp_size} nodes "
                      "and all-reduces over the network (slow); use PACK or SPREAD to keep TP in a node",
                      stacklevel=2)
        return None
    group_slots = {node: room // tp_size for node, room in rooms.items()}
    if sum(group_slots.values()) < groups:
        held = " and ".join(str(room) for room in sorted(rooms.values(), reverse=True))
        warnings.warn(f"cannot keep each tensor-parallel group on one node: {groups} group(s) of "
                      f"parallel.tp_size = {tp_size} workers ({dict(demand)} each) must each fit on "
                      f"one node, and the {len(rooms)} nodes with free resources have room for {held} "
                      f"workers: {sum(group_slots.values())} whole group(s). Ray places the workers "
                      "itself, so a group may span nodes and all-reduce over the network (slow)",
                      stacklevel=2)
        return None
    order = _assign(group_slots, groups, spread=strategy == "SPREAD")
    return [{NODE_ID_LABEL: node} for node in order for _ in range(tp_size)]


def describe_tp_placement(selectors: list[dict[str, str]], *, tp_size: int) -> str:
    """One line for the user: how many TP groups go to which node (ids cut to 8 characters)."""
    per_node = Counter(s[NODE_ID_LABEL] for s in selectors[::tp_size])
    where = ", ".join(f"{count} on node {node[:8]}" for node, count in per_node.items())
    return (f"placement: {len(selectors) // tp_size} tensor-parallel groups of {tp_size} workers, "
            f"each group on one node: {where}")
