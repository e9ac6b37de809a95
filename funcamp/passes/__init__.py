"""Graph passes on the compiled train step: activation checkpointing and gathers at use inside one graph.

While ``torch.compile`` traces the step, :mod:`funcamp.passes.tags` tags nodes (the forward and the backward,
the checkpointed regions, the sharded parameters' gathers); :class:`RematPass`, an inductor
``post_grad_custom_pre_pass`` (:mod:`funcamp.passes.pipeline`), then runs :data:`PIPELINE`, a list of
``(name, pass)`` over one context (:class:`~funcamp.passes._context.PassContext`: the graph and the facts the
passes fill and read), one file each:

- ``remat_regions`` (:mod:`~funcamp.passes.remat_regions`): what the backward recomputes of each region;
- ``remat_budget`` (:mod:`~funcamp.passes.remat_budget`): what a region's memory budget keeps instead;
- ``sharded_gathers`` (:mod:`~funcamp.passes.sharded_gathers`): the gathers recomputed for the backward,
  unused ones dropped, the rest moved to their user;
- ``casts_at_use`` (:mod:`~funcamp.passes.casts_at_use`): the parameters' casts made at their first use;
- ``late_constructors`` (:mod:`~funcamp.passes.late_constructors`): a large backward constructor waits for the
  gradient;
- ``flat_gradients`` (:mod:`~funcamp.passes.flat_gradients`): a flat state's gradients written into their buffer;
- ``scalars_once`` (:mod:`~funcamp.passes.scalars_once`): on a CPU, the step's scalars stored once rather than
  computed in every loop that reads them;
- ``region_casts`` (:mod:`~funcamp.passes.region_casts`): a nested compile region (the flat update's, one per
  kind of buffer) handed a widened tensor gets the narrow one and widens it inside.

The copies are made by the ``recompute`` step (:mod:`funcamp.passes.recompute`, between ``sharded_gathers``'
selection and its regather) and wait through :mod:`funcamp.passes.gates`. Every pass
keeps the values bitwise (README.md in this package states the rules); ``FUNCAMP_PASSES_OFF=name,...`` turns
passes off for debugging.

Limits: inductor's caches key on the graph's code, which does not show the tags, so in a process that has made
a region the compiled steps bypass those caches (:meth:`RematPass.uuid`).
"""

from funcamp.passes.pipeline import NAMES, PIPELINE, RematPass
from funcamp.passes.tags import gather_region, new_region_id, phase, remat_region

__all__ = ["NAMES", "PIPELINE", "RematPass", "gather_region", "new_region_id", "phase", "remat_region"]
