"""One repeated block's library kernels, replayed: :func:`block_probe`, a cheap ``make_step`` for
:func:`funcamp.tune.choose_compute_dtype`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from funcamp.policy import Policy, get_policy
from funcamp.tune._checks import check_module, timing_device
from funcamp.tune._keys import module_signature, setting_value
from funcamp.tune._timing import synchronizer
from funcamp.tune._units import Runner, candidate_policy, capture_inputs

# The ops a compiled step hands to a library (oneDNN/MKL, cuBLAS, the attention kernels) rather than fusing: what
# a compute dtype changes most, and what eager timing measures as the compiled step runs them.
_KERNEL_NAMES = (
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "addbmm",
    "convolution",
    "convolution_backward",
    "_scaled_mm",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_cudnn_attention_backward",
    "_flash_attention_forward",
    "_flash_attention_backward",
    "_efficient_attention_forward",
    "_efficient_attention_backward",
)


_MAX_CALLS = 256  # kernel calls in one replay, at most


_KERNELS = frozenset(getattr(torch.ops.aten, n) for n in _KERNEL_NAMES if hasattr(torch.ops.aten, n))


def _record_kernels(run: Callable[[], Any]) -> list[tuple[Any, tuple, dict]]:
    """The library kernels (``_KERNELS``) ``run()`` calls, forward and backward, with their real arguments."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls: list[tuple[Any, tuple, dict]] = []

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            kwargs = kwargs or {}
            if func.overloadpacket in _KERNELS:
                calls.append((func, args, kwargs))
            return func(*args, **kwargs)

    with Recorder():
        run()
    return calls


@dataclasses.dataclass(eq=False)
class _Replay:
    """``run()`` for :func:`choose_compute_dtype`: the recorded kernels of one block, ``repeat`` times."""

    dtype: torch.dtype
    kernels: tuple[tuple[Any, tuple, dict], ...]
    repeat: int
    op_policies: dict = dataclasses.field(default_factory=dict)  # rules added by run_with (choose_op_dtypes)

    def __call__(self) -> None:
        for _ in range(self.repeat):
            for func, args, kwargs in self.kernels:
                func(*args, **kwargs)


class BlockProbe:
    """``make_step`` for :func:`choose_compute_dtype` that times one repeated block instead of the whole step.

    Built by :func:`block_probe`, which only finds the block: nothing runs until the first call, so a
    decision read from the cache costs no forward. ``probe(dtype)`` captures the block's input (once: one
    no-grad forward of the model), runs the block forward and backward once, eagerly, as
    :func:`funcamp.nn.functionalize` runs it under ``Policy(param_dtype, dtype, dtype)`` (norm layers in
    float32), records the library kernels it calls (matmuls, convolutions, attention, with their real arguments)
    and returns ``run()``, which calls those kernels again ``repeat`` times: the work a dtype changes in a
    compiled step, where the elementwise ops around them are fused.

    Attributes:
      name: the block timed (``"blocks.0"``; ``""`` for the whole model when it has no repeated block).
      members: the names of the identical blocks it stands for.
      kind: the block's class name.
      key: a JSON description of what is timed (the block, its signature, the base policy and op rules), for
        :func:`choose_compute_dtype`'s ``key``.
      what: one phrase for :class:`ComputeDtypeChoice`'s explanation (and ``choose_compute_dtype``'s ``what``).
      repeat: how many times one ``run()`` replays the kernels, set by the first call so that a run takes
        ``min_run_time`` (0 before it).
      kernels: how many kernel calls one forward+backward of the block makes, in the first dtype run (0 before).
    """

    def __init__(
        self,
        model: nn.Module,
        name: str,
        members: tuple[str, ...],
        example: tuple[tuple, dict],
        base: Policy,
        device: torch.device,
        op_policies: Any,
        module_policies: Any,
        min_run_time: float,
    ) -> None:
        self.name, self.members = name, members
        self._module_policies = dict(module_policies or {})
        self._model, self._module = model, model.get_submodule(name)
        self.kind = type(self._module).__name__
        self._example, self._base, self._device, self._op_policies = example, base, device, op_policies
        self._min_run_time = min_run_time
        self._inputs: Any = None
        self._replays: dict[torch.dtype, _Replay] = {}
        self._ruled: dict[tuple[torch.dtype, frozenset], _Replay] = {}  # run_with's replays, by dtype and rules
        self.repeat = self.kernels = 0
        self.key = {
            "measure": "block kernels",
            "block": name,
            "members": len(members),
            "module": module_signature(self._module),
            "policy": str(base),
            "op_policies": repr(sorted((repr(k), repr(v)) for k, v in (op_policies or {}).items())),
            "module_policies": [[setting_value(k, 0), setting_value(v, 0)] for k, v in self._module_policies.items()],
            "min_run_time": min_run_time,
        }
        if not name:
            self.what = f"the whole {self.kind}'s forward+backward kernels"
        else:
            many = f", one of {len(members)}" if len(members) > 1 else ""
            self.what = f"{name} ({self.kind}{many})'s forward+backward kernels"

    def _capture(self) -> Any:
        if self._inputs is None:
            args, kwargs = self._example
            if not self.name:
                self._inputs = (args, kwargs)
            else:
                seen = capture_inputs(self._model, [(self.name, self._module)], args, kwargs)
                if self.name not in seen:
                    raise ValueError(
                        f"block_probe: {self.name} ({self.kind}) was not called by {type(self._model).__name__}'s "
                        "forward"
                    )
                self._inputs = seen[self.name]
        return self._inputs

    @property
    def device(self) -> torch.device:
        """The device the block runs on."""
        return self._device

    def _record(self, dtype: torch.dtype, op_policies: Any) -> _Replay:
        policy = candidate_policy(self._base, dtype)
        runner = Runner(self._module, policy, self._capture(), self._device, None, op_policies, self._module_policies)
        return _Replay(dtype, tuple(_record_kernels(runner.run)), max(self.repeat, 1))

    def _calibrate(self, first: _Replay) -> None:
        if not first.kernels:
            raise ValueError(
                f"block_probe: {self.name or 'the model'} ({self.kind}) calls no matmul, "
                "convolution or attention kernel: nothing a compute dtype would speed up (time the step instead)"
            )
        sync = synchronizer(self._device)
        first()
        seconds = []
        for _ in range(3):  # the quickest of three: the machine's load only makes runs longer
            sync()
            start = time.perf_counter()
            first()
            sync()
            seconds.append(time.perf_counter() - start)
        self.kernels = len(first.kernels)
        # At most _MAX_CALLS kernel calls a run: tiny kernels under load cost a scheduler slice each, not microseconds
        most = max(1, _MAX_CALLS // self.kernels)
        self.repeat = max(1, min(most, math.ceil(self._min_run_time / max(min(seconds), 1e-9))))
        first.repeat = self.repeat

    def __call__(self, dtype: torch.dtype) -> _Replay:
        """``run()`` replaying the block's kernels as they run in ``dtype``.

        Raises:
          ValueError: if the block is not called by the model's forward or calls no kernel.
          RuntimeError: whatever the block's forward or backward raises in ``dtype`` (no kernel for it).
        """
        if dtype not in self._replays:
            replay = self._record(dtype, self._op_policies)
            if not self.repeat:
                self._calibrate(replay)
            self._replays[dtype] = replay
        return self._replays[dtype]

    def run_with(self, dtype: torch.dtype, op_policies: Mapping[str, torch.dtype]) -> _Replay:
        """``run()`` replaying the block's kernels in ``dtype`` with ``op_policies`` added to the probe's op rules
        (:func:`funcamp.tune.choose_op_dtypes`' candidates), replayed as often as ``probe(dtype)``'s run;
        ``run.op_policies`` is the rules added.

        Raises:
          ValueError: if the block is not called by the forward or calls no kernel (as ``probe(dtype)``).
          RuntimeError: whatever the block's forward or backward raises in ``dtype`` with those rules.
        """
        base = self(dtype)  # records (and calibrates) the block as it is first
        if not op_policies:
            return base
        key = (dtype, frozenset(op_policies.items()))
        if key not in self._ruled:  # recorded once: choose_op_dtypes times it, the dtype decision times it again
            replay = self._record(dtype, {**(self._op_policies or {}), **op_policies})
            self._ruled[key] = dataclasses.replace(replay, repeat=base.repeat, op_policies=dict(op_policies))
        return self._ruled[key]

    def __repr__(self) -> str:
        return f"BlockProbe({self.what})"


def _repeated_block(model: nn.Module) -> tuple[str, tuple[str, ...]]:
    """The model's repeated block: among groups of two or more identical submodules (same class, tensor shapes
    and settings), the one holding the most parameters, the outermost on a tie; ``("", ("",))`` when none."""
    groups: dict[str, list[tuple[str, nn.Module]]] = {}
    for name, module in model.named_modules():
        if name:
            groups.setdefault(json.dumps(module_signature(module), sort_keys=True), []).append((name, module))
    best: tuple[int, int, tuple[str, ...]] | None = None
    for members in groups.values():
        if len(members) < 2:
            continue
        size = sum(p.numel() for p in members[0][1].parameters())
        if size == 0:
            continue
        rank = (size * len(members), -min(n.count(".") for n, _ in members), tuple(n for n, _ in members))
        if best is None or rank[:2] > best[:2]:
            best = rank
    if best is None:
        return "", ("",)
    return best[2][0], best[2]


def block_probe(
    model: nn.Module,
    example_args: tuple | list,
    example_kwargs: Mapping[str, Any] | None = None,
    *,
    policy: Policy | str = "params=float32,compute=float32,output=float32",
    device: str | torch.device | None = None,
    op_policies: Mapping[Any, Any] | None = None,
    module_policies: Mapping[Any, Any] | None = None,
    min_run_time: float = 0.02,
) -> BlockProbe:
    """A cheap ``make_step`` for :func:`choose_compute_dtype`: one repeated block's kernels, not the whole step.

    Finds the model's repeated block (the largest group of identical submodules: same class, parameter shapes
    and settings, such as a transformer's blocks; the whole model when there is none); nothing runs yet. The
    first ``probe(dtype)`` captures the input the first of them receives in one no-grad forward of
    ``model(*example_args, **example_kwargs)``; each ``probe(dtype)`` runs that block forward and backward once
    in ``dtype`` and records the library kernels it calls (matmuls, convolutions, attention), and returns a
    ``run()`` that replays them: milliseconds to seconds a candidate, no compile, where timing the compiled
    step costs a compile per candidate.

    What it leaves out: elementwise work (fused by the compiled step; about the same or cheaper in a half
    dtype), the casts of the weights, and everything outside the block (embedding, head, loss, optimizer,
    the same in every candidate). So on a model whose blocks are narrow (the main job's GPT ``small``, width
    128) the step's ratio to float32 is closer to 1 than the block's kernels'.

    Args:
      model: the model (not changed; the block is copied by :func:`funcamp.nn.functionalize`).
      example_args: the forward's positional arguments, a tuple (a batch of the real shape).
      example_kwargs: keyword arguments of that forward.
      policy: the base policy: its ``param_dtype`` and ``reduce_dtype`` are kept, the compute and output
        dtypes are the candidate's.
      device: where to run; default the model's parameters' device.
      op_policies: per-op rules the step uses (as :func:`tune_policy`).
      module_policies: the step's ``functionalize`` entries that keep some modules off the candidate dtype
        (``{type: policy}``, such as :data:`funcamp.fp8.MODULE_POLICIES`; name patterns are matched against
        names inside the block); the rest of the block computes in the candidate.
      min_run_time: seconds one ``run()`` of the first dtype timed should take at least on a quiet machine (the
        kernels are replayed as often as needed, at most 256 kernel calls a run); each timed round of
        :func:`choose_compute_dtype` is one ``run()`` per candidate.
    Returns:
      A :class:`BlockProbe`: pass it as ``make_step`` and its ``key`` in the ``key`` mapping.
    Raises:
      TypeError: if ``model`` is not an ``nn.Module`` or ``example_args`` is not a tuple or list.
      ValueError: if the device is ``meta`` or ``min_run_time`` is not positive; from ``probe(dtype)``, if the
        block is not called by the forward or calls no matmul, convolution or attention kernel.
      RuntimeError: from ``probe(dtype)``, whatever the model's forward or the block's forward or backward raises.

    Example:
      >>> model = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(3)))
      >>> probe = block_probe(model, (torch.randn(8, 16),))
      >>> probe.name, probe.members
      ('0', ('0', '1', '2'))
      >>> run = probe(torch.float32)   # captures, runs forward+backward once, records
      >>> probe.kernels                # forward addmm, backward two mm
      3
    """
    fn = "block_probe"
    check_module(model, fn)
    if not isinstance(example_args, (tuple, list)):
        raise TypeError(
            f"{fn}: example_args must be a tuple of the forward's positional arguments, got "
            f"{type(example_args).__name__} (write (x,) for one tensor)"
        )
    if isinstance(min_run_time, bool) or not isinstance(min_run_time, (int, float)) or not min_run_time > 0:
        raise ValueError(f"{fn}: min_run_time must be a number of seconds > 0, got {min_run_time!r}")
    kwargs = dict(example_kwargs or {})
    base = get_policy(policy)
    device = timing_device(model, device, fn, "pass a model and inputs on a real device")
    name, members = _repeated_block(model)
    example = (tuple(example_args), kwargs)
    return BlockProbe(model, name, members, example, base, device, op_policies, module_policies, float(min_run_time))
