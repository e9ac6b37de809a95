"""``scan=``: a run of identical blocks traced and compiled once, as one scan over their stacked parameters.

A model's layers (a ``ModuleList`` its forward loops over, or a ``Sequential``) are the same module ``L`` times
with different tensors. Unrolled, ``torch.compile`` traces, differentiates and compiles each of them; flax's
``nn.scan`` and Haiku's ``layer_stack`` instead stack the layers' parameters on a leading layer axis and run one
layer's code over that axis, so that tracing and compiling cost one layer. ``functionalize(..., scan="blocks")``
does that inside a compiled ``apply_fn``: the run's forward tensors (each parameter made where it is used, as for
every module: cast to its forward dtype) are ``torch.stack``-ed, and ``torch._higher_order_ops.scan`` runs the
first layer's module over them (``torch.func.functional_call`` on its slices). Nothing else changes: ``params``
keeps one leaf per layer and name (``blocks.3.attn.qkv.weight``), so optimizer states, checkpoints, telemetry
groups, ``load_into`` and every name a user sees stay per layer; the stack's backward hands each layer's
gradient back to its own leaf.

Only in a compiled step (``funcamp._scope.compiling()``: the step's plan, or ``torch.compile`` tracing): eagerly
the layers run one after the other as written, so the compiled step's gradients can be compared with the eager
step's. On torch 2.13 a scan can be
differentiated inside ``torch.compile`` by Dynamo-traced ``torch.autograd.grad`` (the compiled train step's
route, :mod:`funcamp._dynamo_autograd`), not by ``torch.func`` transforms ("Expected FakeTensor").

The contract of a ``ModuleList``: the forward applies every layer once, in order, each to the previous layer's
output, with the same further arguments (``for block in self.blocks: x = block(x, mask)``), and does nothing
else per layer. Under compile the loop runs once, over one object that applies the whole run; a slice of the
list (``for layer in self.layers[: config.num_hidden_layers]``, Hugging Face's Llama loop) applies exactly the
sliced layers as one scan (a slice of a ``Sequential`` runs its layers one after the other; Hugging Face's Llama
and Mistral layers each hold their own index, ``self_attn.layer_idx``, so their runs are refused as differing).
The contract is
read from the source of the modules above the run (:mod:`funcamp.nn._scan_contract`). What can be checked is
checked when ``functionalize`` is called, and refused with the run's name: a loop that is not the contract's,
layers of different classes, shapes, dtypes, policies or plain attributes (the scan runs the first layer's Python
code for all),
hooks, persistent buffers, non-persistent buffers that differ, frozen or int8 tensors, tied tensors, fp8
layers, ``remat=`` on or around the run, ``autocast=True``; at call time, a sharded layout (it gathers each
layer where it is used; stacking would hold every layer gathered at once) and a layer output that is not one
tensor of its input's shape and dtype.
"""

from __future__ import annotations

import contextlib
import fnmatch
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from funcamp import _scope
from funcamp.nn import _scan_contract, _use
from funcamp.nn._plan import Plan

__all__ = ["AUTO_MIN_LAYERS", "Refused", "ScanLike", "check", "choose", "install", "select"]

#: ``scan=``: ``None``, ``"auto"``, or qualified names (fnmatch patterns) of ``ModuleList`` / ``Sequential`` runs.
ScanLike = str | Sequence[str] | None

#: ``scan="auto"`` stacks a run of at least this many layers, on a CPU. Measured on a quiet Intel Xeon (AVX-512
#: with AMX, 2 cores, torch 2.13.0+cpu; ``python benchmarks/bench_scan.py --layers 2,4,12 --backends inductor
#: --threads 2``, ``benchmarks/results/bench_scan_xeon.json``; ``examples/gpt.py``'s block, width 128): the
#: scanned step's first call took 1.25x / 0.89x / 0.64x the unrolled one's at 2 / 4 / 12 layers, and its steady
#: step 1.31x / 1.15x / 1.14x (torch's scan copies the saved activations, reversed, for its backward; the compiled
#: train step reads them in place since, :mod:`funcamp.passes.scan_reversal`, which that benchmark's own step does
#: not run: GPT-2 124M's body scanned, 1.03x the unrolled step, docs/benchmarks.md). Below this
#: depth the first call saves little or costs more, and the steady step is slower everywhere.
AUTO_MIN_LAYERS = 8
_AUTO_DEVICES = ("cpu",)


def select(module: nn.Module, scan: ScanLike) -> list[str]:
    """The qualified names of the runs ``scan`` chooses (outermost only), in module order.

    Raises:
      TypeError: if ``scan`` is not None, a str or a sequence of str; if a chosen module is not a
        ``ModuleList`` or ``Sequential``.
      ValueError: if a pattern matches no module.
    """
    if scan is None:
        return []
    if scan == "auto":
        return _runs(module)
    patterns = [scan] if isinstance(scan, str) else scan
    if not isinstance(patterns, Sequence) or not all(isinstance(p, str) for p in patterns):
        raise TypeError(
            "functionalize: scan must be None, 'auto', a qualified module name (fnmatch pattern, e.g. 'blocks' or "
            f"'model.layers') or a list of them, naming ModuleList or Sequential runs of identical blocks; got {scan!r}"
        )
    named = dict(module.named_modules())
    chosen: list[str] = []
    for pattern in patterns:
        hits = [name for name in named if name and fnmatch.fnmatchcase(name, pattern)]
        if not hits:
            runs = [n for n, m in named.items() if isinstance(m, (nn.ModuleList, nn.Sequential))]
            raise ValueError(
                f"functionalize: scan={pattern!r} matches no submodule of {type(module).__name__}; "
                f"its ModuleList and Sequential modules are {runs[:8]}"
            )
        for name in hits:
            if not isinstance(named[name], (nn.ModuleList, nn.Sequential)):
                raise TypeError(
                    f"functionalize: scan={pattern!r} matches {name!r}, a {type(named[name]).__name__}; scan takes "
                    "a ModuleList or Sequential of identical blocks"
                )
            if name not in chosen:
                chosen.append(name)
    return [n for n in chosen if not any(n.startswith(o + ".") for o in chosen if o != n)]


class Refused(ValueError):
    """:func:`check`'s refusal of the run ``name``, for the reason ``why`` (``scan="auto"`` reports ``why``)."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"functionalize: scan={name!r} cannot stack this run: {why}")
        self.why = why


def _runs(module: nn.Module) -> list[str]:
    """The outermost ``ModuleList`` / ``Sequential`` runs of two or more modules of one class, with parameters:
    ``"auto"``'s candidates."""
    found: list[str] = []
    for name, m in module.named_modules():
        if not name or any(name.startswith(f + ".") for f in found):
            continue
        layers = list(m._modules.values()) if isinstance(m, (nn.ModuleList, nn.Sequential)) else []
        same = len(layers) >= 2 and all(type(x) is type(layers[0]) for x in layers)
        if same and next(layers[0].parameters(), None) is not None:
            found.append(name)
    return found


def choose(module: nn.Module, scan: ScanLike, check_run: Callable[[str], None]) -> tuple[list[str], dict[str, str]]:
    """``(runs to scan, {run: what was decided and why})``. Named runs are checked (``check_run`` raises);
    under ``"auto"`` each candidate that passes the checks is scanned when :func:`rule` says so, and a refusal
    becomes the reason it is not.

    Raises:
      TypeError, ValueError: from :func:`select`, and ``check_run``'s :class:`Refused`, for named runs.
    """
    names = select(module, scan)
    report: dict[str, str] = {}
    chosen: list[str] = []
    for name in names:
        if scan != "auto":
            check_run(name)
            chosen.append(name)
            report[name] = "scanned (asked: scan=)"
            continue
        try:
            check_run(name)
        except Refused as e:
            report[name] = f"unrolled: {e.why}"
            continue
        why = rule(module, name)
        if why is None:
            chosen.append(name)
            report[name] = f"scanned: {len(module.get_submodule(name))} layers >= {AUTO_MIN_LAYERS} (scan='auto')"
        else:
            report[name] = f"unrolled: {why}"
    return chosen, report


def rule(module: nn.Module, name: str) -> str | None:
    """Why ``scan="auto"`` leaves the (checked) run at ``name`` unrolled, or None to scan it: at least
    :data:`AUTO_MIN_LAYERS` layers, parameters on a CPU (the only devices measured)."""
    run = module.get_submodule(name)
    layers = len(run)
    if layers < AUTO_MIN_LAYERS:
        return (
            f"{layers} layers < {AUTO_MIN_LAYERS} (scan='auto': below that the first call saves little and the "
            "steady step is slower; scan= names a run to stack it anyway)"
        )
    devices = {t.device.type for t in run.parameters()}
    if not devices <= set(_AUTO_DEVICES):
        return (
            f"parameters on {sorted(devices)}; scan='auto' has been measured on CPUs only (scan= names a run to "
            "stack it)"
        )
    return None


def check(
    module: nn.Module,
    name: str,
    plan: Plan,
    *,
    frozen: Any,
    int8: Any,
    forward_dtypes: Any,
    remat: Sequence[str],
    autocast: bool,
) -> None:
    """Refuse, naming the run, what a scan over ``module.get_submodule(name)`` would not compute as written.

    Raises:
      ValueError: for each condition of the module docstring (one message per condition, naming the run and
        the first layer that differs).
    """
    run = module.get_submodule(name)
    layers = list(run._modules.items())

    def refuse(why: str) -> None:
        raise Refused(name, why)

    if type(run) not in (nn.ModuleList, nn.Sequential):
        overridden = type(run).__iter__ is not nn.ModuleList.__iter__ if isinstance(run, nn.ModuleList) else True
        if isinstance(run, nn.Sequential):
            overridden = (
                type(run).forward is not nn.Sequential.forward or type(run).__iter__ is not nn.Sequential.__iter__
            )
        if overridden:
            refuse(f"{type(run).__name__} overrides how the run is applied (its forward or __iter__)")
    if len(layers) < 2 or any(m is None for _, m in layers):
        refuse(f"it holds {len(layers)} layer(s); a scan needs two or more")
    if isinstance(run, nn.ModuleList):
        why = _scan_contract.violation(module, name)
        if why is not None:
            refuse(why)
    if autocast:
        refuse("autocast=True is not supported in a scanned run yet (use the default casting mode)")
    for r in remat:
        if r == name or r.startswith(name + ".") or name.startswith(r + ".") or r == "":
            refuse(
                f"remat= checkpoints {r or 'the root'!r}, on or around the run; recomputation inside a scan is not "
                "supported yet"
            )
    first_key, first = layers[0]
    base = f"{name}.{first_key}"
    signature = _signature(first, plan, base, forward_dtypes)
    for key, layer in layers:
        prefix = f"{name}.{key}"
        for sub_name, sub in layer.named_modules():
            where = f"{prefix}.{sub_name}" if sub_name else prefix
            if type(sub).__module__ == "funcamp.fp8":
                refuse(f"{where} is an fp8 layer ({type(sub).__name__}); fp8 layers are not supported in a scan yet")
            if sub._forward_hooks or sub._forward_pre_hooks or sub._backward_hooks:
                refuse(f"{where} has hooks; the scan would run the first layer's hooks for every layer")
        for pname, _ in layer.named_parameters(remove_duplicate=False):
            full = f"{prefix}.{pname}"
            if full in frozen or full in int8:
                refuse(
                    f"{full} is frozen{' (int8)' if full in int8 else ''}; frozen and int8 tensors in a scanned "
                    "run are not supported yet"
                )
        tied = [a for a, m in plan.aliases.items() if a.startswith(prefix + ".") or m.startswith(prefix + ".")]
        if tied:
            refuse(f"{tied[0]} is tied to {plan.aliases[tied[0]]}; tied tensors in a scanned run are not supported")
        persistent = [b for b in plan.buffers if b.startswith(prefix + ".")]
        if persistent:
            refuse(f"{persistent[0]} is a persistent buffer; buffers a scanned run updates are not supported yet")
        theirs = _signature(layer, plan, prefix, forward_dtypes)
        if theirs != signature:
            refuse(
                f"{prefix} differs from {base} in {_difference(theirs, signature)}; a scan runs the first layer's "
                "code on every layer's tensors"
            )
        for bname, b in layer.named_buffers():
            other = first.get_buffer(bname)
            if b is not other and not (b.shape == other.shape and b.dtype == other.dtype and torch.equal(b, other)):
                refuse(f"the buffer {prefix}.{bname} differs from {base}.{bname}")


def _signature(layer: nn.Module, plan: Plan, prefix: str, forward_dtypes: Any) -> dict[str, Any]:
    """What must be equal across a run's layers: classes, plain attributes, tensors' metadata, policies."""
    modules = [
        (
            rel,
            type(m),
            m.training,
            _attributes(m),
            plan.modules[f"{prefix}.{rel}" if rel else prefix],
            (f"{prefix}.{rel}" if rel else prefix) in plan.own,
        )
        for rel, m in layer.named_modules()
    ]
    params = [
        (rel, tuple(p.shape), p.dtype, forward_dtypes[f"{prefix}.{rel}"], plan.tensors[f"{prefix}.{rel}"])
        for rel, p in layer.named_parameters()
    ]
    buffers = [(rel, tuple(b.shape), b.dtype) for rel, b in layer.named_buffers()]
    return {"modules": modules, "parameters": params, "buffers": buffers}


_FIELDS = {
    "modules": ("name", "class", "training flag", "attributes", "policy", "own policy"),
    "parameters": ("name", "shape", "dtype", "forward dtype", "policy"),
    "buffers": ("name", "shape", "dtype"),
}


def _difference(theirs: dict[str, Any], first: dict[str, Any]) -> str:
    """The first place two :func:`_signature` differ, in a few words: which submodule, parameter or buffer, which
    field (for plain attributes, which attribute), and both values."""
    for kind, fields in _FIELDS.items():
        a, b = theirs[kind], first[kind]
        if len(a) != len(b):
            return f"its number of {kind}: {len(a)} vs {len(b)}"
        for x, y in zip(a, b, strict=True):
            if x == y:
                continue
            where = f"{kind[:-1]} {x[0] or '(the layer itself)'}"
            for field, u, v in zip(fields, x, y, strict=True):
                if u == v:
                    continue
                if field == "attributes":
                    du, dv = dict(u), dict(v)
                    key = next((k for k in (*du, *dv) if du.get(k) != dv.get(k)), None)
                    if key is not None:
                        return f"{where}'s attribute {key}: {du.get(key)!r} vs {dv.get(key)!r}"
                return f"{where}'s {field}: {u!r} vs {v!r}"
    return "structure"


def _attributes(module: nn.Module) -> tuple[tuple[str, Any], ...]:
    """The module's plain attributes (not parameters, buffers, submodules or torch's private state), compared with
    ``==`` where that gives a bool, else by identity."""
    out = []
    for key, value in sorted(vars(module).items()):
        if key.startswith("_") or key == "training":
            continue
        out.append((key, _Comparable(value)))
    return tuple(out)


class _Comparable:
    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Comparable):
            return NotImplemented
        a, b = self.value, other.value
        if a is b:
            return True
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return False
        try:
            same = a == b
        except Exception:
            return False
        return same if isinstance(same, bool) else False

    def __repr__(self) -> str:
        return repr(self.value)


def install(skeleton: nn.Module, names: Sequence[str], uses: _use.Uses, mode: Any = contextlib.nullcontext) -> None:
    """Make each chosen run of the module copy apply itself as one scan under ``torch.compile``; ``mode`` is the
    forward's per-op precision (:func:`funcamp.nn._wrappers.op_mode`), entered again inside the scanned body."""
    for name in names:
        run = skeleton.get_submodule(name)
        scanned = _Scanned(name, list(run._modules.items()), uses, mode)
        if isinstance(run, nn.Sequential):
            forward = run.forward

            def sequential(x: Any, scanned: _Scanned = scanned, forward: Any = forward) -> Any:
                return scanned(x) if _scope.compiling() else forward(x)

            run.forward = sequential
        else:
            run.__class__ = type(f"Scanned{type(run).__name__}", (_ScannedList, type(run)), {})
            run._funcamp_scanned = scanned


class _ScannedList(nn.ModuleList):
    """A ``ModuleList`` whose iteration under ``torch.compile`` yields one object that applies the whole run.

    A slice (``self.layers[: config.num_hidden_layers]``, Hugging Face's Llama, Mistral and Qwen2 loop) is a
    list of the same kind over the sliced layers, applying exactly those as one scan (none for an empty slice).
    """

    _funcamp_scanned: _Scanned

    def __iter__(self) -> Any:
        if _scope.compiling():
            return iter([self._funcamp_scanned] if self._funcamp_scanned.keys else [])
        return super().__iter__()

    def __getitem__(self, idx: Any) -> Any:
        got = super().__getitem__(idx)
        if isinstance(idx, slice):  # ModuleList makes a new list of this class, numbered from 0
            got._funcamp_scanned = self._funcamp_scanned.sliced(idx)
        return got


class _Scanned:
    """``scanned(x, *args, **kwargs)``: every layer of a run applied to ``x`` in order, as one scan."""

    def __init__(
        self, name: str, layers: list[tuple[str, nn.Module]], uses: _use.Uses, mode: Any = contextlib.nullcontext
    ) -> None:
        self.name, self.uses, self.mode = name, uses, mode
        self.keys = [key for key, _ in layers]  # the layers' keys in the run (their parameters' names)
        self.template = layers[0][1]
        self.locals = [local for local, _ in self.template.named_parameters()]

    def sliced(self, idx: slice) -> _Scanned:
        """The same run over ``keys[idx]``: the layers a slice of the list holds (the template stays: every layer
        runs its code, checked equal)."""
        part = _Scanned.__new__(_Scanned)
        part.name, part.uses, part.template, part.locals = self.name, self.uses, self.template, self.locals
        part.mode = self.mode
        part.keys = self.keys[idx]
        return part

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        from torch._higher_order_ops import scan

        if not isinstance(x, torch.Tensor):
            raise TypeError(
                f"funcamp.nn: scan={self.name!r}: a layer's first argument must be the tensor the layers carry, "
                f"got {type(x).__name__}"
            )
        layout = _scope.current()
        if isinstance(layout, _scope.GathersAtUse):
            raise ValueError(
                f"funcamp.nn: scan={self.name!r} under a sharded layout ({type(layout).__name__}) is not supported: it "
                "gathers each layer where it is used, and a scan would hold every layer gathered at once; "
                "functionalize without scan="
            )
        stacked = {
            local: torch.stack([self.uses.at_use(f"{self.name}.{key}.{local}") for key in self.keys])
            for local in self.locals
        }
        template, name = self.template, self.name
        # The forward's per-op precision again, where Dynamo traces this call: it traces the scan's body without
        # the torch-function modes entered around the forward (measured: {"scaled_dot_product_attention": float32}
        # was dropped in the compiled scanned step, silently, while the eager step applied it). Called eagerly
        # (capture.check's trace), the scan operator compiles its body alone, where entering a mode is a side
        # effect Dynamo refuses ("Attempted to mutate TorchFunctionModeStackVariable").
        mode = self.mode if torch.compiler.is_dynamo_compiling() else contextlib.nullcontext

        def body(h: torch.Tensor, p: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
            with mode():
                out = torch.func.functional_call(template, p, (h, *args), kwargs, tie_weights=False)
            if not isinstance(out, torch.Tensor) or out.shape != h.shape or out.dtype != h.dtype:
                raise TypeError(
                    f"funcamp.nn: scan={name!r}: a layer must return one tensor of its input's shape and dtype "
                    f"{tuple(h.shape)} {h.dtype}, got {_describe(out)}"
                )
            return out, h.new_zeros(())

        out, _ = scan(body, x, stacked)
        return out


def _describe(out: Any) -> str:
    if isinstance(out, torch.Tensor):
        return f"{tuple(out.shape)} {out.dtype}"
    return type(out).__name__
