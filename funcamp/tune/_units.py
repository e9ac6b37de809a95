"""A model's units and one of them run alone: the submodules measured (:func:`units_at_depth`), the inputs each receives
in one forward (:func:`capture_inputs`), one module under one policy forward and backward (:class:`Runner`), and the
error against float32 (:func:`rel_error`). Shared by :func:`funcamp.tune.tune_policy` and
:func:`funcamp.tune.block_probe`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.utils._pytree as torch_pytree
from torch import nn

from funcamp.nn import functionalize
from funcamp.policy import Policy

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def units_at_depth(model: nn.Module, depth: int) -> list[tuple[str, nn.Module]]:
    """Submodules ``depth`` levels below the root (containers do not count as a level), or leaves above."""
    out: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, module: nn.Module, level: int) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if isinstance(child, _CONTAINERS):
                walk(full + ".", child, level)
            elif level == depth or not any(True for _ in child.children()):
                out.append((full, child))
            else:
                walk(full + ".", child, level + 1)

    walk("", model, 1)
    return out


def capture_inputs(model: nn.Module, units: list[tuple[str, nn.Module]], args: tuple, kwargs: dict) -> dict[str, Any]:
    """The ``(args, kwargs)`` each unit is first called with during one forward of ``model`` (no grad).

    The model's buffers come back as they were (the same tensors, the same values): a forward may update
    them (BatchNorm statistics, fp8 amax histories), and measuring must not."""
    seen: dict[str, Any] = {}
    handles = []
    saved = [
        (model.get_submodule(name.rpartition(".")[0]), name.rpartition(".")[2], b, b.detach().clone())
        for name, b in model.named_buffers(remove_duplicate=False)
    ]

    def hook(name: str) -> Callable[..., None]:
        def record(module: nn.Module, a: tuple, k: dict) -> None:
            if name not in seen:
                seen[name] = torch_pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (a, k))

        return record

    try:
        for name, unit in units:
            handles.append(unit.register_forward_pre_hook(hook(name), with_kwargs=True))
        with torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
        with torch.no_grad():
            for owner, attr, buffer, value in saved:
                owner._buffers[attr] = buffer  # a forward may have rebound it
                buffer.copy_(value)
    return seen


def _floating(tree: Any) -> list[torch.Tensor]:
    return [x for x in torch_pytree.tree_leaves(tree) if isinstance(x, torch.Tensor) and x.is_floating_point()]


def rel_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in float64; inf when either is not finite (no oracle, no verdict)."""
    x, ref = x.double(), ref.double()
    if not (torch.isfinite(x).all() and torch.isfinite(ref).all()):
        return math.inf
    den = torch.linalg.vector_norm(ref)
    num = torch.linalg.vector_norm(x - ref)
    if den == 0:
        return 0.0 if num == 0 else math.inf
    return float(num / den)


class Runner:
    """One module under one policy: ``run()`` = forward + backward on its captured inputs."""

    def __init__(
        self,
        module: nn.Module,
        policy: Policy,
        inputs: Any,
        device: torch.device,
        training: bool | None,
        op_policies,
        module_policies: Mapping[Any, Any] | None = None,
    ) -> None:
        # {"": policy}: the unit itself follows the candidate even where functionalize has a default for its
        # type, as the map's entry (a user entry, which wins over the defaults) makes it in the whole model;
        # the user's own entries come first (first match wins).
        apply_fn, params, buffers = functionalize(
            module,
            policy,
            module_policies={**(module_policies or {}), "": policy},
            with_buffers=True,
            training=training,
            op_policies=op_policies,
        )
        self.apply_fn = apply_fn
        self.params = {k: v.to(device) for k, v in params.items()}
        self.buffers = {k: v.to(device) for k, v in buffers.items()}
        args, kwargs = torch_pytree.tree_map_only(torch.Tensor, lambda t: t.to(device), inputs)
        self.args, self.kwargs = args, kwargs
        self.cotangents: list[torch.Tensor] | None = None

    def run(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(floating outputs, gradients of params and floating inputs), in the order of their trees."""
        params = {k: v.detach().requires_grad_(v.is_floating_point()) for k, v in self.params.items()}
        args, kwargs = torch_pytree.tree_map_only(
            torch.Tensor,
            lambda t: t.detach().requires_grad_(True) if t.is_floating_point() else t,
            (self.args, self.kwargs),
        )
        out, _ = self.apply_fn(params, self.buffers, *args, **kwargs)
        outs = _floating(out)
        if self.cotangents is None:
            g = torch.Generator(device=outs[0].device if outs else "cpu").manual_seed(0)
            self.cotangents = [torch.randn(o.shape, generator=g, device=o.device, dtype=torch.float32) for o in outs]
        wrt = [p for p in params.values() if p.requires_grad] + _floating((args, kwargs))
        loss = sum((o.float() * c).sum() for o, c in zip(outs, self.cotangents))
        grads = torch.autograd.grad(loss, wrt, allow_unused=True) if wrt and outs else []
        grads = [torch.zeros_like(w) if g is None else g for w, g in zip(wrt, grads)]
        return [o.detach() for o in outs], list(grads)


def candidate_policy(base: Policy, dtype: torch.dtype) -> Policy:
    """``base`` with compute and output in ``dtype`` (parameters and reductions kept)."""
    return Policy(base.param_dtype, dtype, dtype, base.reduce_dtype)
