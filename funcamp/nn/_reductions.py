"""How a data-parallel step reduces each buffer over the ranks, as the modules that own the buffers declare it."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

__all__ = ["buffer_reductions"]


def buffer_reductions(module: nn.Module, names: Iterable[str]) -> dict[str, str]:
    """Dotted buffer name -> ``"max"`` or ``"min"``, for the buffers ``names`` whose owning module declares one.

    A module class declares ``buffer_reductions = {"attribute_name": "max" | "min"}`` (``funcamp.fp8``'s layers
    for their delayed-scaling state); buffers it does not name are averaged over the ranks. The result is
    what ``funcamp.nn.functionalize`` gives as ``apply_fn.buffer_reductions``, for
    ``TrainState.create(..., buffer_reductions=...)``: a plain dict (``torch.compile`` traces a function that
    reads one; it cannot trace the ``items`` of a ``MappingProxyType``).

    Raises:
      ValueError: if a module declares a reduction other than ``"max"`` and ``"min"``.
    """
    out = {}
    for name in names:
        owner_name, _, attr = name.rpartition(".")
        declared = getattr(module.get_submodule(owner_name), "buffer_reductions", None) or {}
        how = declared.get(attr)
        if how is None:
            continue
        if how not in ("max", "min"):
            raise ValueError(
                f"functionalize: {type(module.get_submodule(owner_name)).__name__}.buffer_reductions[{attr!r}] is "
                f"{how!r}; a buffer's reduction over ranks is 'max' or 'min' (leave it out to average it)"
            )
        out[name] = how
    return out
