"""Sub-pass ``remat_budget``: what an activation memory budget keeps of the regions' recompute.

A region tagged with a budget ``b`` above 0 (:class:`funcamp.nn.Remat` ``(modules, budget=b)``) keeps the
fraction ``b`` of the bytes it would recompute, the values costliest to recompute per byte first (:func:`_kept`,
a greedy knapsack as torch's ``activation_memory_budget``), and recomputes the rest from them. Regions of budget 0
are untouched.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from funcamp.passes._context import PassContext
from funcamp.passes.tags import _BUDGET, _PHASE, _tags

NAME = "remat_budget"


def _is_view(node: torch.fx.Node) -> bool:
    """An op whose result aliases its first input (``view``, ``permute``, ``expand``, ``slice``, ...: its schema
    returns an alias, not written), or an item of a multi-output view (``split``)."""
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        return bool(node.all_input_nodes) and _is_view(node.all_input_nodes[0])
    schema = getattr(node.target, "_schema", None)
    if schema is None or not schema.returns or schema.is_mutable:
        return False
    alias = schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def _nbytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


#: Ops ``torch.utils.flop_counter`` has no formula for, counted with another's of the same arguments' meaning:
#: the CPU flash attention (query, key, value first) as the CUDA one.
_FLOP_ALIASES = {
    getattr(torch.ops.aten, cpu): getattr(torch.ops.aten, gpu)
    for cpu, gpu in [("_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention")]
    if hasattr(torch.ops.aten, cpu) and hasattr(torch.ops.aten, gpu)
}


def _flops(node: torch.fx.Node) -> float:
    """What recomputing ``node`` costs: the FLOPs of a matmul, convolution or attention (``torch.utils.
    flop_counter``'s formulas, on the fake values), else one per output element (pointwise ops, reductions); an
    output of a multi-output op (attention's output and log-sum-exp) costs the whole op."""
    from torch.utils.flop_counter import flop_registry

    if node.target is operator.getitem and node.all_input_nodes:  # an output of a multi-output op: the op's cost
        return _flops(node.all_input_nodes[0])
    packet = getattr(node.target, "overloadpacket", None)
    formula = flop_registry.get(packet) or flop_registry.get(_FLOP_ALIASES.get(packet))
    if formula is not None:

        def value(a: Any) -> Any:
            return a.meta.get("val") if isinstance(a, torch.fx.Node) else a

        args = torch.fx.node.map_aggregate(node.args, value)
        kwargs = torch.fx.node.map_aggregate(node.kwargs, value)
        try:
            return float(formula(*args, **kwargs, out_val=node.meta.get("val")))
        except Exception:  # a formula that does not fit these arguments: count it as a pointwise op
            pass
    val = node.meta.get("val")
    if isinstance(val, (tuple, list)):
        return float(sum(v.numel() for v in val if isinstance(v, torch.Tensor)))
    return float(val.numel()) if isinstance(val, torch.Tensor) else 0.0


def _kept(graph: torch.fx.Graph, recompute: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """The nodes of ``recompute`` an activation memory budget keeps instead (:class:`funcamp.nn.Remat`).

    Only regions tagged with a budget above 0 take part, all regions of one budget together, as torch's
    ``activation_memory_budget`` knapsack: the candidates are the values of ``recompute`` the backward reads,
    each counted on its base (a view, ``permute`` of a weight's cast, is no choice of its own: its bytes are its
    base's, and it is kept with it; a view of a value kept anyway, a region input, costs nothing and is kept).
    They are ranked by recompute cost per byte (:func:`_flops`), the highest first, the latest in the graph first
    between equals (the backward frees a later region's values first: kept early values would stay alive through
    every later region's recompute), and each is kept if it still fits: the kept bytes stay within ``budget``
    times the candidates' bytes (a greedy knapsack). Budget 1 keeps every one (no backward use reads a copy:
    nothing recomputed); a kept value's copies are never made, and the copies of the rest read it.
    """
    order = {node: i for i, node in enumerate(graph.nodes)}
    bases: dict[torch.fx.Node, set[torch.fx.Node]] = {}  # candidate -> the views of it the backward reads
    free: set[torch.fx.Node] = set()  # views of values kept anyway
    for node in recompute:
        if _tags(node).get(_BUDGET, 0.0) <= 0 or not any(_tags(u).get(_PHASE) == "backward" for u in node.users):
            continue
        chain, base = [], node
        while _is_view(base) and base.all_input_nodes[0] in recompute:
            chain.append(base)
            base = base.all_input_nodes[0]
        if _is_view(base):  # its base is outside the recomputed nodes: kept anyway
            free.update(chain + [base])
        else:
            bases.setdefault(base, set()).update(chain)
    kept = set(free)
    groups: dict[float, list[torch.fx.Node]] = {}
    for base in bases:
        groups.setdefault(_tags(base).get(_BUDGET, 0.0), []).append(base)
    for budget, members in groups.items():
        limit = budget * sum(_nbytes(b) for b in members)
        rank = sorted(members, key=lambda b: (-_flops(b) / max(_nbytes(b), 1), -order[b]))
        used = 0
        for base in rank:
            if used + _nbytes(base) <= limit:
                used += _nbytes(base)
                kept.add(base)
                kept.update(bases[base])
    return kept


def run(ctx: PassContext) -> None:
    """Take out of ``ctx.recompute`` what the regions' budgets keep (:func:`_kept`)."""
    ctx.recompute -= _kept(ctx.graph, ctx.recompute)
