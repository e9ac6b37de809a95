"""``functionalize``: a plan of small parts assembled, and the one ``apply_fn`` it returns.

The parts, in the order they apply: the ``fp8=`` part of the policy string converts the model
(:func:`_with_fp8`); :class:`funcamp.nn._plan.Plan` says which policy each module and tensor follows;
:mod:`funcamp.nn._store` copies what ``apply_fn`` is made from (trainable masters, frozen or int8
tensors, buffers); :mod:`funcamp.nn._wrappers` builds the module copy with its per-module wrappers
(each parameter made into its forward tensor where its module uses it, :mod:`funcamp.nn._use`; the
casts of a module with a policy of its own; ``remat``) and the per-op mode; :class:`_Apply` runs one
call. The module you pass is never changed, nor kept alive.
"""

from __future__ import annotations

import contextlib
import logging
import types
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from funcamp import _scope, quant
from funcamp.nn import _deferred, _remat, _scan, _store, _use, _wrappers
from funcamp.nn._plan import HALF, ModulePolicies, Plan, PolicyLike, check_module
from funcamp.nn._reductions import buffer_reductions
from funcamp.nn._store import Trainable, sample
from funcamp.ops import OpRule
from funcamp.policy import Policy, _split_fp8, get_policy

_log = logging.getLogger("funcamp.nn")

__all__ = ["Functional", "FunctionalWithBuffers", "functionalize"]


class Functional(NamedTuple):
    """What :func:`functionalize` returns without ``with_buffers=True``; unpacks as ``apply_fn, params``.

    Attributes:
      apply_fn: ``apply_fn(params, *args, **kwargs) -> out`` (attributes ``frozen``, ``forward_dtypes``,
        ``aliases``, ``remat``: see :func:`functionalize`).
      params: the trainable parameters by qualified name, floating ones in their param dtype.
    """

    apply_fn: Callable[..., Any]
    params: dict[str, torch.Tensor]


class FunctionalWithBuffers(NamedTuple):
    """What :func:`functionalize` returns with ``with_buffers=True``; unpacks as ``apply_fn, params, buffers``.

    Attributes:
      apply_fn: ``apply_fn(params, buffers, *args, **kwargs) -> (out, new_buffers)``.
      params: the trainable parameters by qualified name, floating ones in their param dtype.
      buffers: the persistent buffers by qualified name (``{}`` for a model without any).
    """

    apply_fn: Callable[..., Any]
    params: dict[str, torch.Tensor]
    buffers: dict[str, torch.Tensor]


# --- functionalize --------------------------------------------------------------------------------


def functionalize(
    module: nn.Module,
    policy: PolicyLike,
    *,
    module_policies: ModulePolicies | None = None,
    autocast: bool = False,
    training: bool | None = None,
    with_buffers: bool | None = None,
    trainable: Trainable = None,
    op_policies: Mapping[Any, OpRule | None] | None = None,
    quantize: quant.Int8WeightOnlyConfig | None = None,
    remat: _remat.RematLike = None,
    scan: _scan.ScanLike = None,
) -> Functional | FunctionalWithBuffers:
    """Turn ``module`` into a pure function of its parameters (and buffers), under a precision policy.

    The number of values follows the arguments, not the model: :class:`FunctionalWithBuffers`
    ``(apply_fn, params, buffers)`` with ``with_buffers=True``, else :class:`Functional` ``(apply_fn,
    params)``. ``apply_fn(params, *args, **kwargs) -> out`` (or ``apply_fn(params, buffers, *args, **kwargs)
    -> (out, new_buffers)``) is pure: ``params``, ``buffers`` and ``module`` are never changed. ``params``
    are detached copies of the trainable parameters in their policy's ``param_dtype`` (a tied weight once,
    under its first name); frozen ones are constants of ``apply_fn`` (``apply_fn.frozen``). Floating inputs
    are cast to the compute dtype, each parameter to the compute dtype of the module that uses it, where it
    uses it, and the output to the output dtype; norms follow :func:`keep_in_float32`, embeddings
    :func:`float32_lookup`. The rules in full (frozen tensors, buffers, the casting and autocast modes,
    checkpointing, where parameters become forward tensors): docs/module.md, "What functionalize does".
    Callables your ``__init__`` stores that reach the module (minGPT's ``self.mlpf = lambda x: ...``, a
    closure over ``self.mlp``; partials, bound methods, hooks) run on the copy, with the tensors of the call
    (:mod:`funcamp.nn._copy`); what cannot is refused by name.

    Args:
      module: the model; left unchanged (same parameters, dtypes, training flag, no hooks).
      policy: a :class:`funcamp.Policy` or a policy string for the whole model. A string may hold one
        ``fp8=<recipe>`` part (``"p=f32,c=bf16,o=f32,fp8=delayed"``): the model is then functionalized as
        :func:`funcamp.fp8.convert` ``(module, recipe)`` (every Linear but the first and the last; for
        another choice call ``convert`` yourself), with :data:`funcamp.fp8.MODULE_POLICIES` after your
        ``module_policies``. ``fp8=delayed`` needs ``with_buffers=True`` (its state is buffers).
      module_policies: ``{module type or name pattern: policy}``; first match wins, before the norm
        and embedding defaults. A type matches its instances; a string (fnmatch syntax) matches qualified module names
        (the module and everything under it follows the policy) and parameter names. A parameter name
        pattern changes where that tensor is stored (``param_dtype``, ``reduce_dtype``): its module
        still computes with it in the module's compute dtype (``{"*.bias": "float32"}`` keeps float32
        master biases that enter a bf16 Linear in bf16). Values: a Policy, a policy string, a function
        of the surrounding policy (such as :func:`keep_in_float32`), or ``None`` to follow the
        surrounding module (``{nn.LayerNorm: None}`` turns the norm default off for LayerNorm,
        ``{nn.Embedding: None}`` the embedding default).
      autocast: run under ``torch.autocast`` instead of casting parameters where they are used, with no rule of
        funcamp's own (see above).
      training: the training flag ``apply_fn`` runs with (dropout, BatchNorm statistics), set on the
        internal copy; ``None`` keeps each submodule's flag as it is now. ``functionalize(model.eval(),
        ...)`` works too, but changes your module's flag; ``training=False`` does not.
      with_buffers: ``True``: the buffer form (an empty dict for a model without buffers);
        ``False``: the short form, the buffers being constants whose in-place updates are discarded
        (inference, frozen statistics); ``None`` (default): the short form for a model without
        persistent buffers, the buffer form with a ``FutureWarning`` for one with them.
      trainable: which parameters go into ``params`` (the rest are frozen): ``None`` (default), each
        parameter's ``requires_grad`` (torch's own marking: ``requires_grad_(False)`` on a tensor or a
        submodule); ``True``, all of them; a name pattern or a list of them (fnmatch; a pattern selects
        a parameter when it matches its qualified name or the name of a module holding it, so
        ``"lm_head"``, ``"lm_head.*"`` and ``"*.bias"`` all work); or a predicate
        ``trainable(name, tensor) -> bool`` (``tensor`` is your module's). Given patterns or a
        predicate decide alone (``requires_grad`` is then ignored). A tied parameter is trainable
        when any of its names is selected.
      op_policies: per-op dtypes inside the forward, ``{op name or torch function: dtype | rule |
        None}`` (see :class:`funcamp.ops.OpPolicies`). In the casting mode they are added to the
        default :data:`funcamp.ops.FLOAT32_ACCUMULATION` (ops whose backward accumulates many terms,
        such as embedding and log_softmax, run in float32 when they see half-precision inputs);
        ``None`` as a rule removes a default one. Under ``autocast=True`` only your rules apply
        (``op_policies=funcamp.ops.FLOAT32_ACCUMULATION`` adds the defaults), and a rule wins over
        autocast's op lists. The mode is entered only where the model computes in a half dtype
        somewhere or rules were given.
      quantize: ``None``, or a :class:`funcamp.quant.Int8WeightOnlyConfig` choosing frozen matrices
        (Linear, Hugging Face ``Conv1D``, optionally embeddings) to store in int8 with per-output-channel
        float32 absmax scales (``apply_fn.frozen[name]`` is then a :class:`funcamp.quant.Int8Weight`),
        dequantized at each call into the compute dtype of the module using them (in both casting
        modes), so gradients reach the trainable tensors through them. The chosen weights must be
        frozen. Storage only: during a call the dequantized copies exist as any compute-dtype copy does
        (the forward is the model's own, not an int8 matmul). See :mod:`funcamp.quant` for the error
        bound and the differences from bitsandbytes (``load_in_8bit``) and torchao.
      remat: activation checkpointing of chosen submodules without editing the model: ``None`` (default);
        an ``nn.Module`` subclass; an fnmatch pattern of qualified module names; a list mixing the two; a
        predicate ``remat(name, module) -> bool``; or :class:`funcamp.nn.Remat` ``(one of those, budget=b)``.
        Gradients are bitwise those without ``remat`` (docs/module.md, docs/memory.md).
      scan: ``None`` (default), or the qualified name (fnmatch pattern, or a list of them) of a ``ModuleList``
        or ``Sequential`` of identical blocks: under ``torch.compile`` their forward tensors are stacked on a
        leading layer axis and one block runs over them with ``torch._higher_order_ops.scan``, so that the
        block is traced and compiled once; eagerly they run as written. ``params`` keeps one leaf per layer.
        A ``ModuleList`` must be applied as ``for block in blocks: x = block(x, *same_args)``. Differentiable
        inside ``torch.compile`` by Dynamo-traced ``torch.autograd.grad`` (the compiled train step's route), not
        by ``torch.func`` transforms. A ``ModuleList``'s use is read from the source of the modules above it
        (:mod:`funcamp.nn._scan_contract`): a loop that does anything else per layer is refused, never computed
        otherwise. ``"auto"``: every run of two or more modules of one class that passes these checks and
        :func:`funcamp.nn._scan.rule` (at least :data:`funcamp.nn._scan.AUTO_MIN_LAYERS` layers, on a CPU) is
        scanned; the others stay unrolled, and why is in ``apply_fn.scan_report`` and one ``funcamp.nn`` log
        line each. See :mod:`funcamp.nn._scan` and docs/module.md.
    Returns:
      :class:`Functional` ``(apply_fn, params)`` or :class:`FunctionalWithBuffers` ``(apply_fn, params,
      buffers)`` (named tuples), see above. ``apply_fn.frozen`` is a
      read-only dict of the frozen tensors (empty when everything is trainable); with buffers,
      ``apply_fn.buffer_reductions`` the reductions over ranks their modules declare, for
      ``TrainState.create(..., buffer_reductions=...)`` (:func:`funcamp.nn._reductions.buffer_reductions`);
      ``apply_fn.forward_dtypes`` the dtype each parameter and buffer enters the forward in, by name
      (tied uses under each name, listed in ``apply_fn.aliases``), from which
      :func:`funcamp.memory.memory_report` ``(params, apply_fn=apply_fn)`` counts the compute copies;
      ``apply_fn.remat`` the qualified names of the checkpointed modules (a tuple, empty without ``remat``);
      ``apply_fn.scan`` those of the scanned runs (a tuple) and ``apply_fn.scan_report`` a read-only
      ``{run: "scanned: ..." or "unrolled: <why>"}`` of what ``scan=`` decided.
    Raises:
      TypeError: if ``module`` is not an ``nn.Module``, ``module_policies`` is malformed, or the module
        cannot be deep-copied.
      TypeError: if an attribute reaches your module, a parameter or a persistent buffer other than
        through the module structure, or holds a module with parameters that is not registered (named).
      TypeError: if ``trainable`` is not one of the forms above, or its predicate returns a non-bool.
      ValueError: if a policy string does not parse; if a ``trainable`` pattern or the predicate
        selects no parameter.
      ValueError: if the ``fp8=`` part names an unknown recipe or is given twice, or is ``delayed``
        without ``with_buffers=True``.
      TypeError: if ``with_buffers`` is not None, True or False.
      ValueError: if a weight chosen by ``quantize`` is trainable (int8 weights are frozen), or
        ``quantize`` selects nothing (see :meth:`funcamp.quant.Int8WeightOnlyConfig.select`).
      TypeError: if ``quantize`` is not an ``Int8WeightOnlyConfig``, or one of its name patterns
        matches only modules that cannot take int8 (norms, convolutions).
      TypeError: if ``remat`` (or an entry of its list) is not one of the forms above (a ``Remat`` inside a
        list is not), or its predicate returns a non-bool.
      ValueError: if a ``remat`` type or pattern matches no submodule, or its predicate chooses none, or
        ``remat="auto"`` (not offered, see :class:`funcamp.nn.Remat`).
      TypeError, ValueError: from :class:`funcamp.nn.Remat` for a budget that is not a number in ``[0, 1]``.
      TypeError: if ``scan`` is not None, ``"auto"``, a str or a list of str, or names a module that is not a
        ``ModuleList`` or ``Sequential``.
      ValueError: if a named ``ModuleList`` is used, in the code of the modules above it, other than as
        ``for layer in <run>: x = layer(x, <same further arguments>)``, or that code cannot be read.
      ValueError: if a ``scan`` pattern matches no submodule, or the run's layers differ (class, shapes, dtypes,
        policies, plain attributes, buffers) or hold what a scan does not support yet (hooks, persistent
        buffers, frozen or int8 or tied tensors, fp8 layers, ``remat`` on or around it, ``autocast=True``);
        at call time, under a sharded layout.
      ValueError: at call time, if ``params`` or ``buffers`` do not have the module's names (a frozen
        name in ``params`` is named as such).
      TypeError: at call time, if ``params`` or ``buffers`` is not a dict.

    Example:
      >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
      >>> apply_fn, params = functionalize(model, "params=float32,compute=bfloat16,output=float32")
      >>> params["0.weight"].dtype, params["1.weight"].dtype
      (torch.float32, torch.float32)
      >>> out = apply_fn(params, torch.ones(3, 4))
      >>> out.dtype, out.shape
      (torch.float32, torch.Size([3, 2]))
      >>> grads = torch.func.grad(lambda p, x: apply_fn(p, x).sum())(params, torch.ones(3, 4))
      >>> grads["0.weight"].dtype
      torch.float32

      Fine-tune the last layer only:

      >>> apply_fn, params = functionalize(model, "params=float32,compute=bfloat16,output=float32", trainable="2")
      >>> sorted(params), sorted(apply_fn.frozen), apply_fn.frozen["0.weight"].dtype
      (['2.bias', '2.weight'], ['0.bias', '0.weight', '1.bias', '1.weight'], torch.bfloat16)
    """
    check_module(module)
    module, policy, module_policies = _with_fp8(module, policy, module_policies, with_buffers)
    policy = get_policy(policy)
    plan = Plan(module, policy, module_policies)
    explicit = _explicit(with_buffers, module, plan)
    chosen = _store.trainable_names(module, plan, trainable)
    store = _store.store(module, plan, chosen, _store.int8_names(module, quantize, chosen), autocast)
    remat_names = _remat.select(module, remat)
    _remat.install()
    uses = _use.Uses(store.frozen, store.int8, store.forward_dtypes, plan.aliases)
    budgets = dict.fromkeys(remat_names, _remat.budget(remat))
    scan_names, scan_report = _scan.choose(
        module,
        scan,
        lambda name: _scan.check(
            module,
            name,
            plan,
            frozen=store.frozen,
            int8=store.int8,
            forward_dtypes=store.forward_dtypes,
            remat=remat_names,
            autocast=autocast,
        ),
    )
    if scan == "auto":
        for name, decided in scan_report.items():
            _log.info("functionalize(scan='auto'): %s %s", name, decided)
    op_mode = _wrappers.op_mode(policy, op_policies, autocast, store.forward_dtypes)
    skeleton = _wrappers.skeleton(module, plan, uses, autocast=autocast, training=training, remat=budgets, mode=op_mode)
    if not scan_names:  # a scanned run refuses hooks (they would run the first layer's for every layer)
        _deferred.install(skeleton)  # transformers' first-forward hooks, installed under a lock Dynamo cannot enter
    _scan.install(skeleton, scan_names, uses, op_mode)
    run = _Apply(skeleton, plan, policy, autocast, store, uses, op_mode)
    if explicit:

        def apply_fn(
            params: Mapping[str, torch.Tensor], buffers: Mapping[str, torch.Tensor], /, *args: Any, **kwargs: Any
        ) -> tuple[Any, dict[str, torch.Tensor]]:
            return run(params, buffers, args, kwargs)

        _describe(apply_fn, store, plan, remat_names, scan_names, scan_report)
        apply_fn.buffer_reductions = buffer_reductions(module, plan.buffers)  # type: ignore[attr-defined]
        return FunctionalWithBuffers(apply_fn, store.params, store.buffers)

    constants = store.buffers  # not the whole store: apply_fn must not keep the masters it returned alive

    def apply_fn(params: Mapping[str, torch.Tensor], /, *args: Any, **kwargs: Any) -> Any:  # type: ignore[misc]
        return run(params, constants, args, kwargs)[0]  # the buffers as constants

    _describe(apply_fn, store, plan, remat_names, scan_names, scan_report)
    return Functional(apply_fn, store.params)


class _Apply:
    """One call of ``apply_fn``: ``(out, new_buffers)`` of the module copy on ``params`` and ``buffers``."""

    def __init__(
        self,
        skeleton: nn.Module,
        plan: Plan,
        policy: Policy,
        autocast: bool,
        store: _store.Store,
        uses: _use.Uses,
        op_mode: Callable[[], contextlib.AbstractContextManager[Any]],
    ) -> None:
        self.skeleton, self.plan, self.policy, self.autocast = skeleton, plan, policy, autocast
        # What a call reads of the store, not the store: the masters (store.params) are the caller's, and
        # holding them would keep a second copy of every parameter alive once the training state moves on
        # (a whole one on every rank of a sharded job).
        self.forward_dtypes, self.frozen = store.forward_dtypes, store.frozen
        self.uses, self.op_mode = uses, op_mode
        self.slots = _use.slots(skeleton)
        self.train_names = list(store.params)
        self.stored_dtypes = {name: b.dtype for name, b in store.buffers.items()}

    def __call__(
        self, params: Mapping[str, torch.Tensor], state: Mapping[str, torch.Tensor], args: Any, kwargs: Any
    ) -> tuple[Any, dict[str, torch.Tensor]]:
        plan, dtypes = self.plan, self.forward_dtypes
        _check_keys("params", params, self.train_names, self.frozen)
        _check_keys("buffers", state, plan.buffers)
        # Fresh tensors: the module's in-place updates (running statistics) must not reach the caller's.
        # A tied buffer is the same fresh tensor under every name. Parameters are not bound here: each
        # module binds its own when first called (funcamp.nn._use), from ``params`` pushed below.
        tensors = _fresh_buffers(plan, state, dtypes)
        eager = not _scope.compiling()
        call = None
        if eager:  # a checkpointed region's recompute runs with these tensors
            call = _remat.Call(
                self.skeleton,
                lambda: _pushed(self.uses, params),
                lambda: _fresh_buffers(plan, state, dtypes),
                self.op_mode,
                tensors,
            )
        self.uses.push(params, eager=eager)
        try:
            if not eager:  # every use made and bound up front (see funcamp.nn._use)
                self.uses.bind_all(self.slots)
            with _remat.inside(call) if call is not None else contextlib.nullcontext(), self.op_mode():
                out = self._forward(tensors, params, args, kwargs)
        finally:
            self.uses.pop()
        # functional_call writes attribute reassignments back into the dict it was given.
        new_state = {name: tensors[name].to(self.stored_dtypes[name]) for name in plan.buffers}
        return _wrappers.cast_io(out, self.policy.output_dtype), new_state

    def _forward(self, tensors: dict[str, torch.Tensor], params: Any, args: Any, kwargs: Any) -> Any:
        """The copy's forward with ``tensors`` (the buffers) bound: under autocast, or on inputs cast."""
        policy = self.policy
        if self.autocast:
            half = policy.compute_dtype in HALF
            device = _wrappers.device_type(params, args, kwargs)
            with _wrappers.autocast_on(device, dtype=policy.compute_dtype if half else None, enabled=half):
                return torch.func.functional_call(self.skeleton, tensors, tuple(args), kwargs, tie_weights=False)
        args, kwargs = _wrappers.cast_io((tuple(args), kwargs), policy.compute_dtype)
        return torch.func.functional_call(self.skeleton, tensors, args, kwargs, tie_weights=False)


def _explicit(with_buffers: bool | None, module: nn.Module, plan: Plan) -> bool:
    """Whether ``apply_fn`` takes and returns the buffers; ``with_buffers=None`` on a model with them warns."""
    if with_buffers is not None:
        if not isinstance(with_buffers, bool):
            raise TypeError(f"functionalize: with_buffers must be None, True or False, got {with_buffers!r}")
        return with_buffers
    if plan.buffers:
        warnings.warn(
            f"functionalize: {type(module).__name__} has persistent buffers ({sample(plan.buffers)}), so without "
            "with_buffers this returns three values, (apply_fn, params, buffers), with apply_fn(params, buffers, "
            "*args) -> (out, new_buffers); pass with_buffers=True for that form (or with_buffers=False to hold the "
            "buffers as constants). The number of values is to follow the arguments, not the model: a future "
            "version raises here instead of choosing",
            FutureWarning,
            stacklevel=3,
        )
    return bool(plan.buffers)


def _with_fp8(
    module: nn.Module, policy: PolicyLike, module_policies: ModulePolicies | None, with_buffers: bool | None
) -> tuple[nn.Module, PolicyLike, ModulePolicies | None]:
    """The model, dtype policy and module policies after the ``fp8=<recipe>`` part of a policy string.

    ``fp8=R`` makes the model ``fp8.convert(module, R)`` (every Linear but the first and the last) and
    puts :data:`funcamp.fp8.MODULE_POLICIES` after yours; without it nothing changes.

    Raises:
      ValueError: if the recipe is unknown or given twice, or is ``delayed`` without ``with_buffers=True``.
      TypeError: if ``module_policies`` is not a mapping.
    """
    if not isinstance(policy, str) or "fp8" not in policy.lower():
        return module, policy, module_policies
    from funcamp import fp8  # a feature: imported when a policy string asks for it

    rest, recipe = _split_fp8(policy)
    if recipe is None:
        return module, policy, module_policies
    r = fp8.get_recipe(recipe)
    if r.scaling == "delayed" and with_buffers is not True:
        raise ValueError(
            f"functionalize: fp8={recipe} keeps an amax history and a scale per fp8 layer as buffers that every "
            "call updates, so apply_fn must take and return them: pass with_buffers=True (apply_fn(params, "
            "buffers, *args) -> (out, new_buffers); TrainState.create(..., buffers=buffers) carries them), or "
            "use fp8=tensorwise or fp8=rowwise, which keep no state"
        )
    if module_policies is not None and not isinstance(module_policies, Mapping):
        raise TypeError(
            "functionalize: module_policies must be None or a dict from module types or names to policies "
            f"(merged over fp8.MODULE_POLICIES), got {type(module_policies).__name__}"
        )
    merged = dict(module_policies or {})  # yours first: the first entry that matches a module wins
    for key, value in fp8.MODULE_POLICIES.items():
        merged.setdefault(key, value)
    return fp8.convert(module, r), rest, merged


@contextlib.contextmanager
def _pushed(uses: _use.Uses, params: Mapping[str, torch.Tensor]) -> Iterator[None]:
    """``params`` as the trainable tensors the module wrappers make their uses from (a recompute's: eager)."""
    uses.push(params, eager=True)
    try:
        yield
    finally:
        uses.pop()


def _describe(
    apply_fn: Any, store: _store.Store, plan: Plan, remat: list[str], scanned: list[str], scan: Mapping[str, str]
) -> None:
    """``apply_fn.frozen``, ``.forward_dtypes``, ``.aliases``, ``.scan_report`` (read-only), ``.remat`` and
    ``.scan``."""
    apply_fn.frozen = types.MappingProxyType(store.frozen)
    apply_fn.forward_dtypes = types.MappingProxyType(
        {name: store.forward_dtypes[name] for name in [*plan.params, *plan.buffers, *plan.aliases]}
    )
    apply_fn.aliases = types.MappingProxyType(dict(plan.aliases))
    apply_fn.remat = tuple(remat)
    apply_fn.scan = tuple(scanned)
    apply_fn.scan_report = types.MappingProxyType(dict(scan))


def _check_keys(what: str, got: Mapping[str, Any], expected: list[str], frozen: Iterable[str] = ()) -> None:
    if not isinstance(got, Mapping):
        hint = (
            " (this module has buffers: call apply_fn(params, buffers, *args, **kwargs))" if what == "buffers" else ""
        )
        if hasattr(got, "buffers") and hasattr(got, "storage"):  # a flat train state's buffers, in a step body
            hint = " (a flat train state's buffers: inside a step body, pass state.param_tree(), not state.params)"
        raise TypeError(f"apply_fn: {what} must be a dict of tensors by name, got {type(got).__name__}{hint}")
    if got.keys() != set(expected):
        missing = sorted(set(expected) - got.keys())
        unexpected = sorted(got.keys() - set(expected))
        held = sorted(set(unexpected) & set(frozen))
        hint = (
            f"; {held} are frozen (held by apply_fn, see apply_fn.frozen): leave them out of params, or choose "
            "them with functionalize(..., trainable=...)"
            if held
            else ""
        )
        raise ValueError(
            f"apply_fn: {what} do not match the module: missing {missing}, unexpected {unexpected}; pass the "
            f"{what} functionalize returned (or a tree_map of them){hint}"
        )


def _fresh_buffers(
    plan: Plan, state: Mapping[str, torch.Tensor], dtypes: Mapping[str, torch.dtype]
) -> dict[str, torch.Tensor]:
    """Buffers as they were when the call began (fresh copies: a recompute must not update them twice)."""
    fresh = {name: _use.to_forward(b, dtypes[name], copy=True) for name, b in state.items()}
    fresh.update({alias: fresh[name] for alias, name in plan.aliases.items() if name in fresh})
    return fresh
