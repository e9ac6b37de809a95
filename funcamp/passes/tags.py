"""Tags put on nodes while ``torch.compile`` traces the step, read by the passes (no pass: the front end).

- :func:`phase` tags the nodes of the differentiated function's forward (``"forward"``) and of the gradient
  computation around it (``"backward"``), in :mod:`funcamp.grad`;
- :func:`remat_region` tags the nodes of a checkpointed module's forward (``functionalize(remat=...)``), with a
  region id and, where above 0, an activation memory budget (:class:`funcamp.nn.Remat`);
- :func:`gather_region` tags a sharded parameter's all-gather and its casts (:mod:`funcamp._at_use`);
- :func:`flat_gradients` tags the concatenation of a flat state's gradients (:mod:`funcamp.train._flat`).

The tags travel with ``torch.fx.traceback.annotate`` to the graph inductor compiles (``node.meta["custom"]``).
Where torch has no ``annotate`` (before 2.9), or outside a compile, nothing is tagged and the passes do nothing.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import torch

__all__ = ["flat_gradients", "gather_region", "new_region_id", "phase", "remat_region"]


_PHASE, _REMAT, _GATHER = "funcamp_phase", "funcamp_remat", "funcamp_gather"
_FLAT_GRADS = "funcamp_flat_gradients"
_BUDGET = "funcamp_remat_budget"  # a region's activation memory budget (funcamp.nn.Remat), where above 0
_region_ids = itertools.count(1)  # one id per checkpointed module: where one region ends and the next begins
_made_regions = [False]  # whether this process has made one (RematPass.uuid)


def _annotate(tags: dict[str, Any]) -> Any:
    annotate = getattr(torch.fx.traceback, "annotate", None)
    if annotate is None or not torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return annotate(tags)


def phase(name: str) -> Any:
    """A context that tags the nodes traced inside it as ``name`` (``"forward"`` or ``"backward"``)."""
    return _annotate({_PHASE: name})


def new_region_id() -> int:
    """A new region id, for :func:`remat_region`: taken once per checkpointed module, outside tracing."""
    _made_regions[0] = True
    return next(_region_ids)


def remat_region(region: int, budget: float = 0.0) -> Any:
    """A context that tags the nodes traced inside it as recomputable for the backward, in region ``region``.

    ``region`` (from :func:`new_region_id`, a constant of the traced code: a counter advanced while tracing
    would recompile every call) says where one region ends and the next begins. ``budget`` (a constant too,
    :class:`funcamp.nn.Remat`) is the fraction of the region's recomputed activation bytes that may be kept
    instead (:func:`_kept`); tagged only where above 0, so a region of budget 0 is tagged as before.
    """
    return _annotate({_REMAT: region, _BUDGET: budget} if budget > 0 else {_REMAT: region})


def gather_region() -> Any:
    """A context that tags the nodes traced inside it as a parameter gather, re-gathered for the backward."""
    return _annotate({_GATHER: True})


def flat_gradients() -> Any:
    """A context that tags the ``cat`` of a flat state's gradients (:mod:`funcamp.passes.flat_gradients`)."""
    return _annotate({_FLAT_GRADS: True})


def _tags(node: torch.fx.Node) -> dict[str, Any]:
    return node.meta.get("custom") or {}
