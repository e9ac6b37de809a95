"""A differential tester of the train step: draw a configuration, run it, compare it with the eager reference.

A :class:`Config` picks one value per feature of the step (optimizer chain and wrappers, accumulation, a mean or
a :class:`funcamp.LossSum`, ``has_aux`` with aux that aliases the state, buffers, frozen and int8 storage, fp8
recipes, remat and budgets, donation, telemetry, the skip limit, the backend; issue 47's storage axes: an aux that
reads a state tensor through the loss's closure, a state built from a module's detached parameters, a width at
which no parameter is a multiple of 16 floats, flat or per-leaf storage or the two alternating, a step compiled
again from a warm inductor cache) and a poisoned step or none.
:func:`configs` is the hypothesis strategy over them; :func:`check` runs one and raises :class:`Mismatch` with
every difference it finds. Only public API is used (``funcamp``, ``funcamp.optim``, ``funcamp.nn``), plus
``tests/_reference_step.py``, the frozen copy of the step before the stages redesign.

What is compared (the documented equalities):

* ``R``, the reference: ``tests/_reference_step.make_train_step(compile=False)`` on the model without ``remat``
  (eager remat gives gradients bitwise those without it, docs/module.md), pure, with the same loss, optimizer,
  accumulation, aux, skip limit and telemetry.
* ``T``, the configuration's step. Eager: every state leaf and metric bitwise ``R``'s (docs/memory.md: donation
  is bitwise the undonated step; docs/module.md: eager remat is bitwise; tests/test_stages.py: the assembled step
  is bitwise the reference). Compiled: within :data:`BOUNDS` of ``R`` (the bounds tests/test_train.py states for
  compiled against eager), the discrete values (``grads_finite``, counters, the loss scale, ``step``) exactly;
  and where the docs promise bitwise equality between two compiled steps (donation: docs/memory.md; remat with
  float32 compute or under aot_eager, where nothing is recomputed: docs/module.md), bitwise the same backend's
  step without donation and remat (``C``).
* Aliasing (docs/training.md, docs/memory.md): a pure step never changes its input state or batch, not even at
  later steps; a donating step returns a state on the given state's tensors and the given state is consumed
  (``TrainState.replace`` raises ``DonatedStateError``); every metric and aux leaf, read after the whole run,
  holds what its step used (compared with ``R``'s).
* A compiled step does not recompile after its first call (DESIGN.md), over skips and scale changes (with
  ``storage="alternate"``: after its first call on each storage).
* Storage (docs/internals.md, docs/memory.md): a compiled step over per-leaf storage, and one whose states
  alternate between the storages (each loaded with ``funcamp.checkpoint`` into a state of the other), are the same
  step over the other storage, bitwise but for the global norm's round-off (:data:`STORAGE_BOUND`: flat storage
  sums it per row of its buffers); a state built from a module's parameters leaves them as they were when
  it is flat (``TrainState.create`` copies), and a donating per-leaf one writes each new state into them.
* A step compiled again (Dynamo reset) from the caches of the first compile, its closure given a copy instead of
  the state's own tensor (other input aliasing), is bitwise the first (``warm``, inductor).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import tempfile
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import _reference_step as reference
import optree
import torch
from hypothesis import strategies as st

import funcamp as fa
from funcamp import optim
from funcamp.nn import Remat
from funcamp.quant import Int8WeightOnlyConfig
from funcamp.train import DonatedStateError

STEPS = 3
BATCH = 16
#: ``loss="sum_half"``: the total and count times this (counts of 259 to 555, most not bfloat16 numbers).
COUNT_FACTOR = 37
HALF = {"float32": torch.bfloat16, "bfloat16": torch.bfloat16, "float16": torch.float16}
#: The ``loss`` metric against the float64 item mean (docs/numerics.md, token-weighted losses: float32 round-off).
LOSS_RTOL = 2.0**-18

#: Compiled against eager: (rtol, atol) by backend, as tests/test_train.py states them (aot_eager: float32
#: round-off over a few steps; inductor: its fused kernels keep half-precision chains in float32).
BOUNDS = {"aot_eager": (1e-5, 1e-6), "inductor": (2e-2, 2e-3)}
#: In half-precision compute a compiled step rounds at other points than the eager one: the inductor bound.
HALF_BOUND = (2e-2, 2e-3)
#: Flat storage sums the global norm per row of its gradient buffers, a per-leaf state per leaf: the same step over
#: the two storages differs by that round-off where the norm enters (the grad_norm metric, a clip's factor), and is
#: otherwise bitwise (tests/test_flat.py holds that split).
STORAGE_BOUND = (1e-5, 1e-7)


class Pair(NamedTuple):
    """A NamedTuple in the aux (aux nesting)."""

    weight: Any
    value: Any


@dataclasses.dataclass(frozen=True)
class Config:
    """One point of the feature space (printable, hashable)."""

    compute: str = "float32"  # compute dtype: float32, bfloat16, float16
    params: str = "float32"  # master dtype: float32, bfloat16 (bfloat16 with bfloat16 compute only)
    loss_scale: tuple = ("none",)  # ("none",), ("static", log2), ("dynamic", log2, period)
    opt: tuple = ("sgd", 0.1, None, False)  # see build_optimizer
    k: int = 1  # accumulation_steps
    loss: str = "mean"  # mean, sum (LossSum) or sum_half (LossSum of a half total, see COUNT_FACTOR)
    aux: str | None = None  # None or a key of AUX
    batchnorm: bool = False  # BatchNorm1d running statistics as buffers
    frozen: bool = False  # fc2 frozen
    int8: bool = False  # fc2.weight stored in int8 (frozen)
    fp8: str | None = None  # None, tensorwise, rowwise, delayed
    remat: float | None = None  # None or the budget of Remat("block", budget)
    donate: bool = False
    telemetry: int | None = None
    skips: int | None = None  # max_consecutive_skips
    backend: str = "eager"  # eager, aot_eager, inductor
    poison: tuple | None = None  # None or (step, value): value (inf/nan) in the first micro-batch of that step
    closure: str | None = None  # None, "param", "moment": the loss's aux reads a state tensor through a closure
    start: str = "create"  # "create" (functionalize's params, cloned) or "module" (a module's detached parameters)
    width: int = 16  # the hidden width; 13: no parameter a multiple of 16 floats (padding, alignment); not fp8
    storage: str = "flat"  # "flat", "leaf" (FUNCAMP_FLAT=off), "alternate" (each step's state loaded into the other)
    warm: bool = False  # inductor: the step compiled again (Dynamo reset) from the warm caches, bitwise the first

    @property
    def has_aux(self) -> bool:
        return self.aux is not None or self.closure is not None

    @property
    def with_buffers(self) -> bool:
        return self.batchnorm or self.fp8 == "delayed"

    def policy(self) -> str:
        text = f"params={self.params},compute={self.compute},output=float32"
        return text + (f",fp8={self.fp8}" if self.fp8 else "")

    def short(self) -> str:
        """The fields that differ from the defaults, as ``Config(...)`` source."""
        default = Config()
        parts = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        ]
        return f"Config({', '.join(parts)})"


class Net(torch.nn.Module):
    """A tiny model with every kind of part the features act on (16 wide: fp8's matmul needs multiples of 16; 13
    wide, no parameter is a multiple of 16 floats)."""

    def __init__(self, batchnorm: bool, width: int = 16):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.fc1 = torch.nn.Linear(6, width)
        self.norm = torch.nn.BatchNorm1d(width) if batchnorm else torch.nn.LayerNorm(width)
        self.block = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())  # the remat target
        self.fc2 = torch.nn.Linear(width, width)  # the frozen / int8 one
        self.head = torch.nn.Linear(width, 3)
        self.temperature = torch.nn.Parameter(torch.tensor(2.0))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if p.ndim > 1 else 0.1))
            self.temperature.fill_(2.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(torch.relu(self.fc1(x)))
        h = h + self.block(h)
        return self.head(torch.tanh(self.fc2(h))) / self.temperature


def _aux(kind: str, params: dict, buffers: Any, logits: torch.Tensor, count: torch.Tensor) -> Any:
    if kind == "param":
        return params["temperature"]
    if kind == "view":
        return params["fc1.weight"].t()
    if kind == "slice":
        return params["head.weight"][1:]
    if kind == "detached":
        return params["fc1.bias"].detach()
    if kind == "nested":
        return {
            "t": params["temperature"],
            "rows": [params["head.weight"][0], (params["fc1.bias"],)],
            "pair": Pair(params["head.bias"], logits.detach().mean()),
        }
    if kind == "values":
        return {"mean": logits.detach().mean(), "count": count}
    if kind == "buffer":  # a state buffer as given, and one as the forward left it
        return {"given": buffers["norm.running_mean"], "calls": buffers["norm.num_batches_tracked"]}
    raise ValueError(kind)


AUX = ("param", "view", "slice", "detached", "nested", "values", "buffer")


def _lr(spec: Any) -> Any:
    if isinstance(spec, float):
        return spec
    if spec[0] == "warmup":
        return optim.linear_warmup(0.0, spec[1], 2)
    if spec[0] == "cosine":
        return optim.warmup_cosine_decay(spec[1], warmup=1, total=4)
    raise ValueError(spec)


def _per_leaf(fn: Callable[[str, torch.Tensor], Any]) -> Callable[[dict], dict]:
    """A mask or label function of the tree it is given: inside a group, the other group's leaves are None."""
    return lambda tree: {n: (None if p is None else fn(n, p)) for n, p in tree.items()}


def build_optimizer(spec: tuple, params: dict) -> optim.GradientTransformation:
    """The optimizer a spec names: ``("sgd", lr, momentum, nesterov)``, ``("adam", lr)``, ``("adamw", lr, wd)``,
    ``("lion", lr)``, ``("clip", max_norm, inner)``, ``("chain", a, b)``, ``("multi", a, b, unused)`` (``a`` on
    matrices, ``b`` on the rest, and a label no parameter carries when ``unused``), ``("masked", inner)`` (inner
    on matrices, the rest passed through), ``("zero_frozen", inner)`` (set_to_zero on the temperature),
    ``("kahan", inner)``, ``("sr", inner)`` (bfloat16 masters)."""
    name = spec[0]
    if name == "sgd":
        return optim.sgd(_lr(spec[1]), spec[2], spec[3])
    if name == "adam":
        return optim.adam(_lr(spec[1]))
    if name == "adamw":
        return optim.adamw(_lr(spec[1]), weight_decay=spec[2])
    if name == "lion":
        return optim.lion(_lr(spec[1]))
    if name == "clip":
        return optim.chain(optim.clip_by_global_norm(spec[1]), build_optimizer(spec[2], params))
    if name == "chain":
        return optim.chain(build_optimizer(spec[1], params), build_optimizer(spec[2], params))
    if name == "multi":
        labels = _per_leaf(lambda name, p: "a" if p.ndim > 1 else "b")
        groups = {"a": build_optimizer(spec[1], params), "b": build_optimizer(spec[2], params)}
        if spec[3]:
            groups["unused"] = optim.sgd(1.0)
        return optim.multi_transform(groups, labels)
    if name == "masked":
        return optim.masked(build_optimizer(spec[1], params), _per_leaf(lambda name, p: p.ndim > 1))
    if name == "zero_frozen":
        labels = _per_leaf(lambda name, p: "zero" if name == "temperature" else "rest")
        return optim.multi_transform({"zero": optim.set_to_zero(), "rest": build_optimizer(spec[1], params)}, labels)
    if name == "kahan":
        return optim.kahan_summation(build_optimizer(spec[1], params))
    if name == "sr":
        return optim.stochastic_rounding(build_optimizer(spec[1], params))
    raise ValueError(spec)


def _loss_scale(spec: tuple) -> fa.LossScale:
    if spec[0] == "none":
        return fa.NoOpLossScale()
    if spec[0] == "static":
        return fa.StaticLossScale(2.0 ** spec[1])
    return fa.DynamicLossScale(2.0 ** spec[1], period=spec[2])


class Built(NamedTuple):
    """What one configuration trains: the loss functions (with and without remat), the start and the batches."""

    loss_fn: Callable[..., Any]
    loss_fn_plain: Callable[..., Any]  # the same model without remat: what the reference step runs
    params: dict
    buffers: Any
    batches: list
    holder: dict  # ``holder["t"]``: the state tensor the loss's closure reads (``Config.closure``), set per call


def _functional(cfg: Config, remat: Any) -> Any:
    model = Net(cfg.batchnorm, cfg.width)
    kwargs: dict[str, Any] = {}
    if cfg.frozen or cfg.int8:
        kwargs["trainable"] = lambda name, tensor: not name.startswith("fc2.")
    if cfg.int8:
        kwargs["quantize"] = Int8WeightOnlyConfig(targets="fc2")
    if remat is not None:
        kwargs["remat"] = Remat("block", budget=remat)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fa.nn.RematBudgetWarning)
        return fa.nn.functionalize(model, cfg.policy(), training=True, with_buffers=cfg.with_buffers, **kwargs)


def _loss_fn(cfg: Config, apply_fn: Callable[..., Any], holder: dict) -> Callable[..., Any]:
    def body(params: dict, buffers: Any, batch: dict) -> Any:
        if cfg.with_buffers:
            logits, new_buffers = apply_fn(params, buffers, batch["x"])
        else:
            logits, new_buffers = apply_fn(params, batch["x"]), None
        # Zero unless poisoned: then the loss and the head bias's gradient are not finite.
        trap = params["head.bias"].sum() * batch["poison"].mean()
        y = batch["y"]
        count = (y != -100).sum()
        if cfg.loss == "sum":
            total = torch.nn.functional.cross_entropy(logits, y, reduction="sum") + trap
            loss = fa.LossSum(total, count)
        elif cfg.loss == "sum_half":  # a half-precision total and an integer count past 256 (odd: not bfloat16)
            total = torch.nn.functional.cross_entropy(logits, y, reduction="sum") * COUNT_FACTOR + trap
            loss = fa.LossSum(total.to(HALF[cfg.compute]), count * COUNT_FACTOR)
        else:
            loss = torch.nn.functional.cross_entropy(logits, y.clamp(min=0)) + trap
        aux = _aux(cfg.aux, params, buffers, logits, count) if cfg.aux else None
        if cfg.closure:  # a state tensor read through the closure, as itself (it aliases the state) and reduced
            read = holder["t"]
            aux = {"closure": read, "closure_norm": read.float().square().sum(), **({"aux": aux} if cfg.aux else {})}
        out = (loss, aux) if cfg.has_aux else loss
        return (out, new_buffers) if cfg.with_buffers else out

    if cfg.with_buffers:
        return body
    return lambda params, batch: body(params, None, batch)


def _batches(cfg: Config) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(STEPS):
        y = torch.randint(0, 3, (BATCH,), generator=g)
        y[: i + 1] = -100  # uneven padding: the micro-batches hold different counts
        poison = torch.zeros(BATCH)
        if cfg.poison is not None and cfg.poison[0] == i:
            poison[: BATCH // 2] = cfg.poison[1]  # in the first micro-batch only
        out.append({"x": torch.randn(BATCH, 6, generator=g), "y": y, "poison": poison})
    return out


def build(cfg: Config) -> Built:
    """The model, losses, start and batches of ``cfg``; nothing compiled yet."""
    made = _functional(cfg, cfg.remat)
    plain = made if cfg.remat is None else _functional(cfg, None)
    params = made[1]
    buffers = made[2] if cfg.with_buffers else None
    holder: dict = {}
    return Built(
        _loss_fn(cfg, made[0], holder), _loss_fn(cfg, plain[0], holder), params, buffers, _batches(cfg), holder
    )


def _clone(tree: Any) -> Any:
    return optree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, tree, namespace="funcamp")


def fresh_state(cfg: Config, built: Built, storage: str = "flat", params: dict | None = None) -> fa.TrainState:
    """A new state of ``built``'s parameters (or of ``params``, as given), laid out by ``storage``."""
    params = _clone(built.params) if params is None else params
    with _storage(storage):
        return fa.TrainState.create(
            params,
            build_optimizer(cfg.opt, params),
            loss_scale=_loss_scale(cfg.loss_scale),
            buffers=_clone(built.buffers),
        )


@contextlib.contextmanager
def _storage(storage: str) -> Any:
    """``FUNCAMP_FLAT=off`` while a state is made, for ``storage == "leaf"`` (the environment restored after)."""
    before = os.environ.get("FUNCAMP_FLAT")
    if storage == "leaf":
        os.environ["FUNCAMP_FLAT"] = "off"
    else:
        os.environ.pop("FUNCAMP_FLAT", None)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("FUNCAMP_FLAT", None)
        else:
            os.environ["FUNCAMP_FLAT"] = before


def closure_source(cfg: Config, state: fa.TrainState) -> torch.Tensor:
    """The state tensor the loss's closure reads (``Config.closure``): ``head.weight`` (``"param"``), or the first
    optimizer-state tensor of a dimension or more (``"moment"``; ``head.weight`` where there is none)."""
    if cfg.closure == "moment":
        moments = [x for _, x in _leaves(state.opt_state) if isinstance(x, torch.Tensor) and x.ndim >= 1]
        if moments:
            return moments[0]
    return state.params["head.weight"]


# ---------------------------------------------------------------------------------------------- comparison


class Mismatch(AssertionError):
    """A configuration broke a documented equality or aliasing rule; the message lists every difference."""


def _leaves(tree: Any) -> list[tuple[str, Any]]:
    paths, leaves, _ = optree.tree_flatten_with_path(tree, namespace="funcamp")
    return [(".".join(map(str, p)), x) for p, x in zip(paths, leaves)]


def _bitwise(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = a.isnan()
    return (
        torch.equal(nan, b.isnan())
        and torch.equal(a.masked_fill(nan, 0), b.masked_fill(nan, 0))
        and torch.equal(a.signbit() | nan, b.signbit() | nan)
    )


def _close(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> tuple[bool, float]:
    """Within ``atol + rtol * |b|`` where finite, the same non-finite values elsewhere; the worst excess."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False, math.inf
    if not a.is_floating_point():
        return torch.equal(a, b), 0.0 if torch.equal(a, b) else math.inf
    a64, b64 = a.double(), b.double()
    fa_, fb = torch.isfinite(a64), torch.isfinite(b64)
    if not torch.equal(fa_, fb) or not _bitwise(a[~fa_], b[~fb]):
        return False, math.inf
    if not fa_.any():
        return True, 0.0
    err = (a64 - b64).abs()[fa_]
    allowed = atol + rtol * b64.abs()[fa_]
    worst = float((err / allowed).max())
    return worst <= 1.0, worst


_DISCRETE = ("grads_finite", "skipped_steps", "consecutive_skips", "too_many_skips", "nonfinite_leaf", "step")


def compare(got: Any, want: Any, where: str, bound: tuple[float, float] | None, problems: list[str]) -> None:
    """Append to ``problems`` every leaf of ``got`` that differs from ``want`` (bitwise, or within ``bound``)."""
    lg, lw = _leaves(got), _leaves(want)
    if [p for p, _ in lg] != [p for p, _ in lw]:
        problems.append(f"{where}: structure {[p for p, _ in lg]} != {[p for p, _ in lw]}")
        return
    for (path, x), (_, y) in zip(lg, lw):
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            if x != y:
                problems.append(f"{where}.{path}: {x!r} != {y!r}")
            continue
        discrete = any(name in path for name in _DISCRETE) or "loss_scale" in path or "counter" in path
        if bound is not None and "numerics/" in path and not x.is_floating_point() and x.shape == y.shape:
            # Telemetry counts (the log2 histogram) bin floating values: within a bound, a value near a bin's
            # edge may move to the next bin. The same total, and at most 1% of it (+2) moved.
            moved = int((x.long() - y.long()).abs().sum())
            if int(x.sum()) != int(y.sum()) or moved > 2 * (int(y.sum()) // 100 + 2):
                problems.append(f"{where}.{path}: counts moved {moved} of {int(y.sum())}: {_show(x)} vs {_show(y)}")
            continue
        if bound is None or discrete or not x.is_floating_point():
            if not _bitwise(x, y):
                problems.append(f"{where}.{path}: not bitwise: {_show(x)} vs {_show(y)}")
            continue
        ok, worst = _close(x, y, *bound)
        if not ok:
            problems.append(f"{where}.{path}: {worst:.3g}x the bound {bound}: {_show(x)} vs {_show(y)}")


def _show(x: torch.Tensor) -> str:
    if x.numel() == 1:
        return f"{x.item()!r} ({x.dtype})"
    if x.is_floating_point():
        return f"{x.dtype}{list(x.shape)} first {x.flatten()[:3].tolist()}"
    return f"{x.dtype}{list(x.shape)}"


def _run(step: Callable[..., Any], state: fa.TrainState, batches: list, *, pure: bool, donate: bool,
         compiled: bool, problems: list[str], label: str, prepare: Callable[[int, Any], Any] | None = None,
         recompile_from: int = 1) -> list[tuple[Any, dict]]:  # fmt: skip
    """Run ``step`` over ``batches``, checking the aliasing rules at every call; the states and metrics.
    ``prepare(i, state)`` makes the state the ``i``-th call is given (the closure's tensor set, the storage
    changed); a compiled step may compile before call ``recompile_from`` (once per storage)."""
    history: list[tuple[Any, dict]] = []
    first_state, first_snapshot = state, _clone(state)
    for i, batch in enumerate(batches):
        state = state if prepare is None else prepare(i, state)
        before_state, before_batch = _clone(state), _clone(batch)
        given = [x for _, x in _leaves(state.params)]
        ptrs = [x.data_ptr() for x in given]
        if compiled and i >= recompile_from:
            with torch._dynamo.config.patch(error_on_recompile=True):
                new, metrics = step(state, batch)
        else:
            new, metrics = step(state, batch)
        compare(batch, before_batch, f"{label} step {i}: the batch after the call", None, problems)
        if pure:
            compare(state, before_state, f"{label} step {i}: the input state after the call", None, problems)
        if donate:
            # The given tensors, written in place (a flat state's: the views of its buffers; nothing re-pointed).
            if any(x is not y for (_, x), y in zip(_leaves(new.params), given, strict=True)):
                problems.append(f"{label} step {i}: the donating step's new params are not the given tensors")
            elif [x.data_ptr() for _, x in _leaves(new.params)] != ptrs:
                problems.append(f"{label} step {i}: the donating step's new params are not in the given memory")
            try:
                state.replace(step=state.step)
            except DonatedStateError:
                pass
            else:
                problems.append(f"{label} step {i}: the donated state was not marked consumed")
        # A donating step's next call writes into this state's tensors: keep what it held now.
        history.append((_clone(new) if donate else new, metrics))
        state = new
    if pure:
        compare(first_state, first_snapshot, f"{label}: the first state after the whole run", None, problems)
    return history


def _compare_runs(got: list, want: list, label: str, bound: Any, problems: list[str]) -> None:
    for i, ((s1, m1), (s2, m2)) in enumerate(zip(got, want)):
        if list(m1) != list(m2):
            problems.append(f"{label} step {i}: metric names {list(m1)} != {list(m2)}")
            continue
        compare(s1, s2, f"{label} step {i} state", bound, problems)
        compare(m1, m2, f"{label} step {i} metrics", bound, problems)


def _make(cfg: Config, loss_fn: Callable[..., Any], opt_params: dict, *, backend: str, donate: bool) -> Any:
    opt = build_optimizer(cfg.opt, opt_params)
    kwargs = dict(has_aux=cfg.has_aux, accumulation_steps=cfg.k, max_consecutive_skips=cfg.skips,
                  telemetry=cfg.telemetry)  # fmt: skip
    if backend == "eager":
        return fa.make_train_step(loss_fn, opt, compile=False, donate=donate, **kwargs)
    return fa.make_train_step(loss_fn, opt, backend=backend, donate=donate, **kwargs)


def bound_for(cfg: Config) -> tuple[float, float] | None:
    """The documented equality of ``cfg``'s step with the eager reference: None (bitwise) or (rtol, atol)."""
    if cfg.backend == "eager":
        return None
    if cfg.compute != "float32" or cfg.params != "float32" or cfg.fp8 or cfg.int8:
        return max(BOUNDS[cfg.backend], HALF_BOUND)
    return BOUNDS[cfg.backend]


def check(cfg: Config) -> dict[str, Any]:
    """Run ``cfg`` and its reference; raise :class:`Mismatch` listing every broken rule. Returns a summary."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fa.nn.RematBudgetWarning)  # an eager budget in (0, 1) says it ran as 0
        return _check(cfg)


def _check(cfg: Config) -> dict[str, Any]:
    validate(cfg)
    built = build(cfg)
    problems: list[str] = []
    ref_step = reference.make_train_step(
        built.loss_fn_plain, build_optimizer(cfg.opt, built.params), has_aux=cfg.has_aux,
        accumulation_steps=cfg.k, max_consecutive_skips=cfg.skips, compile=False, telemetry=cfg.telemetry,
    )  # fmt: skip
    reads = _closure_reads(cfg, built)
    want = _run(ref_step, fresh_state(cfg, built), built.batches, pure=True, donate=False, compiled=False,
                problems=problems, label="reference", prepare=reads)  # fmt: skip
    _check_loss_metric(cfg, built, fresh_state(cfg, built), want, problems)
    compiled = cfg.backend != "eager"
    if compiled:
        torch._dynamo.reset()  # each configuration compiles its own step (no recompile limit reached across them)
    step = _make(cfg, built.loss_fn, built.params, backend=cfg.backend, donate=cfg.donate)
    start, module = _start(cfg, built, problems)
    tmp = tempfile.TemporaryDirectory()  # the checkpoints of storage="alternate"
    recompile_from = 2 if cfg.storage == "alternate" else 1
    got = _run(step, start, built.batches, pure=not cfg.donate, donate=cfg.donate, compiled=compiled,
               problems=problems, label="step", prepare=_step_preparer(cfg, built, reads, tmp.name),
               recompile_from=recompile_from)  # fmt: skip
    if module is not None:
        _check_module(cfg, module, got, problems)
    _compare_runs(got, want, "step vs reference", bound_for(cfg), problems)
    companion = compiled and (cfg.donate or cfg.remat is not None)
    if companion:  # bitwise the same backend's step without donation and remat, where the docs promise it
        promised = cfg.donate and (cfg.remat is None or _remat_bitwise(cfg))
        promised = promised or (not cfg.donate and _remat_bitwise(cfg))
        if promised:
            plain = build(dataclasses.replace(cfg, remat=None))
            torch._dynamo.reset()
            step_c = _make(cfg, plain.loss_fn, plain.params, backend=cfg.backend, donate=False)
            storage = "leaf" if cfg.storage == "leaf" else "flat"  # alternate: its odd steps per leaf
            reads_c = _closure_reads(cfg, plain)
            base = _run(step_c, fresh_state(cfg, plain, storage), plain.batches, pure=True, donate=False,
                        compiled=True, problems=problems, label="companion", prepare=reads_c)  # fmt: skip
            bound = STORAGE_BOUND if cfg.storage == "alternate" else None
            _compare_runs(got, base, "step vs the same backend without donate/remat", bound, problems)
    other = None
    if compiled and cfg.storage != "flat":  # the storage changes only the norm's round-off: against the other's
        storage = "flat" if cfg.storage == "leaf" else "leaf"  # (alternate: its flat steps against per-leaf ones)
        torch._dynamo.reset()
        step_o = _make(cfg, built.loss_fn, built.params, backend=cfg.backend, donate=cfg.donate)
        other = _run(step_o, fresh_state(cfg, built, storage), built.batches, pure=not cfg.donate,
                     donate=cfg.donate, compiled=True, problems=problems, label=f"{storage} companion",
                     prepare=reads)  # fmt: skip
        _compare_runs(got, other, f"step ({cfg.storage}) vs the same step over {storage} storage", STORAGE_BOUND,
                      problems)  # fmt: skip
    if cfg.warm:  # compiled again from the caches the first compile filled, the closure given a copy this time
        torch._dynamo.reset()
        step_w = _make(cfg, built.loss_fn, built.params, backend=cfg.backend, donate=cfg.donate)
        copies = _step_preparer(cfg, built, _closure_reads(cfg, built, copy=True), tmp.name)
        first = _start(cfg, built, problems)[0]
        warm = _run(step_w, first, built.batches, pure=not cfg.donate, donate=cfg.donate, compiled=True,
                    problems=problems, label="warm", prepare=copies, recompile_from=recompile_from)  # fmt: skip
        _compare_runs(warm, got, "step compiled from a warm cache vs the first compile", None, problems)
    tmp.cleanup()
    if problems:
        raise Mismatch(f"{cfg.short()}: {len(problems)} problem(s):\n  " + "\n  ".join(problems[:30]))
    finite = [bool(m["grads_finite"]) for _, m in got]
    return {"finite": finite, "loss": [float(m["loss"]) for _, m in got]}


def _closure_reads(cfg: Config, built: Built, copy: bool = False) -> Callable[[int, Any], Any] | None:
    """The ``prepare`` of :func:`_run` that points the loss's closure at the state's tensor (or a copy of it)."""
    if cfg.closure is None:
        return None

    def prepare(i: int, state: Any) -> Any:
        t = closure_source(cfg, state)
        built.holder["t"] = t.clone() if copy else t
        return state

    return prepare


def _step_preparer(cfg: Config, built: Built, reads: Any, tmp: str) -> Callable[[int, Any], Any] | None:
    """The step's ``prepare``: with ``storage="alternate"``, each state after the first saved and loaded
    (``funcamp.checkpoint``) into a state of the other storage (odd calls per leaf, even ones flat); then the
    closure's tensor."""
    if cfg.storage != "alternate":
        return reads

    def prepare(i: int, state: Any) -> Any:
        if i > 0:
            path = os.path.join(tmp, f"state{i}.ckpt")
            fa.checkpoint.save(path, state)
            state = fa.checkpoint.load(path, like=fresh_state(cfg, built, "leaf" if i % 2 else "flat"))
        return state if reads is None else reads(i, state)

    return prepare


def _start(cfg: Config, built: Built, problems: list[str]) -> tuple[fa.TrainState, Any]:
    """The step's first state, and with ``start="module"`` the module it was built from (the module, clones of
    its parameters, the state's storage kind): ``{name: p.detach()}`` of a :class:`Net` equal to ``built``'s
    (the pattern ``TrainState.create``'s message suggests)."""
    first = "leaf" if cfg.storage == "leaf" else "flat"
    if cfg.start != "module":
        return fresh_state(cfg, built, first), None
    module = Net(cfg.batchnorm, cfg.width)
    with torch.no_grad():
        for k, x in built.params.items():  # the master dtype functionalize keeps each parameter in
            module.get_parameter(k).data = module.get_parameter(k).data.to(x.dtype)
    given = {k: module.get_parameter(k).detach() for k in built.params}
    compare(given, built.params, "the module's parameters vs functionalize's", None, problems)
    state = fresh_state(cfg, built, first, params=given)
    return state, (module, _clone(given), state.storage.kind)


def _check_module(cfg: Config, module: Any, got: list, problems: list[str]) -> None:
    """The module a state was built from (``start="module"``), after the run: a flat state copied its parameters
    (docs/memory.md), so no step wrote into them; a state kept leaf by leaf held them, and a donating step
    overwrote them with each new state (with ``storage="alternate"``, the first: the later states are loaded)."""
    model, initial, kind = module
    now = {k: model.get_parameter(k).detach() for k in initial}
    if kind == "per leaf" and cfg.donate:  # leaf by leaf as asked, or for its optimizer (stochastic rounding)
        last = got[0 if cfg.storage == "alternate" else -1][0].params
        compare(now, last, "the module after donated per-leaf steps vs the state they made", None, problems)
    else:
        compare(now, initial, f"the module after the run ({kind} state) vs before", None, problems)


def _check_loss_metric(cfg: Config, built: Built, start: Any, want: list, problems: list[str]) -> None:
    """The reference's ``loss`` metric against a float64 oracle computed here: the mean of the micro-batch
    losses, or a LossSum's ``sum(total) / sum(count)`` (the step's LossSum arithmetic is shared with the
    reference, so only an oracle sees a fault there)."""
    for i, batch in enumerate(built.batches):
        state = start if i == 0 else want[i - 1][0]
        buffers, totals, counts, means = state.buffers, [], [], []
        if cfg.closure:
            built.holder["t"] = closure_source(cfg, state)
        with torch.no_grad():
            for mb in _micro_batches(batch, cfg.k):
                if cfg.with_buffers:
                    out, buffers = built.loss_fn_plain(state.params, buffers, mb)
                else:
                    out = built.loss_fn_plain(state.params, mb)
                loss = out[0] if cfg.has_aux else out
                if cfg.loss == "mean":
                    means.append(loss.double())
                else:
                    totals.append(loss.total.double())
                    counts.append(torch.as_tensor(loss.count).double())
        oracle = float(sum(means) / len(means) if means else sum(totals) / sum(counts))
        got = float(want[i][1]["loss"])
        if math.isfinite(oracle) and not abs(got - oracle) <= LOSS_RTOL * abs(oracle):
            problems.append(f"reference step {i}: loss metric {got!r}, float64 oracle {oracle!r}")


def _micro_batches(batch: dict, k: int) -> list[dict]:
    chunks = {name: x.chunk(k) for name, x in batch.items()}
    return [{name: c[j] for name, c in chunks.items()} for j in range(k)]


def _remat_bitwise(cfg: Config) -> bool:
    """Remat is bitwise the step without it: eagerly always; compiled with float32 compute, or under aot_eager
    (nothing is recomputed)."""
    if cfg.remat is None or cfg.backend in ("eager", "aot_eager"):
        return True
    return cfg.compute == "float32" and cfg.params == "float32" and cfg.fp8 is None


def validate(cfg: Config) -> None:
    """Refuse a configuration outside the space (the strategy never draws one)."""
    if cfg.aux == "buffer" and not cfg.batchnorm:
        raise ValueError("aux='buffer' needs batchnorm")
    if cfg.params == "bfloat16" and cfg.compute != "bfloat16":
        raise ValueError("bfloat16 masters with bfloat16 compute only")
    if cfg.opt[0] in ("kahan", "sr") and cfg.params != "bfloat16":
        raise ValueError("kahan/sr wrap bfloat16 masters")
    if cfg.width != 16 and cfg.fp8:
        raise ValueError("fp8 needs the width 16 (its matmul takes multiples of 16)")
    if cfg.warm and cfg.backend != "inductor":
        raise ValueError("warm is inductor's cache")


# ---------------------------------------------------------------------------------------------- the space


def _lrs(peak: float) -> st.SearchStrategy:
    return st.sampled_from([peak, ("warmup", peak), ("cosine", peak)])


def _base() -> st.SearchStrategy:
    return st.one_of(
        st.tuples(st.just("sgd"), _lrs(0.1), st.sampled_from([None, 0.9]), st.booleans()).map(
            lambda t: t if t[2] else (t[0], t[1], t[2], False)
        ),
        st.tuples(st.just("adam"), _lrs(1e-2)),
        st.tuples(st.just("adamw"), _lrs(1e-2), st.sampled_from([0.0, 0.1])),
        st.tuples(st.just("lion"), _lrs(1e-3)),
    )


def _optimizers() -> st.SearchStrategy:
    def wrap(inner: st.SearchStrategy) -> st.SearchStrategy:
        return st.one_of(
            st.tuples(st.just("clip"), st.sampled_from([1e-3, 1.0]), inner),
            st.tuples(st.just("chain"), st.just(("sgd", 0.0, None, False)), inner),
            st.tuples(st.just("multi"), inner, inner, st.booleans()),
            st.tuples(st.just("masked"), inner),
            st.tuples(st.just("zero_frozen"), inner),
        )

    base = _base()
    once = wrap(base)
    return st.one_of(base, once, wrap(st.one_of(base, once)))  # (st.recursive warns: wrap's branches are tuples)


@st.composite
def configs(draw: Any, backends: tuple[str, ...] = ("eager", "aot_eager", "inductor")) -> Config:
    """Configurations over the whole space the tester knows (hypothesis strategy)."""
    compute = draw(st.sampled_from(["float32", "bfloat16", "float16"]))
    params = draw(st.sampled_from(["float32", "bfloat16"])) if compute == "bfloat16" else "float32"
    opt = draw(_optimizers())
    if params == "bfloat16" and draw(st.booleans()):
        opt = (draw(st.sampled_from(["kahan", "sr"])), opt)
    batchnorm = draw(st.booleans())
    int8 = draw(st.booleans())
    fp8 = draw(st.sampled_from([None, "tensorwise", "rowwise", "delayed"]))
    backend = draw(st.sampled_from(backends))
    return Config(
        compute=compute,
        params=params,
        loss_scale=draw(
            st.one_of(
                st.just(("none",)),
                st.tuples(st.just("static"), st.sampled_from([0, 8])),
                st.tuples(st.just("dynamic"), st.sampled_from([0, 8, 15]), st.sampled_from([1, 2])),
            )
        ),
        opt=opt,
        k=draw(st.sampled_from([1, 2])),
        loss=draw(st.sampled_from(["mean", "sum", "sum_half"])),
        aux=draw(st.sampled_from([None, *(a for a in AUX if batchnorm or a != "buffer")])),
        batchnorm=batchnorm,
        frozen=int8 or draw(st.booleans()),
        int8=int8,
        fp8=fp8,
        remat=draw(st.sampled_from([None, 0.0, 0.5, 1.0])),
        donate=draw(st.booleans()),
        telemetry=draw(st.sampled_from([None, 1, 2])),
        skips=draw(st.sampled_from([None, 1])),
        backend=backend,
        poison=draw(st.sampled_from([None, (1, math.inf), (0, math.nan), (2, -math.inf)])),
        closure=draw(st.sampled_from([None, "param", "moment"])),
        start=draw(st.sampled_from(["create", "module"])),
        width=16 if fp8 else draw(st.sampled_from([16, 13])),
        storage=draw(st.sampled_from(["flat", "leaf", "alternate"])),
        warm=backend == "inductor" and draw(st.booleans()),
    )
