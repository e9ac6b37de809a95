"""Parameters materialized where their module uses them: the one function, the binding hook, the placeholder.

``apply_fn`` does not turn every parameter into its forward tensor up front. Each parameter slot of
the internal module copy holds a placeholder (:class:`Unbound`: shape and forward dtype, no data), and
a forward pre-hook of each module binds, when that module is first called (before your own hooks and
its forward run), the forward tensors of the module's own parameters, made by :meth:`Uses.at_use` from
what is stored (the trainable tensor passed to ``apply_fn``, or the frozen / int8 one ``apply_fn``
holds); when ``apply_fn``'s call ends the placeholders are back. A parameter read before its module is
called or without calling it (``nn.MultiheadAttention`` passes
``self.out_proj.weight`` to a function; a tied head written ``h @ self.wte.weight.T``; a helper given
the module) is made where it is read: while an eager call runs, each module's slots are a
:class:`_Reading` dict, so every read of a slot (``module.weight``, ``parameters()``,
``named_parameters()``, ``_parameters[...]``, from any forward, hook, helper or closure) gives the use,
made by the same function. So no placeholder reaches an operation that does not call
``__torch_function__``: ``torch.autograd.Function.apply`` hands its inputs over as they are (a
straight-through estimator on a submodule's weight, applied in the parent's forward, got the placeholder
and trained with a zero gradient). A placeholder reached some other way still makes the use at the first
torch operation on it. The forward tensor of a name is made once per call, and with gradients on even
where its first read has them off (``no_grad``, ``inference_mode``, a Function's forward), since later uses
take it again: a module run twice uses it twice, as when every tensor was made up front (and autograd keeps
each for the backward either way, so binding to the end of the call costs nothing more).

:meth:`Uses.at_use` first asks the process layout the step runs under (:func:`funcamp._scope.current`)
for ``param_at_use(name, stored)``: a sharded layout gathers the parameter there (its backward
reduce-scatters), so that each module's parameters are gathered where they are used (FSDP's per-module
all-gather). Outside every step, and for layouts without it, the stored tensor is used as it is.

Under ``torch.compile`` every use is made up front instead, by the same function, and bound for the
whole forward (the graph is the one of before this module): dynamo traces a ``torch.utils.checkpoint``
region in the model into a higher-order operator that refuses any change to a module made inside it
("HOP: Unsafe side effect"), which binding a module called in the region is. In a compiled graph the order of the casts
(and of a layout's gathers) is the compiler's to schedule.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from funcamp import _scope, quant


class Uses:
    """What a use of a parameter is made from, the one function that makes it, and where it is bound.

    ``frozen``: the frozen tensors ``apply_fn`` holds (int8 ones as :class:`funcamp.quant.Int8Weight`),
    by first name; ``int8``: the names stored in int8; ``forward_dtypes``: the dtype each name (tied
    uses under each of theirs) enters the forward in; ``aliases``: further name -> first name. A call
    (:meth:`push` to :meth:`pop`: ``apply_fn``'s forward, and each checkpointed region's recompute, see
    :class:`funcamp.nn._remat.Call`) holds the trainable tensors, the uses made so far and the slots
    bound so far, which :meth:`pop` puts back.
    """

    def __init__(
        self,
        frozen: Mapping[str, Any],
        int8: Mapping[str, int],
        forward_dtypes: Mapping[str, torch.dtype],
        aliases: Mapping[str, str],
    ) -> None:
        self.frozen = frozen
        self.int8 = int8
        self.forward_dtypes = forward_dtypes
        self.aliases = aliases
        # The calls in progress, innermost last; plain lists and dicts, which torch.compile traces.
        self._calls: list[_CallUses] = []
        self._holders: list[nn.Module] = []
        # While an eager call runs: (module, its plain slot dict) for each holder, whose _Reading stands in.
        self._reading: list[tuple[nn.Module, dict[str, Any]]] = []
        # Each holder's binding pre-hook (bind_at_call), registered while an eager call runs and only then: a
        # module with a hook takes the hooks path of nn.Module's call, which torch.compile traces for every call.
        self._pre_hooks: list[tuple[nn.Module, Any]] = []
        self._handles: list[Any] = []

    def hold(self, holders: list[nn.Module]) -> None:
        """The modules of the copy that hold parameter slots (each once): what an eager call reads through."""
        self._holders = holders

    def push(self, params: Mapping[str, torch.Tensor], *, eager: bool = False) -> None:
        """Begin a call with the trainable tensors ``params``. ``eager`` (a call not traced by ``torch.compile``,
        decided by its caller): every read of a parameter slot, by any path, gives the slot's use
        (:class:`_Reading`), and a use first made with gradients off is made with them on (:meth:`at_use`)."""
        if eager and not self._reading:
            self._reading = [(m, m.__dict__["_parameters"]) for m in self._holders]
            for m, slots in self._reading:
                m.__dict__["_parameters"] = _Reading(slots)
            self._handles = [m.register_forward_pre_hook(hook, prepend=True) for m, hook in self._pre_hooks]
        self._calls.append(_CallUses(params, {}, {}, eager))

    def pop(self) -> None:
        """End the innermost call: every slot it bound holds its placeholder again."""
        call = self._calls.pop()
        for holder, local, before in reversed(list(call.bound.values())):
            holder._parameters[local] = before
        if not self._calls and self._reading:  # the outermost eager call ends: the plain slots again
            for m, slots in self._reading:
                m.__dict__["_parameters"] = slots
            self._reading = []
            for handle in self._handles:
                handle.remove()
            self._handles = []

    def bind(self, slots: list[tuple[nn.Module, str, str]]) -> None:
        """Put the forward tensor of each slot's use into the slot, until the call ends (once per call)."""
        call = self._calls[-1]
        for holder, local, name in slots:
            key = (id(holder), local)
            if key not in call.bound:
                call.bound[key] = (holder, local, dict.__getitem__(holder._parameters, local))
                holder._parameters[local] = self.at_use(name)

    def bind_all(self, slots: list[tuple[nn.Module, str, str]]) -> None:
        """A compiled call's :meth:`bind` of every slot up front, before any is bound: the same uses, made by
        :meth:`_make` with the layout asked once (traced by Dynamo for each parameter: two frames a parameter where
        :meth:`bind` inlines four)."""
        call = self._calls[-1]
        made, bound = call.made, call.bound
        layout = _scope.current()
        for holder, local, name in slots:
            bound[(id(holder), local)] = (holder, local, dict.__getitem__(holder._parameters, local))
            holder._parameters[local] = made[name] if name in made else self._make(made, name, layout)

    def at_use(self, name: str) -> torch.Tensor:
        """The forward tensor of one use of the parameter ``name`` (a first name or a tied alias).

        The stored value, under the parameter's first name (the key of ``params`` or ``apply_fn.frozen``),
        goes first to the active layout's ``param_at_use(first_name, stored)`` where it has one (a gather
        of a shard), then is cast to the use's forward dtype (an int8 weight dequantized into it).

        Made once per name and call: a module that runs twice in one forward (a block applied twice)
        uses the same forward tensor both times, so that the gradients of its uses are added in the
        compute dtype before the cast's backward, as when every tensor was made up front; a tied
        parameter used under two names is made twice (each name's use its own cast, the gradients
        added in the parameter dtype). A checkpointed region's recompute makes its uses again.
        """
        call = self._calls[-1]
        if name in call.made:
            return call.made[name]
        if call.eager and (not torch.is_grad_enabled() or torch.is_inference_mode_enabled()):
            # A first read with gradients off (under no_grad or inference_mode, in a Function's forward): the
            # use is made for the whole call, so it is made with its autograd history, as the parameter has it.
            with torch.inference_mode(False), torch.enable_grad():
                return self._make(call.made, name, _scope.current())
        return self._make(call.made, name, _scope.current())

    def _make(self, made: dict[str, torch.Tensor], name: str, layout: Any) -> torch.Tensor:
        """``name``'s use under ``layout`` (:func:`funcamp._scope.current`), kept in ``made``."""
        first = self.aliases.get(name, name)
        stored = self.frozen[first] if first in self.frozen else self._calls[-1].params[first]
        if isinstance(layout, _scope.GathersAtUse):
            stored = layout.param_at_use(first, stored)
        dtype = self.forward_dtypes[name]
        made[name] = quant.dequantize_int8(stored, dtype) if first in self.int8 else to_forward(stored, dtype)
        return made[name]


class _CallUses(NamedTuple):
    params: Mapping[str, torch.Tensor]  # the trainable tensors passed to apply_fn
    made: dict[str, torch.Tensor]  # name -> its forward tensor, made at the first use
    bound: dict[tuple[int, str], tuple[nn.Module, str, Any]]  # (id(module), local name) -> what was there
    eager: bool  # not traced by torch.compile (see Uses.push)


class _Reading(dict):
    """A module's parameter slots while an eager call of ``apply_fn`` runs: a read of a slot that holds its
    placeholder gives the use :meth:`Uses.at_use` makes for it (made once per call).

    Every way of reaching a parameter reads a slot: ``module.weight`` (``nn.Module.__getattr__``),
    ``parameters()`` and ``named_parameters()`` (``items()``), ``_parameters[...]``, from the module's own
    forward, its parent's, a hook, a helper or a closure given the module. So no placeholder reaches an operation
    that does not call ``__torch_function__``: ``torch.autograd.Function.apply`` hands its inputs to the
    Function as they are, and a placeholder there would take the gradient that belongs to the parameter (a
    straight-through estimator on a submodule's weight, applied in its parent's forward, trained with a zero
    gradient). Not installed under ``torch.compile``, where every slot is bound before the forward.
    """

    __slots__ = ()

    def __getitem__(self, key: str) -> Any:
        return _read(dict.__getitem__(self, key))

    def get(self, key: str, default: Any = None) -> Any:
        return _read(dict.get(self, key, default))

    def items(self) -> list[tuple[str, Any]]:  # type: ignore[override]
        return [(k, _read(v)) for k, v in dict.items(self)]

    def values(self) -> list[Any]:  # type: ignore[override]
        return [_read(v) for v in dict.values(self)]


def _read(value: Any) -> Any:
    return _made(value) if isinstance(value, Unbound) else value


def to_forward(tensor: torch.Tensor, dtype: torch.dtype, copy: bool = False) -> torch.Tensor:
    """``tensor`` in ``dtype`` if it is floating (a new tensor with ``copy``), else as it is (cloned with ``copy``)."""
    if not tensor.is_floating_point():
        return tensor.clone() if copy else tensor
    if copy:
        return tensor.to(dtype, copy=True)
    # ``to`` of the dtype a tensor has returns it: no call, so that a compiled step's graph holds no such node
    return tensor if tensor.dtype == dtype else tensor.to(dtype)


def slots(skeleton: nn.Module) -> list[tuple[nn.Module, str, str]]:
    """``(module, local name, qualified name)`` of every parameter slot of the copy (each distinct module once,
    under its first name: the second module of a tied weight names its slot with the weight's alias)."""
    names = {id(m): name for name, m in skeleton.named_modules()}
    return [
        (m, local, f"{names[id(m)]}.{local}" if names[id(m)] else local)
        for m in skeleton.modules()
        for local, p in m._parameters.items()
        if p is not None
    ]


def bind_at_call(module: nn.Module, slots: list[tuple[nn.Module, str, str]], uses: Uses) -> None:
    """Bind ``module``'s own slots when it is first called in a call of ``apply_fn``; they stay bound until
    that call ends.

    Twice, the second time a no-op within one call: in a forward pre-hook run before yours (so your hooks
    see the parameters too), and in the innermost wrapper of its forward, which is what a checkpointed
    region recomputes (its recompute is a call of its own, and a custom ``autograd.Function`` such as an
    fp8 matmul would save the placeholder itself). The pre-hook is registered while an eager call runs
    (:meth:`Uses.push` to :meth:`Uses.pop`), never while ``torch.compile`` traces one, which binds every use up
    front: a hook sends each call of the module through ``nn.Module``'s hooks path, which Dynamo traces (8,512
    bytecode instructions of GPT-2 124M's unrolled step).
    """
    forward = module.forward

    def pre_hook(module: nn.Module, args: Any) -> None:
        if not _scope.compiling():  # apply_fn bound every use up front (see the module docstring)
            uses.bind(slots)

    @functools.wraps(forward)
    def bound(*args: Any, **kwargs: Any) -> Any:
        if not _scope.compiling():
            uses.bind(slots)
        return forward(*args, **kwargs)

    uses._pre_hooks.append((module, pre_hook))
    module.forward = bound


#: Tensor attributes read from a placeholder as they are (the metadata of the tensor its use would get).
_METADATA = frozenset({"shape", "dtype", "device", "requires_grad", "is_leaf", "ndim", "layout", "grad", "grad_fn"})
_METADATA_METHODS = frozenset(
    {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.element_size}
    | {torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.__len__, torch.Tensor.__repr__}
    | {torch.Tensor.stride, torch.Tensor.is_contiguous, torch.Tensor.__format__}
)


class Unbound(torch.Tensor):
    """The placeholder of a parameter slot of the module copy: shape, forward dtype and name, no data.

    Metadata reads (``shape``, ``dtype``, ``requires_grad``; ``parameters()`` read for Hugging Face's
    ``self.dtype``) see the tensor that use would get (the device is ``meta``). A torch operation on it
    during a call (a parameter read outside the forward of the module holding it) computes with the
    forward tensor :meth:`Uses.at_use` makes for it, so the read works as when every tensor was bound up
    front; outside every call it raises, naming the parameter.
    """

    @staticmethod
    def __new__(cls, shape: torch.Size, dtype: torch.dtype, name: str, uses: Uses, requires_grad: bool) -> Unbound:
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device="meta", requires_grad=requires_grad)
        t.param_name, t.uses, t._is_param = name, uses, True  # _is_param: isinstance(t, nn.Parameter) holds
        return t

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Unbound({self.param_name!r}, shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        owner = getattr(func, "__self__", None)
        if func in _METADATA_METHODS or getattr(owner, "__name__", None) in _METADATA and func.__name__ == "__get__":
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = torch.utils._pytree.tree_map_only(Unbound, _made, (args, kwargs))
        return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        names = sorted({a.param_name for a in leaves if isinstance(a, Unbound)})
        raise RuntimeError(f"funcamp.nn: {func} on the placeholder of {', '.join(map(repr, names))}: {_OUTSIDE}")


_OUTSIDE = (
    "functionalize's module copy holds placeholders for the parameters, made into tensors only while "
    "apply_fn runs; call apply_fn instead of the copy"
)


def _made(t: Unbound) -> torch.Tensor:
    if not t.uses._calls:
        raise RuntimeError(f"funcamp.nn: the parameter {t.param_name!r} was used outside apply_fn: {_OUTSIDE}")
    return t.uses.at_use(t.param_name)
