"""Where a cell goes on a Ray cluster.

A cell's ranks always share one node (``STRICT_PACK`` in ``World.place``: a cell never spans nodes, so a node's
loss is the loss of whole cells, never of half of one). ``cluster.cell_placement`` decides how cells relate:

- ``spread`` (the default): a new cell keeps off the nodes that hold a cell of its group whenever an alive node
  without one could hold it, so that one lost node costs one cell. The anti-affinity is Ray's own label selector
  (``ray.io/node-id`` with ``!in(...)``) on the placement group; with no such node the request is unconstrained
  (two cells on one node beat none) — and a replacement that finds no room at all waits, pending, for a node
  to join;
- ``pack``: wherever Ray puts it (cells share nodes; fewer nodes, a node's loss costs more).
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Optional

import ray
from ray.util import placement_group_table
from ray.util.placement_group import NODE_ID_LABEL_KEY, PlacementGroup


def alive_nodes() -> Dict[str, dict]:
    """NodeID -> Ray's record of each alive node (``ray.nodes()``: its address and total resources)."""
    return {n["NodeID"]: n for n in ray.nodes() if n.get("Alive")}


def _fits(total: Dict[str, float], bundle: Dict[str, float], count: int) -> bool:
    return all(total.get(key, 0.0) >= amount * count for key, amount in bundle.items())


def spread_selector(occupied: Iterable[str], bundle: Dict[str, float], count: int,
                    required: Optional[Dict[str, str]] = None) -> Optional[List[Dict[str, str]]]:
    """Label selectors (one per bundle) for ``count`` bundles of ``bundle``: the ``required`` labels
    (``cluster.trainer_label_selector``), and off the ``occupied`` nodes when an alive node outside them matches
    and is large enough to hold them all. None: no constraint."""
    required = dict(required or {})
    occupied = sorted(set(occupied))
    free = [n for node_id, n in alive_nodes().items()
            if node_id not in occupied and _fits(n.get("Resources", {}), bundle, count)
            and all(n.get("Labels", {}).get(k) == v for k, v in required.items() if not v.startswith(("!", "in(")))]
    selector = dict(required)
    if occupied and free:
        selector[NODE_ID_LABEL_KEY] = f"!in({','.join(occupied)})"
    return [selector] * count if selector else None


def node_of(pg: PlacementGroup) -> Optional[str]:
    """The NodeID a placed (``STRICT_PACK``) placement group's bundles sit on."""
    nodes = placement_group_table(pg).get("bundles_to_node_id") or {}
    return next(iter(nodes.values()), None)


def node_ip(node_id: Optional[str]) -> Optional[str]:
    """The address Ray knows the node by (its ``--node-ip-address``)."""
    return alive_nodes().get(node_id, {}).get("NodeManagerAddress") if node_id else None
