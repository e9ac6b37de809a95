"""The inductor graph pass of the compiled train step: a list of named passes run in order over one context.

``make_train_step`` installs :class:`RematPass` as inductor's ``post_grad_custom_pre_pass``. It runs
:data:`PIPELINE`, a list of ``(name, pass)``, each pass a function of one
:class:`~funcamp.passes._context.PassContext` (the graph and the facts the passes fill and read): ``remat_regions``
(what the checkpointed regions recompute), ``remat_budget`` (what a memory budget keeps of it), ``sharded_gathers``
(the sharded parameters' gathers, recomputed too), ``recompute`` (the copies), then the rest of
``sharded_gathers`` (unused gathers dropped, the others moved to their user), ``casts_at_use``,
``scan_stacks`` (a name-major scanned run's stacks read as views of its buffers), ``late_constructors``,
``flat_gradients`` (a flat state's gradients written into their buffer as they are made),
``scalars_once`` (a step's scalars stored once rather than computed in every loop that reads them),
``scan_copies`` (a scan's body reads a tensor, not copies of it in the same layout; the backward reads the forward's
own stacked weights, not saved copies), ``scan_reversal`` (a backward scan reads the forward's stacks from their last
layer, not reversed copies) and
``region_casts`` (a nested compile region handed a widened gradient gets the narrow one and widens it inside).
The loop (:func:`run`) skips the passes switched off and records the graph's node count
around each pass (:class:`~funcamp.passes._context.PassCount`; logged at debug level on the ``funcamp.passes``
logger), as torchtitan's ``apply_graph_passes`` and inductor's ``GraphTransformObserver`` do. The rules each pass
keeps are in ``funcamp/passes/README.md``.

Debugging: ``FUNCAMP_PASSES_OFF=name[,name...]`` (read at each compile) skips those passes; with every name,
inductor gets the graph as traced. The values stay bitwise either way; only memory changes.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pathlib
from collections.abc import Callable

import torch

from funcamp.passes import (
    casts_at_use,
    cse,
    flat_gradients,
    late_constructors,
    recompute,
    region_casts,
    remat_budget,
    remat_regions,
    scalars_once,
    scan_copies,
    scan_reversal,
    scan_stacks,
    sharded_gathers,
    tags,
)
from funcamp.passes._context import PassContext, PassCount

__all__ = ["NAMES", "PIPELINE", "RematPass", "run"]

_LOG = logging.getLogger("funcamp.passes")

#: The passes in the order they run: ``(name, pass)``, ``pass(ctx)`` reading and filling the context. A name is
#: the pass's switch; ``sharded_gathers`` has two steps (it selects before the copies, regathers after them) and
#: ``recompute`` none (it copies what the passes before it chose).
PIPELINE: tuple[tuple[str, Callable[[PassContext], None]], ...] = (
    (cse.NAME, cse.run),
    (remat_regions.NAME, remat_regions.run),
    (remat_budget.NAME, remat_budget.run),
    (sharded_gathers.NAME, sharded_gathers.select),
    (recompute.NAME, recompute.run),
    (sharded_gathers.NAME, sharded_gathers.regather),
    (casts_at_use.NAME, casts_at_use.run),
    (scan_stacks.NAME, scan_stacks.run),
    (late_constructors.NAME, late_constructors.run),
    (flat_gradients.NAME, flat_gradients.run),
    (scalars_once.NAME, scalars_once.run),
    (scan_copies.NAME, scan_copies.run),
    (scan_reversal.NAME, scan_reversal.run),
    (region_casts.NAME, region_casts.run),
)

#: The passes ``FUNCAMP_PASSES_OFF`` takes, in the order they first run.
NAMES = tuple(dict.fromkeys(name for name, _ in PIPELINE if name != recompute.NAME))
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


def context(graph: torch.fx.Graph, off: frozenset[str]) -> PassContext:
    """A new context for ``graph`` (``param_uses`` is found by the first pass that reads it, after ``cse``)."""
    return PassContext(graph, off)


def run(graph: torch.fx.Graph) -> PassContext:
    """Run :data:`PIPELINE` on ``graph`` (in place), skipping the passes switched off; return the context, its
    ``counts`` the node count around each pass run.

    Raises:
      ValueError: ``FUNCAMP_PASSES_OFF`` names an unknown pass.
    """
    ctx = context(graph, switched_off())
    for name, pass_ in PIPELINE:
        if name in ctx.off:
            continue
        before = len(graph.nodes)
        pass_(ctx)
        ctx.counts.append(PassCount(name, pass_.__name__, before, len(graph.nodes)))
        _LOG.debug("%s.%s: %d -> %d nodes", name, pass_.__name__, before, len(graph.nodes))
    return ctx


try:
    from torch._inductor.custom_graph_pass import CustomGraphPass as _Base
except ImportError:  # older torch: a plain callable
    _Base = object


class RematPass(_Base):  # type: ignore[misc, valid-type]
    """The inductor graph pass that recomputes :func:`funcamp.passes.remat_region` nodes for their backward uses
    and the sharded step's gathers, then moves casts and large constructors to their use: :func:`run` of
    :data:`PIPELINE` (see the module).

    The gathers join the regions' recompute (one ``recompute`` step) because a region's copy that reads a
    gathered weight must read the gather's copy, placed and gated with it."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        run(graph)

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
