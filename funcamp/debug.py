"""Debugging mixed precision on the host: the first non-finite op of a step, and a dtype lint.

Both re-run a loss eagerly, forward and backward with plain ``torch.autograd``, under a
``torch.utils._python_dispatch.TorchDispatchMode``: below autograd, it sees every ATen op of the forward
*and* of the backward, in execution order, with its real input and output tensors.

* :func:`find_first_nonfinite` (and :func:`locate_from_state` for a :class:`funcamp.TrainState`)
  names the first op whose output holds a NaN or an infinity although its inputs did not: the op, the
  module it ran in, forward or backward, input and output dtypes and amaxes, and whether the loss
  scale made the difference. The train step is pure, so a step that skipped can be replayed from the
  state and the batch it was given.
* :func:`lint` reports ops of a policy that are numerically risky in half precision (long
  accumulations, exp/log/pow/softmax in float16, float32 round trips) or slow (large float32 matmuls
  in a half-precision model), and parameters whose gradients are all zero.

Module paths. Global module hooks (``torch.nn.modules.module.register_module_forward_pre_hook`` and
``register_module_forward_hook``) keep a stack of the modules being run, named by the outermost
module's ``named_modules()`` (``"blocks.0.attn.qkv"``; the outermost module itself by its class name,
``"GPT"``), so the models ``funcamp.nn.functionalize`` runs (a copy of yours, with your names) are
covered. A forward op gets the innermost running module's path. For the backward, when a module
returns, every autograd node its outputs were computed through that has no path yet is given this
module's path (``Node.metadata``); a backward op takes the path of the node the autograd engine is
running (``torch._C._current_autograd_node()``). Ops outside every module are ``"loss_fn"``; the
multiplication by the loss scale is ``"loss scale"``.

Differences from the field's tools: ``jax_debug_nans`` re-runs a jitted function op by op and raises
at the first NaN (forward only, NaN only); ``torch.autograd.detect_anomaly`` checks backward outputs
for NaN only and slows every step. Here both directions are checked, infinities count, and a
non-finite value whose inputs already were non-finite is not reported again (so a ``-inf`` attention
mask that a ``masked_fill`` writes on purpose, from a non-finite scalar, is not a finding, and the
``softmax`` after it is one only if it makes a NaN).

Random ops (dropout) draw new random numbers in the re-run: seed them as the step did, or expect
another draw.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as torch_pytree
from torch.utils._python_dispatch import TorchDispatchMode

from funcamp import _tree
from funcamp.loss_scale import LossScale, NoOpLossScale

__all__ = ["NonFiniteReport", "find_first_nonfinite", "locate_from_state"]

_META_KEY = "funcamp.module"
_OUTSIDE = "loss_fn (outside every module)"
_SCALE = "loss scale"
_MAX_FINITE = {
    torch.float16: torch.finfo(torch.float16).max,
    torch.bfloat16: torch.finfo(torch.bfloat16).max,
    torch.float32: torch.finfo(torch.float32).max,
}


# --- module paths ---------------------------------------------------------------------------------


class _ModuleStack:
    """Global forward hooks that keep the path of the running module and tag autograd nodes with it."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}
        self.stack: list[str] = []
        self.label: str | None = None  # a forced path (the loss scale), outside every module

    @property
    def path(self) -> str:
        if self.label is not None:
            return self.label
        return self.stack[-1] if self.stack else _OUTSIDE

    def _name(self, module: torch.nn.Module) -> str:
        """The module's path; a module seen first is named with its submodules (an outermost one by its class)."""
        if id(module) not in self.names:
            base = f"{self.stack[-1]}.{type(module).__name__}" if self.stack else type(module).__name__
            for sub, child in module.named_modules(remove_duplicate=False):
                name = (f"{base}.{sub}" if self.stack else sub) if sub else base
                self.names.setdefault(id(child), name)
        return self.names[id(module)]

    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        self.stack.append(self._name(module))

    def _post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        path = self.stack.pop() if self.stack else _OUTSIDE
        tag_graph(output, path)

    @contextlib.contextmanager
    def active(self) -> Iterator[_ModuleStack]:
        pre = torch.nn.modules.module.register_module_forward_pre_hook(self._pre)
        post = torch.nn.modules.module.register_module_forward_hook(self._post, always_call=True)
        try:
            yield self
        finally:
            pre.remove()
            post.remove()

    @contextlib.contextmanager
    def labelled(self, label: str) -> Iterator[None]:
        self.label = label
        try:
            yield
        finally:
            self.label = None


def tag_graph(output: Any, path: str) -> None:
    """Give every autograd node ``output`` was computed through that has no module path yet ``path``."""
    todo = [t.grad_fn for t in torch_pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or _META_KEY in node.metadata:
            continue
        node.metadata[_META_KEY] = path
        todo.extend(n for n, _ in node.next_functions)


def _backward_path() -> tuple[str, str] | None:
    """``(module path, node name)`` of the autograd node being run, or None in the forward."""
    node = torch._C._current_autograd_node()
    if node is None:
        return None
    return node.metadata.get(_META_KEY, _OUTSIDE), node.name()


# --- tensors --------------------------------------------------------------------------------------


def _floats(tree: Any) -> list[torch.Tensor]:
    return [x for x in torch_pytree.tree_leaves(tree) if isinstance(x, torch.Tensor) and x.is_floating_point()]


def _amax(x: torch.Tensor) -> float:
    """max |x| over the non-NaN elements (inf if there is one), as a Python float; 0 for an empty tensor."""
    if x.numel() == 0:
        return 0.0
    a = x.detach().abs()
    return float(torch.where(torch.isnan(a), torch.zeros((), dtype=a.dtype, device=a.device), a).amax())


def _state(tensors: list[torch.Tensor], scalars: list[float] = ()) -> tuple[bool, bool]:
    """``(has_nan, has_inf)`` over the tensors and Python scalars."""
    nan = any(math.isnan(s) for s in scalars)
    inf = any(math.isinf(s) for s in scalars)
    for t in tensors:
        if not bool(torch.isfinite(t).all()):
            t_nan = bool(torch.isnan(t).any())
            nan, inf = nan or t_nan, inf or not t_nan or bool(torch.isinf(t).any())
    return nan, inf


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _op_name(func: Any) -> str:
    return str(getattr(func, "overloadpacket", func))


# --- the locator ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NonFiniteReport:
    """Where a step first produced a NaN or an infinity (see :func:`find_first_nonfinite`).

    Attributes:
      kind: ``"op"`` (an op made it), ``"data"`` (a batch leaf already was non-finite),
        ``"parameter"`` / ``"buffer"`` (a state leaf already was), ``"gradient"`` (no op the dispatch mode
        saw made one, yet a gradient is not finite: computed outside torch's dispatcher), or ``"none"``.
      op: the ATen op (``"aten._softmax_backward_data"``); in the backward followed by the autograd
        node, e.g. ``"aten.mm (MmBackward0)"``.
      module: the module path the op ran in (``"blocks.0.attn"``), ``"loss_fn"`` outside every module,
        ``"loss scale"`` for the multiplication by the loss scale.
      phase: ``"forward"`` or ``"backward"``.
      leaf: the path of the non-finite batch, parameter or buffer leaf (``"['x']"``, ``"fc.weight"``).
      index: the op's position among the ops run (0-based, forward then backward).
      input_dtypes, input_amax: each floating tensor input's dtype and max |x|.
      output_dtypes, output_amax: each floating tensor output's dtype and max |x| (NaNs ignored).
      output_nan, output_inf: NaN and infinite elements in the outputs.
      loss_scale: the loss scale the step used (None for :class:`funcamp.NoOpLossScale`).
      loss_finite: whether the unscaled loss was finite.
      grads_finite: whether every gradient (unscaled, in its parameter's dtype) was finite.
      finite_without_scale: for a non-finite step with a loss scale above 1, whether the same step
        with the loss scale 1 had finite gradients and loss (True: the scale alone made it overflow);
        None when not tried.
    """

    kind: str
    op: str | None = None
    module: str | None = None
    phase: str | None = None
    leaf: str | None = None
    index: int | None = None
    input_dtypes: tuple[str, ...] = ()
    input_amax: tuple[float, ...] = ()
    output_dtypes: tuple[str, ...] = ()
    output_amax: tuple[float, ...] = ()
    output_nan: int = 0
    output_inf: int = 0
    loss_scale: float | None = None
    loss_finite: bool = True
    grads_finite: bool = True
    finite_without_scale: bool | None = None

    @property
    def step_finite(self) -> bool:
        """Whether the loss and every gradient were finite."""
        return self.loss_finite and self.grads_finite

    def __str__(self) -> str:
        scale = "" if self.loss_scale is None else f" at loss scale {self.loss_scale:g}"
        outcome = "finite" if self.step_finite else "NOT finite"
        lines = [
            f"loss {'finite' if self.loss_finite else 'NOT finite'}, gradients "
            f"{'finite' if self.grads_finite else 'NOT finite'}{scale}"
        ]
        lines[0] = f"step {outcome}: " + lines[0]
        if self.kind == "none":
            lines.append("no op produced a NaN or an infinity")
        elif self.kind in ("data", "parameter", "buffer"):
            what = {"data": "the data itself is non-finite: batch leaf", "parameter": "parameter", "buffer": "buffer"}
            lines.append(f"{what[self.kind]} {self.leaf} holds NaN or inf before any op ran")
        elif self.kind == "gradient":
            lines.append(f"no op made a NaN or an inf, yet the gradient of {self.leaf} is not finite")
        else:
            ins = ", ".join(f"{d} amax {a:.4g}" for d, a in zip(self.input_dtypes, self.input_amax)) or "no tensors"
            outs = ", ".join(f"{d} amax {a:.4g}" for d, a in zip(self.output_dtypes, self.output_amax))
            lines.append(f"first non-finite: {self.phase} op {self.op} in {self.module} (op #{self.index})")
            lines.append(f"  inputs: {ins}")
            lines.append(f"  output: {outs} ({self.output_inf} inf, {self.output_nan} NaN)")
        hint = self._hint()
        if hint:
            lines.append(hint)
        return "\n".join(lines)

    def _hint(self) -> str:
        if self.kind != "op":
            return ""
        where = self._range()
        if self.phase == "backward" and self.finite_without_scale:
            return (
                f"the forward, and the same step at loss scale 1, are finite: the loss scale {self.loss_scale:g} "
                f"pushed the backward past {where}. A DynamicLossScale backs off by itself; lower a "
                "StaticLossScale (or a DynamicLossScale's initial scale)."
            )
        if self.output_nan:
            return "a NaN from finite inputs: 0/0, inf-inf, 0*inf, log or sqrt of a negative; guard the op (eps, clamp)"
        if where and self._half_output():
            module = self.module if self.phase == "forward" else "this module"
            return (
                f"the result leaves {where}{' at loss scale 1 too' if self.finite_without_scale is False else ''}: "
                f"compute {module} in bfloat16 or float32 (functionalize(..., module_policies=...)) or rescale it"
            )
        return "an infinity from finite inputs: log(0), x/0, exp of a large value; guard the op (eps, clamp)"

    def _half_output(self) -> bool:
        return any(d in ("float16", "bfloat16") for d in self.output_dtypes)

    def _range(self) -> str:
        for d in self.output_dtypes:
            dtype = getattr(torch, d, None)
            if dtype in _MAX_FINITE and dtype != torch.float32:
                return f"{d}'s range (max {_MAX_FINITE[dtype]:.6g})"
        return ""


class _Locator(TorchDispatchMode):
    """Checks each op's inputs and outputs until one makes a NaN or an infinity from inputs without them."""

    def __init__(self, modules: _ModuleStack) -> None:
        super().__init__()
        self.modules = modules
        self.index = 0
        self.found: dict[str, Any] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.found is not None:
            return func(*args, **kwargs)
        leaves = torch_pytree.tree_leaves((args, kwargs))
        ins = [x for x in leaves if isinstance(x, torch.Tensor) and x.is_floating_point()]
        scalars = [x for x in leaves if isinstance(x, float)]
        in_nan, in_inf = _state(ins, scalars)
        mutates = getattr(getattr(func, "_schema", None), "is_mutable", True)
        in_amax = tuple(_amax(x) for x in ins) if mutates else None  # before the op writes its inputs
        out = func(*args, **kwargs)
        outs = _floats(out)
        index, self.index = self.index, self.index + 1
        if not outs or (in_nan and in_inf):
            return out
        out_nan, out_inf = _state(outs)
        if (out_nan and not in_nan) or (out_inf and not in_nan and not in_inf):
            backward = _backward_path()
            op = _op_name(func)
            if backward is None:
                module, phase = self.modules.path, "forward"
            else:
                module, phase, op = backward[0], "backward", f"{op} ({backward[1]})"
            self.found = dict(
                kind="op",
                op=op,
                module=module,
                phase=phase,
                index=index,
                input_dtypes=tuple(_dtype_name(x.dtype) for x in ins),
                input_amax=in_amax if in_amax is not None else tuple(_amax(x) for x in ins),
                output_dtypes=tuple(_dtype_name(x.dtype) for x in outs),
                output_amax=tuple(_amax(x) for x in outs),
                output_nan=sum(int(torch.isnan(x).sum()) for x in outs),
                output_inf=sum(int(torch.isinf(x).sum()) for x in outs),
            )
        return out


def _nonfinite_leaf(tree: Any) -> str | None:
    for path, leaf in zip(_tree.tree_paths(tree), _tree.tree_leaves(tree)):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and not bool(torch.isfinite(leaf).all()):
            return path
    return None


def _call(loss_fn: Callable[..., Any], params: Any, buffers: Any, batch: Any, has_aux: bool) -> torch.Tensor:
    out = loss_fn(params, batch) if buffers is None else loss_fn(params, buffers, batch)[0]
    loss = out[0] if has_aux else out
    if not isinstance(loss, torch.Tensor) or not loss.is_floating_point() or loss.ndim != 0:
        raise TypeError(
            "find_first_nonfinite: loss_fn must return a 0-d floating tensor (with has_aux, (loss, aux); with "
            f"buffers, (loss, new_buffers)); got {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}, dtype {loss.dtype}" if isinstance(loss, torch.Tensor) else "")
        )
    return loss


def _replay(
    loss_fn: Callable[..., Any], params: Any, buffers: Any, batch: Any, loss_scale: LossScale, has_aux: bool
) -> dict[str, Any]:
    """One eager forward and backward under the locator: what it found, and the loss and gradient checks."""
    leaves, spec = torch_pytree.tree_flatten(params)
    bad = [i for i, x in enumerate(leaves) if not (isinstance(x, torch.Tensor) and x.is_floating_point())]
    if bad:
        raise TypeError(
            f"find_first_nonfinite: every leaf of params must be a floating tensor; leaf {bad[0]} is "
            f"{type(leaves[bad[0]]).__name__}"
        )
    leaves = [x.detach().requires_grad_() for x in leaves]
    modules = _ModuleStack()
    locator = _Locator(modules)
    with modules.active(), locator, torch.enable_grad():
        loss = _call(loss_fn, torch_pytree.tree_unflatten(leaves, spec), buffers, batch, has_aux)
        with modules.labelled(_SCALE):
            scaled = loss_scale.scale(loss)
        tag_graph(scaled, _SCALE)
        tag_graph(loss, _OUTSIDE)
        grads = torch.autograd.grad(scaled, leaves, allow_unused=True) if scaled.requires_grad else [None] * len(leaves)
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]
    unscaled = [g.to(x.dtype) for g, x in zip(loss_scale.unscale(grads), leaves)]
    bad_grad = next((i for i, g in enumerate(unscaled) if not bool(torch.isfinite(g).all())), None)
    names = _grad_names(params, spec, len(leaves))
    return dict(
        found=locator.found,
        loss_finite=bool(torch.isfinite(loss.detach())),
        bad_grad=None if bad_grad is None else (names[bad_grad], _dtype_name(unscaled[bad_grad].dtype)),
    )


def _grad_names(params: Any, spec: Any, n: int) -> list[str]:
    """Names of the parameter leaves in torch.utils._pytree order (dict keys as given, dotted)."""
    paths, _ = torch_pytree.tree_flatten_with_path(params)
    names = [".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path) for path, _ in paths]
    return names if len(names) == n else [str(i) for i in range(n)]


def find_first_nonfinite(
    loss_fn: Callable[..., Any],
    params: Any,
    batch: Any,
    *,
    loss_scale: LossScale | None = None,
    buffers: Any = None,
    has_aux: bool = False,
) -> NonFiniteReport:
    """Replay one step eagerly and report the first op, forward or backward, that made a NaN or an inf.

    Host side, for debugging: runs ``loss_fn`` and its backward once with plain ``torch.autograd`` under
    a dispatch mode that checks every ATen op's floating inputs and outputs (several host syncs per op:
    many times slower than a step). Reported: the first op, in execution order, whose outputs hold a
    NaN while no input (tensor or Python scalar) did, or an infinity while every input was finite. The
    backward differentiates ``loss_scale.scale(loss)`` (in float32, as :func:`funcamp.grad_and_value`);
    gradients are then unscaled and cast to their parameters' dtypes, as the train step does. When the
    step is not finite, its backward overflowed and the loss scale is above 1, the step is replayed at
    scale 1 to tell whether the scale alone made it overflow (``finite_without_scale``). Before any op
    runs, the batch, the parameters and the buffers are checked: a non-finite leaf there is reported
    as such (``kind="data"`` / ``"parameter"`` / ``"buffer"``).

    Args:
      loss_fn: as for :func:`funcamp.make_train_step`: ``loss_fn(params, batch) -> loss``, or with
        ``buffers`` ``loss_fn(params, buffers, batch) -> (loss, new_buffers)``; with ``has_aux`` the
        loss is ``(loss, aux)``. ``loss`` a 0-d floating tensor.
      params: the parameters (a pytree of floating tensors, on any device; not changed).
      batch: the batch the step was given.
      loss_scale: the loss scale the step used (``state.loss_scale``); default no scaling.
      buffers: the model buffers (``state.buffers``), or None.
      has_aux: whether the loss comes with aux data.
    Returns:
      A :class:`NonFiniteReport`; ``print`` it. ``kind == "none"`` if nothing was non-finite.
    Raises:
      TypeError: if ``loss_fn`` is not callable, ``loss_scale`` is not a funcamp loss scale, a leaf of
        ``params`` is not a floating tensor, or ``loss_fn`` does not return a 0-d floating loss.

    Example:
      >>> import torch.nn.functional as F
      >>> params = {"w": torch.full((2, 2), 300.0, dtype=torch.float16)}
      >>> loss_fn = lambda p, x: (x @ p["w"]).float().mean()
      >>> report = find_first_nonfinite(loss_fn, params, torch.full((1, 2), 200.0, dtype=torch.float16))
      >>> report.op, report.phase, report.output_amax
      ('aten.mm', 'forward', (inf,))
    """
    if not callable(loss_fn):
        raise TypeError(f"find_first_nonfinite: loss_fn must be callable, got {type(loss_fn).__name__}")
    loss_scale = NoOpLossScale() if loss_scale is None else loss_scale
    if not isinstance(loss_scale, LossScale):
        raise TypeError(
            "find_first_nonfinite: loss_scale must be a funcamp loss scale (state.loss_scale), got "
            f"{type(loss_scale).__name__}"
        )
    scale = None if isinstance(loss_scale, NoOpLossScale) else float(loss_scale.loss_scale)
    for kind, tree in (("data", batch), ("parameter", params), ("buffer", buffers)):
        leaf = _nonfinite_leaf(tree)
        if leaf is not None:
            return NonFiniteReport(kind=kind, leaf=leaf, loss_scale=scale, loss_finite=False, grads_finite=False)
    run = _replay(loss_fn, params, buffers, batch, loss_scale, has_aux)
    checks = dict(loss_scale=scale, loss_finite=run["loss_finite"], grads_finite=run["bad_grad"] is None)
    found = run["found"]
    if found is None:
        if run["bad_grad"] is not None:
            name, dtype = run["bad_grad"]
            return NonFiniteReport(kind="gradient", leaf=name, output_dtypes=(dtype,), **checks)
        return NonFiniteReport(kind="none", **checks)
    retry = None
    step_finite = checks["loss_finite"] and checks["grads_finite"]
    if not step_finite and found["phase"] == "backward" and scale is not None and scale > 1:
        again = _replay(loss_fn, params, buffers, batch, NoOpLossScale(), has_aux)
        retry = again["found"] is None and again["loss_finite"] and again["bad_grad"] is None
    return NonFiniteReport(**found, **checks, finite_without_scale=retry)


def locate_from_state(
    loss_fn: Callable[..., Any], state: Any, batch: Any, *, has_aux: bool = False, accumulation_steps: int = 1
) -> NonFiniteReport:
    """:func:`find_first_nonfinite` for a step of :func:`funcamp.make_train_step`: the same state, the same batch.

    Replays ``train_step(state, batch)`` from ``state`` (the state *before* the step: the one passed in)
    with its parameters, buffers and loss scale. With ``accumulation_steps`` the batch is split along
    dim 0 as the step splits it, and the first micro-batch that is not finite is reported (a batch leaf
    is then named with its micro-batch, e.g. ``"micro-batch 1: ['x']"``).

    Args:
      loss_fn: the loss the step was built with.
      state: a :class:`funcamp.TrainState`.
      batch: the batch that step was given.
      has_aux: as the step.
      accumulation_steps: as the step (>= 1).
    Returns:
      A :class:`NonFiniteReport` (``kind == "none"`` when every micro-batch was finite).
    Raises:
      TypeError: if ``state`` is not a TrainState-like object (``params``, ``buffers``, ``loss_scale``).
      ValueError: if ``accumulation_steps`` < 1 or a batch leaf does not split into that many parts.
    """
    if not all(hasattr(state, f) for f in ("params", "buffers", "loss_scale")):
        raise TypeError(
            f"locate_from_state: state must be a funcamp.TrainState, got {type(state).__name__}; "
            "call locate_from_state(loss_fn, state, batch)"
        )
    if not isinstance(accumulation_steps, int) or isinstance(accumulation_steps, bool) or accumulation_steps < 1:
        raise ValueError(f"locate_from_state: accumulation_steps must be an int >= 1, got {accumulation_steps!r}")
    parts = _split(batch, accumulation_steps)
    report = None
    for i, part in enumerate(parts):
        report = find_first_nonfinite(
            loss_fn, state.params, part, loss_scale=state.loss_scale, buffers=state.buffers, has_aux=has_aux
        )
        if report.kind != "none":
            if len(parts) > 1 and report.leaf is not None and report.kind == "data":
                report = dataclasses.replace(report, leaf=f"micro-batch {i}: {report.leaf}")
            return report
    return report  # type: ignore[return-value]


def _split(batch: Any, k: int) -> list[Any]:
    if k == 1:
        return [batch]
    leaves, spec = _tree.tree_flatten(batch)
    for path, leaf in zip(_tree.tree_paths(batch), leaves):
        if not isinstance(leaf, torch.Tensor) or leaf.ndim == 0 or leaf.shape[0] % k:
            raise ValueError(
                f"locate_from_state: with accumulation_steps={k}, every batch leaf must be a tensor whose first "
                f"dimension is divisible by {k}; leaf {path!r} is not"
            )
    chunks = [leaf.chunk(k) for leaf in leaves]
    return [_tree.tree_unflatten(spec, [c[i] for c in chunks]) for i in range(k)]
