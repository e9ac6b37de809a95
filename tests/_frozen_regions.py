"""Activation checkpointing inside the one compiled graph: regions tagged while tracing, recomputed by a graph pass.

``torch.utils.checkpoint`` cannot recompute under ``torch.func`` gradient transforms (saved-tensor hooks are
disabled there), and the compiled train step differentiates with ``torch.func``: without this module a
checkpointed region keeps its activations once compiled. Instead, while ``torch.compile`` traces,

- :func:`phase` tags the nodes of the differentiated function's forward (``"forward"``) and of the gradient
  computation around it (``"backward"``), in :mod:`funcamp.grad`;
- :func:`remat_region` tags the nodes of a checkpointed module's forward (``functionalize(remat=...)``);

with ``torch.fx.traceback.annotate``, whose tags reach the graph inductor compiles. :class:`RematPass`, an
inductor ``post_grad_custom_pre_pass``, then gives every backward use of a tagged forward node a copy of it
(and of the tagged nodes of its region it depends on) placed just before that use, so the forward's copy dies
after its last forward use. What a region computes for use outside it (its output: the next region's input) is
kept, not recomputed, as ``torch.utils.checkpoint`` keeps a region's inputs; each region is recomputed alone,
just before its own backward. The copies wait for the loss's gradient (through one input read as
``where(flag, x, x)``, bitwise ``x``, ``flag`` made from a value computed from that gradient), so inductor can
neither run them during the forward nor fuse them into the forward's kernels. The copies compute the same ops
on the same inputs, so gradients are bitwise those without remat. Random ops (dropout masks) and ops that write
to their inputs are never copied: their results are kept, so masks are replayed; a dropout draw (0 or 1) is
kept as a bool. Inductor's own draws (``inductor_random``, from a seed it looks up per draw) are copied with
their seed kept, which draws the same values again. Where torch has no ``annotate`` (before 2.9) nothing is
tagged and the pass does nothing.
A region with an activation memory budget (``funcamp.nn.Remat(modules, budget=b)``, a second tag) keeps the
fraction ``b`` of the bytes it would recompute, the values costliest to recompute per byte first
(:func:`_kept`), and recomputes the rest from them.

A sharded parameter's all-gather (:func:`gather_region`, :mod:`funcamp._at_use`) is recomputed the same way,
always: its backward uses get a new all-gather (every rank compiles the same graph, so every rank runs the same
collectives in the same order; its only input is the shard, a graph input), a gather nothing uses any more (an
up-front gather every use gathered again) is dropped, and each forward gather is moved to just before its
first user.

Two more things the pass does for memory, with the same ``where(flag, x, x)`` waits: a parameter's forward
casts and views that only one region reads are recomputed with it and made just before their first use
(:func:`_param_uses`, :func:`_wait_for_user`); a large tensor the backward builds from nothing (an embedding's
gradient zeros) waits for the gradient its first user reads (:func:`_late_constructors`). Inductor fuses a
node without graph inputs into any earlier kernel, which held such tensors from the start of the step.

Limits: a module called twice in one forward is one region (its two calls are recomputed together); inductor's
caches key on the graph's code, which does not show the tags, so in a process that has made a region the
compiled steps bypass those caches (:meth:`RematPass.uuid`).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import operator
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["RematPass", "gather_region", "new_region_id", "phase", "remat_region"]

_PHASE, _REMAT, _GATHER = "funcamp_phase", "funcamp_remat", "funcamp_gather"
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


def _tags(node: torch.fx.Node) -> dict[str, Any]:
    return node.meta.get("custom") or {}


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
    tags_of_op = getattr(target, "tags", ())
    if isinstance(target, torch._ops.OpOverload) and target.name() in _KEPT_SEED_OPS:
        return False
    return torch.Tag.nondeterministic_seeded not in tags_of_op and not node.is_impure()


#: Inductor's per-draw seed (``replace_random`` turns ``aten.rand``, e.g. ``native_dropout``'s decomposition
#: in a graph with a traced ``torch.autograd.grad``, into ``inductor_random(size, inductor_lookup_seed(seeds,
#: i))``): not tagged as seeded, but a copy reading a gated seeds buffer fails to lower ("NotImplementedError:
#: Pointwise"). Kept from the forward; the draw itself is recomputed from the same seed, so the same values.
_KEPT_SEED_OPS = frozenset({"prims::inductor_lookup_seed"})


def _view_ops() -> frozenset[Any]:
    aten, prims = torch.ops.aten, torch.ops.prims
    names = [(aten, "permute", "default"), (aten, "t", "default"), (aten, "transpose", "int")]
    names += [(aten, "view", "default")]
    names += [(aten, "_unsafe_view", "default"), (aten, "reshape", "default"), (aten, "expand", "default")]
    names += [(aten, "slice", "Tensor"), (aten, "select", "int"), (aten, "unsqueeze", "default")]
    names += [(aten, "alias", "default"), (prims, "convert_element_type", "default"), (aten, "_to_copy", "default")]
    return frozenset(getattr(getattr(ns, op), overload) for ns, op, overload in names)


#: Views and casts a module makes of a gathered parameter (a Linear's transposed weight, after the gather region).
_VIEWS = _view_ops()


def _gathered(node: torch.fx.Node) -> bool:
    """A forward :func:`gather_region` node (a functional all-gather, its wait, casts and views of a shard), or a
    forward view or cast of one only (a Linear's ``permute`` of its weight: left out, the backward kept the
    forward's gather alive through it). Impure to fx (they communicate), recomputed all the same: every rank
    recomputes the same ones in the same order."""
    tags = _tags(node)
    if node.op != "call_function" or tags.get(_PHASE) != "forward":
        return False
    if tags.get(_GATHER):
        return True
    inputs = node.all_input_nodes
    return node.target in _VIEWS and bool(inputs) and all(_gathered(i) for i in inputs)


def _gathers(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The forward gather nodes: every one is recomputed for its backward uses."""
    return {n for n in graph.nodes if _gathered(n)}


def _regather(graph: torch.fx.Graph) -> None:
    """After the recompute: the forward gathers nothing uses are dropped, the others moved to their first user."""
    _drop_unused_gathers(graph)
    _sink_gathers(graph)


def _drop_unused_gathers(graph: torch.fx.Graph) -> None:
    """Erase the forward gather nodes nothing uses (an up-front gather that every use gathered again)."""
    for node in reversed(list(graph.nodes)):
        if _gathered(node) and not node.users:
            graph.erase_node(node)


def _sink_gathers(graph: torch.fx.Graph) -> None:
    """Move each forward gather (a collective and its views) to just before its first user (:func:`_sink`)."""
    _sink(graph, _gathered)


def _sink(
    graph: torch.fx.Graph, member: Callable[[torch.fx.Node], bool]
) -> list[tuple[list[torch.fx.Node], torch.fx.Node]]:
    """Move each connected group of ``member`` nodes to just before the first node outside it that uses it;
    return the moved groups (in graph order) with that user.

    ``funcamp.nn.functionalize`` makes every use up front when compiled, so the gathers and the parameters'
    casts come first in the graph; inductor schedules in graph order, which would hold every gathered or cast
    parameter from the start of the forward. Only groups whose other inputs all come before that user are moved.
    """
    moved = []
    order = {node: i for i, node in enumerate(graph.nodes)}
    done: set[torch.fx.Node] = set()
    for node in list(graph.nodes):
        if node in done or not member(node):
            continue
        region, todo = [], [node]  # the connected member nodes
        while todo:
            n = todo.pop()
            if n in done or not member(n):
                continue
            done.add(n)
            region.append(n)
            todo += list(n.users) + list(n.all_input_nodes)
        region.sort(key=order.__getitem__)
        inside = set(region)
        users = [u for n in region for u in n.users if u not in inside]
        if not users:
            continue
        first = min(users, key=order.__getitem__)
        inputs = [i for n in region for i in n.all_input_nodes if i not in inside]
        if any(order[i] >= order[first] for i in inputs):
            continue
        for n in region:
            first.prepend(n)
        moved.append((region, first))
    return moved


#: What a graph input's forward tensor is made with: views, casts and the waits' ``where(flag, x, x)``.
_INPUT_OPS = _VIEWS | {torch.ops.aten.where.self}


def _of_inputs_only(node: torch.fx.Node) -> bool:
    """A graph input, or views, casts and ``where`` of graph inputs only (a weight's cast, its transpose)."""
    if node.op == "placeholder":
        return True
    return node.op == "call_function" and node.target in _INPUT_OPS and all(map(_of_inputs_only, node.all_input_nodes))


def _wait_for_user(graph: torch.fx.Graph, group: list[torch.fx.Node]) -> None:
    """Make ``group`` (casts and views of graph inputs, moved to just before their first user) wait for the
    value the forward computed last before it: each graph input it reads is read as ``where(flag, x, x)``
    (bitwise ``x``), ``flag`` made from that value (not from another parameter's cast).

    Moving the casts in the graph is not enough: inductor fuses nodes that have no inputs in the graph into
    any earlier kernel, and put every block's bfloat16 weights into the step's first kernel, all alive through
    the forward (GPT-2 124M: 74 MiB at its peak)."""
    source = group[0].prev
    while source.op != "root" and not (
        source.op == "call_function"
        and _tags(source).get(_PHASE) == "forward"
        and _gateable(source)
        and not _of_inputs_only(source)
    ):
        source = source.prev
    if source.op == "root":
        return
    with graph.inserting_before(group[0]):
        flag = _flag(graph, source, phase="forward")
        gated = {}
        for node in group:
            for inp in node.all_input_nodes:
                if inp.op == "placeholder" and inp not in gated:
                    gated[inp] = _call(graph, torch.ops.aten.where.self, flag, inp, inp, phase="forward")
    for node in group:
        for inp, late in gated.items():
            node.replace_input_with(inp, late)


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
    return node.target in _VIEWS and bool(inputs) and all(i.op == "placeholder" or _param_use(i) for i in inputs)


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


def _after_gradient(graph: torch.fx.Graph) -> dict[torch.fx.Node, torch.fx.Node]:
    """The backward's values computed from the loss's gradient, each mapped to itself, and every other node
    mapped to the last such value before it in the graph's order.

    A backward node computed from forward values alone (LayerNorm's ``x - mean``, GELU's ``x * x``) could run
    during the forward: a copy gated on it would not wait. The loss's gradient (the seed, ``ones`` or the loss
    scale) is found as the backward node without backward inputs that the most gradients (backward nodes
    without backward users) are computed from.
    """
    roots: dict[torch.fx.Node, int] = {}  # backward node -> bit set of the input-less backward nodes it reads
    count = 0
    for node in graph.nodes:
        if _tags(node).get(_PHASE) != "backward":
            continue
        bits = 0
        for inp in node.all_input_nodes:
            bits |= roots.get(inp, 0)
        if not bits:
            bits, count = 1 << count, count + 1
        roots[node] = bits
    ends = [bits for node, bits in roots.items() if not any(user in roots for user in node.users)]
    if not ends:
        return {}
    seed = max((1 << i for i in range(count)), key=lambda bit: sum(1 for bits in ends if bits & bit))
    out: dict[torch.fx.Node, torch.fx.Node] = {}
    last = None
    for node in graph.nodes:
        if roots.get(node, 0) & seed and _gateable(node):
            last = node
        if last is not None:
            out[node] = last
    return out


#: Dtypes inductor cannot select with ``where`` (no type promotion with the bool flag): never a gated input; a
#: copy that reads only such values (a cast of an fp8 value its budget kept) is not gated.
_FLOAT8 = frozenset(getattr(torch, n) for n in dir(torch) if n.startswith("float8_"))


def _gateable(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return hasattr(val, "fake_mode") and val.numel() > 0 and not val.is_complex()


def _call(graph: torch.fx.Graph, op: Any, *args: Any, phase: str = "backward") -> torch.fx.Node:
    """A new node of ``op`` at the graph's insertion point, tagged ``phase``, with the fake value later passes
    read."""
    node = graph.call_function(op, args)
    vals = [a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in args]
    with vals[0].fake_mode:
        node.meta["val"] = op(*vals)
    node.meta["custom"] = {_PHASE: phase}
    return node


def _flag(graph: torch.fx.Graph, source: torch.fx.Node, phase: str = "backward") -> torch.fx.Node:
    """A 0-d bool computed from ``source`` (its first element compared with itself), at the insertion point: a
    value that exists only once ``source`` does, for ``where(flag, x, x)`` (bitwise ``x``, NaN or not)."""
    first = source
    for _ in range(source.meta["val"].ndim):  # its first element, a 0-d view
        first = _call(graph, torch.ops.aten.select.int, first, 0, 0, phase=phase)
    return _call(graph, torch.ops.aten.eq.Tensor, first, first, phase=phase)


class _Gate:
    """What the copies made for one backward node wait for: a 0-d bool made from a value of the gradient, made at
    most once, when a copy first needs it (:meth:`flag`); ``None`` where the graph has no gradient value before."""

    def __init__(self, graph: torch.fx.Graph, after: dict[torch.fx.Node, torch.fx.Node], before: torch.fx.Node):
        self.graph, self.after, self.before = graph, after, before
        self.made: list[torch.fx.Node | None] = []

    def flag(self) -> torch.fx.Node | None:
        if not self.made:
            self.made.append(self._make())
        return self.made[0]

    def _make(self) -> torch.fx.Node | None:
        """One of ``before``'s gradient inputs, or else (an input-only part of a backward formula, such as
        LayerNorm's ``x - mean``) the gradient value last computed before it in the graph's order: its first
        element compared with itself."""
        before, after = self.before, self.after
        source = next((inp for inp in before.all_input_nodes if after.get(inp) is inp), None) or after.get(before)
        if source is None:
            return None
        with self.graph.inserting_before(before):
            return _flag(self.graph, source)


class _Recompute:
    """Gives every backward use of a node in ``recompute`` a copy of it (and of the nodes of ``recompute`` it
    reads) placed just before that use, each copy made once; a ``draws`` node (a dropout draw) is read as the
    bool kept from the forward. The copies wait for the gradient through :class:`_Gate`."""

    def __init__(self, graph: torch.fx.Graph, recompute: set[torch.fx.Node], draws: set[torch.fx.Node]) -> None:
        self.graph, self.recompute, self.draws = graph, recompute, draws
        self.copies: dict[torch.fx.Node, torch.fx.Node] = {}
        self.masks: dict[torch.fx.Node, torch.fx.Node] = {}
        self.after = _after_gradient(graph)

    def run(self) -> None:
        for node in list(self.graph.nodes):
            if _tags(node).get(_PHASE) != "backward" or node in self.recompute:
                continue
            deps = [dep for dep in node.all_input_nodes if dep in self.recompute or dep in self.draws]
            if deps:
                gate = _Gate(self.graph, self.after, node)
                for dep in deps:
                    new = self.copy(dep, gate) if dep in self.recompute else self.mask(dep, gate)
                    node.replace_input_with(dep, new)

    def mask(self, node: torch.fx.Node, gate: _Gate) -> torch.fx.Node:
        """What the backward reads for a region's dropout draw (0 or 1): a bool kept from the forward, made the
        draw's dtype again once the backward begins (the same values; a quarter of float32's bytes)."""
        if node in self.masks:
            return self.masks[node]
        graph = self.graph
        with graph.inserting_after(node):
            kept = _call(graph, torch.ops.aten.ne.Scalar, node, 0)
        kept.meta["custom"] = dict(_tags(node))
        flag = gate.flag()
        with graph.inserting_before(gate.before):
            if flag is not None:
                kept = _call(graph, torch.ops.aten.where.self, flag, kept, kept)
            self.masks[node] = _call(graph, torch.ops.prims.convert_element_type.default, kept, node.meta["val"].dtype)
        return self.masks[node]

    def copy(self, node: torch.fx.Node, gate: _Gate) -> torch.fx.Node:
        """``node``'s copy for the backward, made before ``gate.before`` after the copies (and masks) it reads."""
        if node in self.copies:
            return self.copies[node]
        for dep in node.all_input_nodes:
            if dep in self.recompute:
                self.copy(dep, gate)
            elif dep in self.draws:
                self.mask(dep, gate)
        gated = self._gated_input(node, gate)

        def arg(n: torch.fx.Node) -> torch.fx.Node:
            if n in self.copies:
                return self.copies[n]
            if n in self.draws:
                return self.masks[n]
            if n is gated:
                return _call(self.graph, torch.ops.aten.where.self, gate.flag(), n, n)
            return n

        with self.graph.inserting_before(gate.before):
            dup = self.graph.node_copy(node, arg)
        dup.meta["custom"] = {**_tags(node), _PHASE: "backward"}
        self.copies[node] = dup
        return dup

    def _gated_input(self, node: torch.fx.Node, gate: _Gate) -> torch.fx.Node | None:
        """The input a copy reads as ``where(flag, x, x)`` (bitwise ``x``), so that inductor can neither run it
        early nor fuse it into the forward's kernel (which would keep its result alive until the backward): the
        smallest, for a copy that reads no other copy or mask (copies of copies wait with it), never a float8 one;
        else ``None``."""
        if any(dep in self.copies or dep in self.draws for dep in node.all_input_nodes):
            return None
        inputs = [d for d in node.all_input_nodes if _gateable(d) and d.meta["val"].dtype not in _FLOAT8]
        if not inputs or gate.flag() is None:
            return None
        return min(inputs, key=lambda d: d.meta["val"].numel())


#: A backward constructor at least this large (elements) waits for the gradient: see :func:`_late_constructors`.
_LARGE = 1 << 18


def _late_constructors(graph: torch.fx.Graph) -> None:
    """Make each large tensor the backward builds from nothing (an embedding's gradient, zeros that
    ``index_put`` accumulates into) wait for the gradient its first user reads, as ``where(flag, x, x)``
    (bitwise ``x``).

    Without inputs, inductor may compute it with any earlier kernel: on GPT-2 124M it filled the token
    embedding's float32 gradient (50304 x 768, 147 MiB) with the forward's last LayerNorm, so that it lived
    through the LM head's logits, the compiled step's peak.
    """
    after = _after_gradient(graph)
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.all_input_nodes or _tags(node).get(_PHASE) != "backward":
            continue
        if not node.users or not _gateable(node) or node.meta["val"].numel() < _LARGE:
            continue
        first = min(node.users, key=order.__getitem__)
        flag = _Gate(graph, after, first).flag()
        if flag is None:
            continue
        with graph.inserting_before(first):
            late = _call(graph, torch.ops.aten.where.self, flag, node, node)
        node.replace_all_uses_with(late, delete_user_cb=lambda user, late=late: user is not late)


try:
    from torch._inductor.custom_graph_pass import CustomGraphPass as _Base
except ImportError:  # older torch: a plain callable
    _Base = object


class RematPass(_Base):  # type: ignore[misc, valid-type]
    """The inductor graph pass that recomputes :func:`remat_region` nodes for their backward uses (see module).

    Two concerns, one pass: the checkpointed regions (:func:`_recomputed` less what their budget keeps,
    :func:`_kept`; :func:`_draws`) and the sharded
    step's gathers (:func:`_gathers`, always recomputed, then :func:`_regather`). The gathers join the regions'
    recompute (one :class:`_Recompute`) because a region's copy that reads a gathered weight must read the
    gather's copy, placed and gated with it."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        param_uses = _param_uses(graph)
        recompute = _recomputed(graph, param_uses)
        recompute -= _kept(graph, recompute)
        _Recompute(graph, recompute | _gathers(graph), _draws(graph)).run()
        _regather(graph)
        for group, _ in _sink(graph, param_uses.__contains__):
            _wait_for_user(graph, group)
        _late_constructors(graph)

    def uuid(self) -> bytes | None:
        """The pass's identity for inductor's caches: a hash of this module's source; ``None`` (the step is not
        cached) once this process has made a region. The caches' keys hold the graph's code, not its tags: a
        step compiled without remat, cached, would be served for the same model with remat (no memory saved);
        nor the budgets (:class:`funcamp.nn.Remat`, tags too): a step of one budget would be served for another."""
        if _made_regions[0]:
            return None
        with open(__file__, "rb") as f:
            return hashlib.sha256(f.read()).digest()
