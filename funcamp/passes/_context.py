"""What the passes share: one :class:`PassContext` per graph, the facts a pass fills and a later one reads.

The passes are uniform callables ``pass_(ctx) -> None`` (:data:`funcamp.passes.pipeline.PIPELINE`); each reads
the graph and the fields it needs and writes the ones it finds, as torchtitan's ``apply_graph_passes`` hands its
passes one graph and inductor's ``GraphTransformObserver`` observes each. No pass hands another a local.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch


class PassCount(NamedTuple):
    """The graph's node count around one pass of the pipeline, as it ran."""

    name: str  # the pass's switch name (``FUNCAMP_PASSES_OFF``)
    step: str  # its function (a pass of two steps, ``sharded_gathers``, runs ``select`` and ``regather``)
    before: int
    after: int


@dataclasses.dataclass
class PassContext:
    """The graph the passes change and the facts they share, each field filled by one pass (or at creation).

    Fields:
      graph: the post-grad graph inductor hands the pass; changed in place.
      off: the passes switched off (``FUNCAMP_PASSES_OFF``).
      param_uses: the parameters' forward casts and views that only one region reads, each mapped to that region
        (:func:`funcamp.passes.remat_regions._param_uses`): None until the first pass that reads it
        (``remat_regions`` or ``casts_at_use``, through :func:`funcamp.passes.remat_regions.param_uses`) finds it,
        after ``cse``; finding it tags the casts with their region's budget, which ``remat_budget`` reads.
      recompute: the nodes whose backward uses read a copy; ``remat_regions`` fills it, ``remat_budget`` takes
        out what a budget keeps, ``recompute`` reads it.
      draws: the regions' dropout draws, kept as bools (``remat_regions``; read by ``recompute``).
      gathers: the sharded parameters' forward gathers, recomputed too (``sharded_gathers``; read by ``recompute``).
      counts: one :class:`PassCount` per pass run, in order.
    """

    graph: torch.fx.Graph
    off: frozenset[str]
    param_uses: dict[torch.fx.Node, int] | None = None
    recompute: set[torch.fx.Node] = dataclasses.field(default_factory=set)
    draws: set[torch.fx.Node] = dataclasses.field(default_factory=set)
    gathers: set[torch.fx.Node] = dataclasses.field(default_factory=set)
    counts: list[PassCount] = dataclasses.field(default_factory=list)
