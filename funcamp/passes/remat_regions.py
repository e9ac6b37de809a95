"""Sub-pass ``remat_regions``: what the backward recomputes of the checkpointed regions.

The compiled train step differentiates inside one graph (traced ``torch.autograd.grad``,
:mod:`funcamp._dynamo_autograd`; ``torch.utils.checkpoint`` cannot recompute under ``torch.func``, where
saved-tensor hooks are disabled): without this pass a checkpointed region keeps its activations once compiled.
It selects the region nodes (:func:`funcamp.passes.tags.remat_region`) whose every use is inside the region or
in the backward (:func:`_recomputed`), and the parameters' casts and views that only one region reads
(:func:`_param_uses`); :mod:`funcamp.passes.recompute` gives each backward use a copy.
What a region computes for use outside it (the next region's input) is kept, as ``torch.utils.checkpoint`` keeps
a region's inputs. Random ops (dropout draws, :func:`_draws`) and ops that write to their inputs are never copied:
their results are kept (a draw as a bool), so masks are replayed. Inductor's own draws (``inductor_random``,
from a seed looked up per draw) are copied with that seed kept (:data:`_KEPT_SEED_OPS`): the same values.

Limit: a module called twice in one forward is one region (its two calls are recomputed together).
"""

from __future__ import annotations

import torch

from funcamp.passes._context import PassContext
from funcamp.passes._graph import _VIEWS, _is_input
from funcamp.passes.tags import _BUDGET, _GATHER, _PHASE, _REMAT, _tags

NAME = "remat_regions"


def _recomputable(node: torch.fx.Node) -> bool:
    tags = _tags(node)
    if node.op != "call_function" or not tags.get(_REMAT) or tags.get(_PHASE) != "forward":
        return False
    target = node.target
    schema = getattr(target, "_schema", None)
    if schema is not None and (
        schema.is_mutable or any(a.alias_info and a.alias_info.is_write for a in schema.arguments)
    ):
        return False
    if isinstance(target, torch._ops.OpOverload) and target.name() in _KEPT_SEED_OPS:
        return False
    tags_of_op = getattr(target, "tags", ())
    return torch.Tag.nondeterministic_seeded not in tags_of_op and not node.is_impure()


#: Inductor's per-draw seed (``replace_random`` turns ``aten.rand``, e.g. ``native_dropout``'s decomposition
#: in a graph with a traced ``torch.autograd.grad``, into ``inductor_random(size, inductor_lookup_seed(seeds,
#: i))``): not tagged as seeded, but a copy reading a gated seeds buffer fails to lower ("NotImplementedError:
#: Pointwise"). Kept from the forward; the draw itself is recomputed from the same seed, so the same values.
_KEPT_SEED_OPS = frozenset({"prims::inductor_lookup_seed"})


#: Random ops whose results are 0 or 1 (dropout's masks after decomposition): kept as bools for the backward.
_ZERO_ONE_DRAWS = (torch.ops.aten.bernoulli.p, torch.ops.aten.bernoulli.default)


def _draws(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """A region's dropout draws: never recomputed (the backward would draw another mask), kept as bools."""
    return {n for n in graph.nodes if n.target in _ZERO_ONE_DRAWS and _tags(n).get(_REMAT)}


def _param_use(node: torch.fx.Node) -> bool:
    """A forward cast or view of graph inputs only (a parameter's forward tensor), made outside every region:
    compiled, ``functionalize`` makes every parameter's forward tensor up front, before any module runs."""
    tags = _tags(node)
    if node.op != "call_function" or tags.get(_PHASE) != "forward" or tags.get(_REMAT) or tags.get(_GATHER):
        return False
    inputs = node.all_input_nodes
    return node.target in _VIEWS and bool(inputs) and all(_is_input(i) or _param_use(i) for i in inputs)


def _param_uses(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    """The parameters' forward casts and views that only one region's forward (and the backward) reads, each
    mapped to that region: recomputed with it, as ``torch.utils.checkpoint`` recomputes a checkpointed module's
    input casts (without this a checkpointed block's bfloat16 weights lived from the start of the forward to
    their backward: on GPT-2 124M, 8 x 256, 162 MiB at the compiled step's peak, at the end of the forward)."""
    out: dict[torch.fx.Node, int] = {}
    done: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node in done or not _param_use(node):
            continue
        group, todo = set(), [node]  # the connected casts and views
        while todo:
            n = todo.pop()
            if n in group or not _param_use(n):
                continue
            group.add(n)
            todo += list(n.users) + list(n.all_input_nodes)
        done |= group
        users = [u for n in group for u in n.users if u not in group]
        forward = [u for u in users if _tags(u).get(_PHASE) != "backward"]
        regions = {_tags(u).get(_REMAT) for u in forward}
        if len(regions) == 1 and None not in regions and all(u.op == "call_function" for u in users):
            region, budget = regions.pop(), _tags(forward[0]).get(_BUDGET)
            for n in group:  # the region's budget: kept when it allows (casts rank last, one op per element)
                if budget is not None:
                    n.meta["custom"] = {**_tags(n), _BUDGET: budget}
                out[n] = region
    return out


def _recomputed(graph: torch.fx.Graph, param_uses: dict[torch.fx.Node, int] | None = None) -> set[torch.fx.Node]:
    """The region nodes the backward recomputes: the recomputable ones that stay inside their region, and the
    parameter casts and views only one region reads (``param_uses``; by default :func:`_param_uses`).

    A region's results used outside it (by the next region, by untagged forward nodes, by the graph's output)
    are kept, never recomputed: they are the next region's inputs, saved as ``torch.utils.checkpoint`` saves a
    region's inputs. Recomputing them instead would recompute, for the backward of the last region, every
    region before it (a chain through all the blocks), all alive at once.
    """
    region = {n: _tags(n)[_REMAT] for n in graph.nodes if _recomputable(n)}
    region.update(_param_uses(graph) if param_uses is None else param_uses)

    def leaves(n: torch.fx.Node) -> bool:
        for user in n.users:
            tags = _tags(user)
            inside = tags.get(_REMAT, region.get(user)) == region[n]
            if user.op != "call_function" or (tags.get(_PHASE) != "backward" and not inside):
                return True
        return False

    return {n for n in region if not leaves(n)}


def param_uses(ctx: PassContext) -> dict[torch.fx.Node, int]:
    """``ctx.param_uses``, found (:func:`_param_uses`) by the first pass that asks: after ``cse``, which may merge
    two casts of one parameter."""
    if ctx.param_uses is None:
        ctx.param_uses = _param_uses(ctx.graph)
    return ctx.param_uses


def run(ctx: PassContext) -> None:
    """Fill ``ctx.recompute`` (:func:`_recomputed`, with :func:`param_uses`) and ``ctx.draws`` (:func:`_draws`)."""
    ctx.recompute = _recomputed(ctx.graph, param_uses(ctx))
    ctx.draws = _draws(ctx.graph)
