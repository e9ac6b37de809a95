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
running (``torch._C._current_autograd_node()``). Ops outside every module (the loss, the casts of
``apply_fn``'s inputs and outputs) are ``"outside modules (loss_fn, apply_fn's casts)"``; the
multiplication by the loss scale is ``"loss scale"``.

Differences from the field's tools: ``jax_debug_nans`` / ``jax_debug_infs`` raise at the first
primitive whose output holds a NaN / an inf (re-running a jitted function op by op), without module
names; ``torch.autograd.detect_anomaly`` checks backward outputs for NaN only and slows every step.
Here forward and backward ops are checked for both, the module and the loss scale's part are named,
and a non-finite value whose inputs already were non-finite is not reported again (so a ``-inf``
attention mask that a ``masked_fill`` writes on purpose, from a non-finite scalar, is not a finding,
and the ``softmax`` after it is one only if it makes a NaN).

Random ops (dropout) draw new random numbers in the re-run: seed them as the step did, or expect
another draw. On CUDA the autograd engine runs the backward on its device threads; it carries the
dispatch mode there with the rest of its thread-local state (``at::ThreadLocalState``). Tested on the
CPU only. Cost: a :func:`lint` about one eager step (its checks are per op, on shapes and dtypes);
a :func:`find_first_nonfinite` replay several, as it reads every op's outputs on the host (figures
in the README).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils._pytree as torch_pytree
from torch.utils._python_dispatch import TorchDispatchMode

from funcamp import _tree
from funcamp.loss_scale import LossScale, NoOpLossScale, StaticLossScale
from funcamp.policy import get_policy
from funcamp.train import _loss

__all__ = ["LintFinding", "LintReport", "NonFiniteReport", "find_first_nonfinite", "lint", "locate_from_state"]

_META_KEY = "funcamp.module"
_OUTSIDE = "outside modules (loss_fn, apply_fn's casts)"
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
        _tag_graph(output, path)

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


def _tag_graph(output: Any, path: str) -> None:
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


def _scale_text(scale: float) -> str:
    """``65536.0`` -> ``"65536 (2**16)"``; other values as ``%g``."""
    mantissa, exponent = math.frexp(scale) if scale > 0 and math.isfinite(scale) else (0.0, 0)
    return f"{scale:g} (2**{exponent - 1})" if mantissa == 0.5 and exponent - 1 >= 10 else f"{scale:g}"


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
      module: the module path the op ran in (``"blocks.0.attn"``), ``"outside modules (...)"`` outside
        every module, ``"loss scale"`` for the multiplication by the loss scale.
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
        scale = "" if self.loss_scale is None else f" at loss scale {_scale_text(self.loss_scale)}"
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
                "the forward, and the same step at loss scale 1, are finite: the loss scale "
                f"{_scale_text(self.loss_scale)} pushed the backward past {where}. A DynamicLossScale backs off "
                "by itself; lower a StaticLossScale (or a DynamicLossScale's initial scale)."
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
    """Checks each op's inputs and outputs until one makes a NaN or an infinity from inputs without them.

    Tensors found finite are remembered (by weak reference) and not checked again as inputs; a view of
    finite tensors is finite without a check; tensors an op writes in place are checked again.
    """

    def __init__(self, modules: _ModuleStack) -> None:
        super().__init__()
        self.modules = modules
        self.index = 0
        self.found: dict[str, Any] | None = None
        self.finite: dict[int, Any] = {}  # id(tensor) -> weakref, for tensors known to be finite

    def _known(self, t: torch.Tensor) -> bool:
        ref = self.finite.get(id(t))
        return ref is not None and ref() is t

    def _state(self, tensors: list[torch.Tensor], scalars: list[float] = ()) -> tuple[bool, bool]:
        """``(has_nan, has_inf)`` over the tensors and Python scalars; finite tensors are remembered."""
        nan = any(math.isnan(s) for s in scalars)
        inf = any(math.isinf(s) for s in scalars)
        for t in tensors:
            if self._known(t):
                continue
            if bool(torch.isfinite(t).all()):
                self.finite[id(t)] = weakref.ref(t)
                continue
            t_nan = bool(torch.isnan(t).any())
            nan, inf = nan or t_nan, inf or not t_nan or bool(torch.isinf(t).any())
        return nan, inf

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self.found is not None:
            return func(*args, **kwargs)
        leaves = torch_pytree.tree_leaves((args, kwargs))
        ins = [x for x in leaves if isinstance(x, torch.Tensor) and x.is_floating_point()]
        scalars = [x for x in leaves if isinstance(x, float)]
        in_nan, in_inf = self._state(ins, scalars)
        mutates = getattr(getattr(func, "_schema", None), "is_mutable", True)
        in_amax = tuple(_amax(x) for x in ins) if mutates else None  # before the op writes its inputs
        out = func(*args, **kwargs)
        outs = _floats(out)
        index, self.index = self.index, self.index + 1
        if mutates:
            for x in ins:
                self.finite.pop(id(x), None)
        elif getattr(func, "is_view", False) and not (in_nan or in_inf):
            for x in outs:
                self.finite[id(x)] = weakref.ref(x)
        if not outs or (in_nan and in_inf):
            return out
        out_nan, out_inf = self._state(outs)
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


def _call(fn: str, loss_fn: Callable[..., Any], params: Any, buffers: Any, batch: Any, has_aux: bool) -> torch.Tensor:
    loss = _loss.as_mean(_loss.call(loss_fn, params, buffers, batch, has_aux=has_aux)[0], fn)  # a LossSum: its mean
    if not isinstance(loss, torch.Tensor) or not loss.is_floating_point() or loss.ndim != 0:
        raise TypeError(
            f"{fn}: loss_fn must return a 0-d floating tensor or a funcamp.LossSum (with has_aux, (loss, aux); with "
            f"buffers, (loss, new_buffers)); got {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}, dtype {loss.dtype}" if isinstance(loss, torch.Tensor) else "")
        )
    return loss


@dataclasses.dataclass
class _Run:
    loss: torch.Tensor
    leaves: list[torch.Tensor]  # the parameters, in torch.utils._pytree order
    names: list[str]
    grads: list[torch.Tensor | None]  # None: the loss does not depend on that parameter


def _forward_backward(
    fn: str,
    mode: Callable[[_ModuleStack], TorchDispatchMode],
    loss_fn: Callable[..., Any],
    params: Any,
    buffers: Any,
    batch: Any,
    loss_scale: LossScale,
    has_aux: bool,
) -> tuple[TorchDispatchMode, _Run]:
    """One eager forward and backward of ``loss_scale.scale(loss)`` under ``mode(module_stack)``."""
    leaves, spec = torch_pytree.tree_flatten(params)
    bad = [i for i, x in enumerate(leaves) if not (isinstance(x, torch.Tensor) and x.is_floating_point())]
    if bad:
        x = leaves[bad[0]]
        what = f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(
            f"{fn}: every leaf of params must be a floating tensor; leaf {bad[0]} is {what}. The call is "
            f"{fn}(loss_fn, params, batch, ...): are params and batch swapped?"
        )
    leaves = [x.detach().requires_grad_() for x in leaves]
    modules = _ModuleStack()
    active = mode(modules)
    with modules.active(), active, torch.enable_grad():
        loss = _call(fn, loss_fn, torch_pytree.tree_unflatten(leaves, spec), buffers, batch, has_aux)
        with modules.labelled(_SCALE):
            scaled = loss_scale.scale(loss)
        _tag_graph(loss, _OUTSIDE)  # first: the loss's own ops; then what is left, the scale's multiplication
        _tag_graph(scaled, _SCALE)
        grads = torch.autograd.grad(scaled, leaves, allow_unused=True) if scaled.requires_grad else [None] * len(leaves)
    return active, _Run(loss.detach(), leaves, _grad_names(params, len(leaves)), list(grads))


def _replay(
    loss_fn: Callable[..., Any], params: Any, buffers: Any, batch: Any, loss_scale: LossScale, has_aux: bool
) -> dict[str, Any]:
    """One eager forward and backward under the locator: what it found, and the loss and gradient checks."""
    locator, run = _forward_backward(
        "find_first_nonfinite", _Locator, loss_fn, params, buffers, batch, loss_scale, has_aux
    )
    grads = [torch.zeros_like(x) if g is None else g for g, x in zip(run.grads, run.leaves)]
    unscaled = [g.to(x.dtype) for g, x in zip(loss_scale.unscale(grads), run.leaves)]
    bad_grad = next((i for i, g in enumerate(unscaled) if not bool(torch.isfinite(g).all())), None)
    return dict(
        found=locator.found,
        loss_finite=bool(torch.isfinite(run.loss)),
        bad_grad=None if bad_grad is None else (run.names[bad_grad], _dtype_name(unscaled[bad_grad].dtype)),
    )


def _grad_names(params: Any, n: int) -> list[str]:
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
    parts = _loss.micro_batches(batch, accumulation_steps, "locate_from_state")  # as the step splits it
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


# --- the dtype lint -------------------------------------------------------------------------------

_HALF = (torch.float16, torch.bfloat16)
#: Equal terms after which a running sum in the dtype stops growing (2 ** significand bits): bfloat16 has 8
#: bits (256 terms), float16 11 (2048). Accumulations of at least this many terms are flagged.
_TERMS = {torch.bfloat16: 256, torch.float16: 2048}
#: Matmul reduction lengths flagged in half precision: the kernels accumulate in float32 and round once,
#: but cuBLAS may reduce split-K partial sums in half (``allow_{fp16,bf16}_reduced_precision_reduction``).
_MATMUL_TERMS = 16384
#: Ops whose result leaves float16's range (max 65504, smallest normal 6.1e-5) for ordinary inputs.
_RANGE_OPS = frozenset(
    "exp exp2 expm1 log log2 log10 log1p pow _softmax _log_softmax _softmax_backward_data "
    "_log_softmax_backward_data reciprocal rsqrt".split()
)
_REDUCTIONS = frozenset("sum mean nansum var std var_mean std_mean linalg_vector_norm norm prod".split())
_MATMULS = {"mm": 0, "bmm": 0, "addmm": 1, "baddbmm": 1, "addbmm": 1}  # op -> position of the left matrix
#: Op families whose forward or backward adds many contributions into one element in the input dtype.
_ACCUMULATING = frozenset(
    "index_add index_put _index_put_impl scatter_add scatter_reduce index_reduce embedding_dense_backward "
    "_embedding_bag _embedding_bag_backward _embedding_bag_dense_backward cumsum cumprod logcumsumexp".split()
)
_CASTS = frozenset(["_to_copy"])  # what .to(dtype), .float(), .half() reach the dispatcher as
_ORDER = ("half-accumulation", "float16-range", "half-reduction", "round-trip", "float32-matmul", "zero-gradient")
_SUGGEST = {
    "half-accumulation": "run it in float32: op_policies={{{op!r}: torch.float32}} (funcamp.ops; functionalize "
    "does this by default for funcamp.ops.FLOAT32_ACCUMULATION)",
    "float16-range": "compute in bfloat16 (float32's range), or op_policies={{{op!r}: torch.float32}}",
    "half-reduction": "reduce in float32: op_policies={{{op!r}: torch.float32}}, or x.float().{op}()",
    "round-trip-narrow": "cast once: module_policies={{{module!r}: 'params=float32,compute=float32,output={half}'}}, "
    "or remove the op override that casts back",
    "round-trip-wide": "drop the pair of casts: run the op in {half}, or keep the tensor in float32",
    "float32-matmul": "if float32 is not needed for accuracy here, let {module} compute in {half} "
    "(remove its module policy or op override)",
}
_TORCH_NAMES = {"mm": "matmul", "bmm": "matmul", "addmm": "matmul", "baddbmm": "matmul", "addbmm": "matmul"}


def _torch_name(op: str) -> str:
    """The name funcamp.ops.OpPolicies knows for an ATen op: ``aten._softmax_backward_data`` -> ``softmax``."""
    name = op.split(" ")[0].removeprefix("aten.").lstrip("_")
    for suffix in ("_backward_data", "_dense_backward", "_backward", "_impl"):
        name = name.removesuffix(suffix)
    return _TORCH_NAMES.get(name, {"linalg_vector_norm": "norm"}.get(name, name))


@dataclasses.dataclass(frozen=True)
class LintFinding:
    """One kind of risky or slow op at one place (see :func:`lint`).

    Attributes:
      kind: ``"half-accumulation"``, ``"float16-range"``, ``"half-reduction"``, ``"round-trip"``,
        ``"float32-matmul"`` or ``"zero-gradient"`` (see :func:`lint`).
      op: the ATen op (``"aten.index_add"``); ``"gradient"`` for ``"zero-gradient"``.
      module: the module path; repeated blocks are folded, ``"blocks.*.attn"`` for every block (an
        fnmatch pattern ``module_policies`` accepts); for ``"zero-gradient"``, the parameter's name.
      dtype: the dtype the op ran in (``"bfloat16"``).
      detail: what was measured: terms accumulated, FLOPs, bytes, amax.
      suggestion: one line: a module policy, a loss scale or an op override (``funcamp.ops``).
      count: how many calls (forward and backward, every folded module) the finding stands for; for
        ``"zero-gradient"``, how many parameters.
      size: the number behind it, the largest over the calls: terms, FLOPs per call, or bytes moved in
        all (round trips); 0 for zero gradients.
    """

    kind: str
    op: str
    module: str
    dtype: str
    detail: str
    suggestion: str
    count: int = 1
    size: int = 0

    def __str__(self) -> str:
        times = f" x{self.count}" if self.count > 1 else ""
        return f"[{self.kind}] {self.module}: {self.op} ({self.dtype}){times}: {self.detail}. {self.suggestion}"


class LintReport(list):
    """The findings of :func:`lint`, a list of :class:`LintFinding`; ``str()`` is a short report.

    The report has one line per finding, accuracy findings first, at most ``max_lines`` (20) lines in
    all: findings past that are counted on the last line.
    """

    max_lines = 20

    def __str__(self) -> str:
        if not self:
            return "funcamp lint: no findings"
        head = f"funcamp lint: {len(self)} finding{'s' if len(self) > 1 else ''}"
        lines = [str(f) for f in self]
        if len(lines) > self.max_lines - 1:
            rest = len(lines) - (self.max_lines - 2)
            lines = [*lines[: self.max_lines - 2], f"... and {rest} more (iterate over the report to see them)"]
        return "\n".join([head, *lines])


def _fold(path: str) -> str:
    """``"blocks.3.attn"`` -> ``"blocks.*.attn"``: repeated blocks as one place (a first segment is kept).

    The result is an fnmatch pattern that ``functionalize(..., module_policies=...)`` accepts.
    """
    first, *rest = path.split(".")
    return ".".join([first, *("*" if part.isdigit() else part for part in rest)])


def _bincount_max(index: Any) -> int:
    if not isinstance(index, torch.Tensor) or index.numel() == 0 or index.is_floating_point():
        return 0
    flat = index.reshape(-1).long()
    return int(torch.bincount(flat - flat.min()).max())


def _accumulated_terms(name: str, args: tuple, kwargs: dict) -> int:
    """The most contributions one output element receives (an upper bound where it is costly to count)."""
    if name in ("cumsum", "cumprod", "logcumsumexp"):
        return int(args[0].shape[args[1]]) if args[0].ndim else 1
    if name == "embedding_dense_backward":
        return _bincount_max(args[1])
    if name in ("_embedding_bag_backward", "_embedding_bag_dense_backward"):
        return _bincount_max(args[1])
    if name == "_embedding_bag":  # the largest bag
        indices, offsets = args[1], args[2]
        bounds = torch.cat([offsets.reshape(-1).long(), torch.tensor([indices.numel()], device=offsets.device)])
        return int(bounds.diff().max()) if bounds.numel() > 1 else indices.numel()
    if name == "index_add":
        return _bincount_max(args[2])
    if name in ("index_put", "_index_put_impl"):
        accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
        indices = [i for i in args[1] if isinstance(i, torch.Tensor)]
        return _bincount_max(indices[0]) if accumulate and len(indices) == 1 else 0
    if name in ("scatter_add", "scatter_reduce", "index_reduce"):
        index = args[2]
        return int(index.shape[args[1]]) if isinstance(index, torch.Tensor) and index.ndim else 0
    return 0


class _Linter(TorchDispatchMode):
    """Records risky and slow ops; findings keyed by (kind, folded module path, op)."""

    def __init__(self, modules: _ModuleStack, min_terms: int | None, min_flops: int) -> None:
        super().__init__()
        self.modules = modules
        self.min_terms = min_terms
        self.min_flops = min_flops
        self.found: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.upcasts: dict[int, tuple[Any, torch.dtype, str]] = {}  # id(out) -> (weakref, source dtype, op)
        self.float32_matmuls: list[tuple[str, str, int]] = []  # (module, op, flops) decided after the run
        self.matmul_flops: dict[torch.dtype, int] = {}

    def _where(self) -> tuple[str, str]:
        backward = _backward_path()
        return (self.modules.path, "") if backward is None else (backward[0], f" ({backward[1]})")

    def _add(self, kind: str, op: str, module: str, dtype: torch.dtype, detail: str, size: int) -> None:
        key = (kind, _fold(module), op)
        entry = self.found.get(key)
        if entry is None:
            self.found[key] = dict(dtype=_dtype_name(dtype), detail=detail, count=1, size=size, module=module)
        else:
            entry["count"] += 1
            if kind == "round-trip":
                entry["size"] += size
            elif size > entry["size"]:
                entry.update(size=size, detail=detail)

    def _terms(self, dtype: torch.dtype) -> int:
        return self.min_terms if self.min_terms is not None else _TERMS[dtype]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(getattr(func, "overloadpacket", func)).removeprefix("aten.").rstrip("_")
        op = f"aten.{name}"
        ins = [x for x in torch_pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        floats = [x for x in ins if x.is_floating_point()]
        outs = _floats(out)
        for x in ins:  # a consumer other than the cast back ends a round trip candidate
            if name not in _CASTS:
                self.upcasts.pop(id(x), None)
        if not outs:
            return out
        dtype = outs[0].dtype
        module, node = self._where()
        if name in _CASTS and floats:
            self._cast(op, floats[0], outs[0], module)
        elif name in _MATMULS and len(args) > _MATMULS[name] + 1:
            self._matmul(op + node, args[_MATMULS[name]], outs[0], module)
        elif dtype in _HALF and name in _ACCUMULATING:
            terms = _accumulated_terms(name, args, kwargs)
            if terms >= self._terms(dtype):
                half = _dtype_name(dtype)
                detail = (
                    f"a running sum over {terms} terms, each output rounded to {half} (differences of outputs cancel)"
                    if name in ("cumsum", "cumprod", "logcumsumexp")
                    else f"adds up to {terms} terms into one {half} element, accumulating in {half}"
                )
                self._add("half-accumulation", op + node, module, dtype, detail, terms)
        elif dtype == torch.float16 and name in _REDUCTIONS and floats:
            terms = floats[0].numel() // max(1, outs[0].numel())
            if terms >= self._terms(dtype):
                amax = _amax(outs[0])
                detail = f"reduces {terms} terms per output element to float16 (max 65504; output amax {amax:.3g})"
                self._add("half-reduction", op + node, module, dtype, detail, terms)
        if name in _RANGE_OPS and (dtype == torch.float16 or any(x.dtype == torch.float16 for x in floats)):
            amax = max((_amax(x) for x in outs), default=0.0)
            detail = f"float16 holds magnitudes 6.1e-05..65504 (output amax {amax:.3g})"
            self._add("float16-range", op + node, module, torch.float16, detail, 0)
        return out

    def _cast(self, op: str, src: torch.Tensor, dst: torch.Tensor, module: str) -> None:
        a, b = src.dtype, dst.dtype
        previous = self.upcasts.pop(id(src), None)
        if previous is not None and previous[0]() is src and previous[1] == b and a != b:
            n = dst.numel()
            moved = n * (2 * b.itemsize + 2 * a.itemsize)  # read + write of each cast
            chain = f"{_dtype_name(b)} -> {_dtype_name(a)} -> {_dtype_name(b)}"
            rounded = f", rounded to {_dtype_name(a)} in between" if a.itemsize < b.itemsize else ""
            self._add("round-trip", "aten._to_copy", module, a, chain + rounded, moved)
            return
        if {a, b} <= {torch.float32, *_HALF} and a != b:
            self.upcasts[id(dst)] = (weakref.ref(dst), a, op)

    def _matmul(self, op: str, left: torch.Tensor, out: torch.Tensor, module: str) -> None:
        k = int(left.shape[-1])
        flops = 2 * out.numel() * k
        self.matmul_flops[out.dtype] = self.matmul_flops.get(out.dtype, 0) + flops
        if out.dtype in _HALF and k >= _MATMUL_TERMS:
            detail = f"reduces K={k} terms per output element; output rounded to {_dtype_name(out.dtype)}"
            self._add("half-accumulation", op, module, out.dtype, detail, k)
        if out.dtype == torch.float32 and flops >= self.min_flops:
            self.float32_matmuls.append((module, op, flops))


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def lint(
    loss_fn: Callable[..., Any],
    params: Any,
    batch: Any,
    policy: Any = None,
    *,
    loss_scale: LossScale | None = None,
    buffers: Any = None,
    has_aux: bool = False,
    min_terms: int | None = None,
    min_flops: int = 2**22,
) -> LintReport:
    """Run one forward and backward eagerly and report ops that are numerically risky or slow for ``policy``.

    Host side, before training: ``loss_fn`` is run once on ``batch`` and differentiated with plain
    ``torch.autograd`` (``loss_scale.scale(loss)``, as the train step does) under a dispatch mode that
    sees every ATen op of the forward and the backward. Findings (kinds):

    - ``half-accumulation``: an op that adds many contributions into one element in bfloat16/float16
      (``index_add``, ``scatter_add``, ``index_put(accumulate=True)``, the backward of ``embedding`` and
      ``embedding_bag``, ``cumsum``...) with at least ``min_terms`` terms (default: 256 for bfloat16,
      2048 for float16, the number of equal terms after which such a sum stops growing); matmuls in
      half precision whose reduced dimension K is at least 16384.
    - ``float16-range``: ``exp``, ``log``, ``pow``, ``softmax``, ``log_softmax`` (and their backwards),
      ``reciprocal``, ``rsqrt`` in float16, whose results leave 6.1e-5..65504 for ordinary inputs.
      Fused ``scaled_dot_product_attention`` kernels are not flagged (they keep the softmax in float32);
      its math fallback reaches the dispatcher as the ops above and is checked like them.
    - ``half-reduction``: ``sum``, ``mean``, ``var``, ``std``, norms in float16 over at least
      ``min_terms`` elements per output element (a float16 sum of 4096 terms of 20 is inf). torch's CPU
      and CUDA reduction kernels accumulate half inputs in float32 and round once, so bfloat16
      reductions (float32's range) are not flagged: their one rounding is that of any bfloat16 op.
    - ``round-trip``: a cast half -> float32 cast straight back (or float32 -> half -> float32), with the
      bytes the two casts move for nothing (an embedding table under ``module_policies={nn.Embedding:
      None}``: cast to bfloat16 by its module's policy, back to float32 by the ``"embedding"`` op rule;
      functionalize's default, :func:`funcamp.nn.float32_lookup`, makes neither cast).
    - ``float32-matmul``: a float32 matmul of at least ``min_flops`` FLOPs while the policy computes in
      half precision (slow: it is what the half policy was chosen to avoid). Without ``policy``, the
      run counts as half precision when any matmul ran in a half dtype.
    - ``zero-gradient``: a parameter whose gradient is exactly zero everywhere, or that the loss does
      not use. Such gradients are computed again at loss scale 2**24 (a second forward and backward,
      without the dispatch mode): non-zero there means they underflow in half precision at this scale.

    Findings are folded by (kind, module path with block indices as ``*``, op) and counted, so the
    report stays short; accuracy findings come first. torch.amp has no such check; TransformerEngine's
    debug features measure tensors during training instead (see :mod:`funcamp.debug`).

    Args:
      loss_fn: as for :func:`funcamp.make_train_step` (``loss_fn(params, batch) -> loss``; with
        ``buffers``, ``loss_fn(params, buffers, batch) -> (loss, new_buffers)``; ``has_aux``).
      params: the parameters, a pytree of floating tensors (not changed).
      batch: a representative batch (shapes matter: reduction lengths and FLOPs come from it).
      policy: the precision policy (or its string) ``loss_fn`` computes under, for ``float32-matmul``.
      loss_scale: the loss scale to differentiate with (``zero-gradient`` depends on it).
      buffers: model buffers, or None.
      has_aux: whether the loss comes with aux data.
      min_terms: the accumulation length flagged in half precision (default per dtype, see above).
      min_flops: the smallest float32 matmul (FLOPs per call) flagged in a half-precision policy.
    Returns:
      A :class:`LintReport` (a list of :class:`LintFinding`); ``print`` it.
    Raises:
      TypeError: if ``loss_fn`` is not callable, ``loss_scale`` is not a funcamp loss scale, a leaf of
        ``params`` is not a floating tensor, or ``loss_fn`` does not return a 0-d floating loss.
      ValueError: if ``policy`` does not parse, or ``min_terms`` / ``min_flops`` is not a positive int.

    Example:
      >>> x = torch.randn(4096, dtype=torch.bfloat16)
      >>> report = lint(lambda p, x: (x.cumsum(0).float() * p["w"]).mean(), {"w": torch.ones(())}, x)
      >>> [(f.kind, f.op, f.dtype) for f in report]
      [('half-accumulation', 'aten.cumsum', 'bfloat16')]
    """
    if not callable(loss_fn):
        raise TypeError(f"lint: loss_fn must be callable, got {type(loss_fn).__name__}")
    loss_scale = NoOpLossScale() if loss_scale is None else loss_scale
    if not isinstance(loss_scale, LossScale):
        raise TypeError(f"lint: loss_scale must be a funcamp loss scale, got {type(loss_scale).__name__}")
    for arg, value in (("min_terms", min_terms), ("min_flops", min_flops)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"lint: {arg} must be a positive int, got {value!r}")
    compute = None if policy is None else get_policy(policy).compute_dtype
    linter, run = _forward_backward(
        "lint",
        lambda modules: _Linter(modules, min_terms, min_flops),
        loss_fn,
        params,
        buffers,
        batch,
        loss_scale,
        has_aux,
    )
    if compute is None:  # half precision if any matmul ran in a half dtype (the one with the most FLOPs)
        half = {d: f for d, f in linter.matmul_flops.items() if d in _HALF}
        compute = max(half, key=half.get) if half else None
    if compute in _HALF:
        for module, op, flops in linter.float32_matmuls:
            detail = f"{flops / 1e6:.3g} MFLOP per call in float32 while the policy computes in {_dtype_name(compute)}"
            linter._add("float32-matmul", op, module, torch.float32, detail, flops)
    findings = [_finding(kind, op, path, entry, compute) for (kind, path, op), entry in linter.found.items()]
    findings += _zero_gradients(run, loss_scale, loss_fn, params, buffers, batch, has_aux)
    findings.sort(key=lambda f: (_ORDER.index(f.kind), f.module, f.op))
    return LintReport(findings)


def _finding(kind: str, op: str, path: str, entry: dict[str, Any], compute: torch.dtype | None) -> LintFinding:
    key = kind
    if kind == "round-trip":
        key = "round-trip-narrow" if entry["dtype"] in ("float16", "bfloat16") else "round-trip-wide"
    half = _dtype_name(compute) if compute in _HALF else entry["dtype"] if kind == "round-trip" else "bfloat16"
    suggestion = _SUGGEST[key].format(op=_torch_name(op), module=path, half=half)
    if kind == "round-trip":  # the bytes of every call
        entry = {**entry, "detail": f"{entry['detail']}: {_bytes(entry['size'])} moved for nothing"}
    return LintFinding(kind, op, path, entry["dtype"], entry["detail"], suggestion, entry["count"], entry["size"])


_PROBE_SCALE = 2.0**24


def _zero_gradients(
    run: _Run, loss_scale: LossScale, loss_fn: Callable[..., Any], params: Any, buffers: Any, batch: Any, has_aux: bool
) -> list[LintFinding]:
    zero = [i for i, g in enumerate(run.grads) if g is not None and g.numel() and not bool(g.any())]
    rescued: set[int] = set()
    scale = 1.0 if isinstance(loss_scale, NoOpLossScale) else float(loss_scale.loss_scale)
    if zero and scale < _PROBE_SCALE:  # underflow or a dead path? Try again with a large loss scale.
        probe = StaticLossScale(_PROBE_SCALE).to(run.loss.device)
        _, again = _forward_backward(
            "lint", lambda m: contextlib.nullcontext(), loss_fn, params, buffers, batch, probe, has_aux
        )
        rescued = {i for i in zero if again.grads[i] is not None and bool(again.grads[i].any())}
    folded: dict[tuple[str, str, str, str], int] = {}  # (name pattern, dtype, detail, hint) -> parameters
    for i, (name, leaf, grad) in enumerate(zip(run.names, run.leaves, run.grads)):
        if grad is None:
            detail, hint = (
                "the loss does not use this parameter",
                "freeze it (functionalize(..., trainable=...)) or check the forward",
            )
        elif i in rescued:
            detail = f"gradient is 0 everywhere at loss scale {scale:g}, non-zero at 2**24: it underflows"
            hint = "use a loss scale (funcamp.DynamicLossScale(2.0**15)) or compute in bfloat16"
        elif i in zero:
            detail, hint = "gradient is 0 everywhere", "a dead path (ReLU, zero init, detach): check the forward"
        else:
            continue
        key = (_fold(name), _dtype_name(leaf.dtype), detail, hint)
        folded[key] = folded.get(key, 0) + 1
    return [LintFinding("zero-gradient", "gradient", *key, count=n) for key, n in folded.items()]
