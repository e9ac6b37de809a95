"""The inductor graph pass of the compiled train step: the sub-passes in order, each switchable for debugging.

``make_train_step`` installs :class:`RematPass` as inductor's ``post_grad_custom_pre_pass``. It runs, in order
(:data:`NAMES`): ``remat_regions`` (what the checkpointed regions recompute), ``remat_budget`` (what a memory
budget keeps of it), ``sharded_gathers`` (the sharded parameters' gathers, recomputed too), then one
:class:`funcamp.passes.recompute._Recompute` that makes the copies, then the rest of ``sharded_gathers`` (unused
gathers dropped, the others moved to their user), ``casts_at_use`` and ``late_constructors``. The rules each
keeps are in ``funcamp/passes/README.md``.

Debugging: ``FUNCAMP_PASSES_OFF=name[,name...]`` (read at each compile) skips those sub-passes; with every name,
inductor gets the graph as traced. The values stay bitwise either way; only memory changes.
"""

from __future__ import annotations

import hashlib
import os
import pathlib

import torch

from funcamp.passes import casts_at_use, late_constructors, remat_budget, remat_regions, sharded_gathers, tags
from funcamp.passes.recompute import _Recompute

__all__ = ["NAMES", "RematPass"]

#: The sub-passes, in the order they run: the names ``FUNCAMP_PASSES_OFF`` takes.
NAMES = (remat_regions.NAME, remat_budget.NAME, sharded_gathers.NAME, casts_at_use.NAME, late_constructors.NAME)
_OFF = "FUNCAMP_PASSES_OFF"


def switched_off() -> frozenset[str]:
    """The sub-passes ``FUNCAMP_PASSES_OFF`` names (comma-separated, spaces ignored).

    Raises:
      ValueError: naming an unknown pass and the known ones.
    """
    off = frozenset(n.strip() for n in os.environ.get(_OFF, "").split(",") if n.strip())
    unknown = sorted(off - set(NAMES))
    if unknown:
        raise ValueError(f"{_OFF}: unknown pass {unknown[0]!r}; the passes are {', '.join(NAMES)}")
    return off


try:
    from torch._inductor.custom_graph_pass import CustomGraphPass as _Base
except ImportError:  # older torch: a plain callable
    _Base = object


class RematPass(_Base):  # type: ignore[misc, valid-type]
    """The inductor graph pass that recomputes :func:`funcamp.passes.remat_region` nodes for their backward uses
    and the sharded step's gathers, then moves casts and large constructors to their use (see the module).

    The gathers join the regions' recompute (one :class:`~funcamp.passes.recompute._Recompute`) because a
    region's copy that reads a gathered weight must read the gather's copy, placed and gated with it."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        off = switched_off()
        on = {name: name not in off for name in NAMES}
        uses_wanted = on[remat_regions.NAME] or on[casts_at_use.NAME]
        param_uses = remat_regions._param_uses(graph) if uses_wanted else {}
        recompute = remat_regions._recomputed(graph, param_uses) if on[remat_regions.NAME] else set()
        if on[remat_budget.NAME]:
            recompute -= remat_budget._kept(graph, recompute)
        gathers = sharded_gathers._gathers(graph) if on[sharded_gathers.NAME] else set()
        draws = remat_regions._draws(graph) if on[remat_regions.NAME] else set()
        _Recompute(graph, recompute | gathers, draws).run()
        if on[sharded_gathers.NAME]:
            sharded_gathers._regather(graph)
        if on[casts_at_use.NAME]:
            casts_at_use._casts_at_use(graph, param_uses)
        if on[late_constructors.NAME]:
            late_constructors._late_constructors(graph)

    def uuid(self) -> bytes | None:
        """The pass's identity for inductor's caches: a hash of this package's source and of the sub-passes
        switched off; ``None`` (the step is not cached) once this process has made a region. The caches' keys
        hold the graph's code, not its tags: a step compiled without remat, cached, would be served for the same
        model with remat (no memory saved); nor the budgets (:class:`funcamp.nn.Remat`, tags too): a step of one
        budget would be served for another."""
        if tags._made_regions[0]:
            return None
        digest = hashlib.sha256(",".join(sorted(switched_off())).encode())
        for path in sorted(pathlib.Path(__file__).parent.glob("*.py")):
            digest.update(path.name.encode() + path.read_bytes())
        return digest.digest()
