"""The arguments every entry point of :mod:`funcamp.tune` checks the same way: the model, counts, the margin, the
device to time on, the candidate dtypes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

CANDIDATES = (torch.float32, torch.bfloat16, torch.float16)


def check_candidates(candidates: Any, fn: str = "tune_policy") -> tuple[torch.dtype, ...]:
    """The candidate compute dtypes (names or dtypes), float32 first as the reference, each once; refused otherwise."""
    if isinstance(candidates, (str, torch.dtype)) or not isinstance(candidates, Sequence):
        raise TypeError(f"{fn}: candidates must be a list of dtypes, got {candidates!r}")
    out = []
    for c in candidates:
        dtype = getattr(torch, c, None) if isinstance(c, str) else c
        if dtype not in CANDIDATES:
            raise ValueError(
                f"{fn}: candidate {c!r} is not a compute dtype funcamp tunes; choose from float32, bfloat16, float16"
            )
        out.append(dtype)
    if torch.float32 not in out:
        out.insert(0, torch.float32)  # the reference
    return tuple(dict.fromkeys(out))


def check_module(model: Any, fn: str) -> None:
    """Refuse a ``model`` that is not an ``nn.Module``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}: model must be a torch.nn.Module, got {type(model).__name__}")


def check_counts(fn: str, **counts: tuple[Any, int]) -> None:
    """Each ``name=(value, least)``: ``value`` an int (not a bool) >= ``least``."""
    for name, (value, least) in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{fn}: {name} must be an int >= {least}, got {value!r}")


def check_margin(margin: Any, fn: str) -> None:
    """Refuse a ``margin`` that is not a number >= 0."""
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not margin >= 0:
        raise ValueError(f"{fn}: margin must be a number >= 0, got {margin!r}")


def timing_device(model: nn.Module, device: Any, fn: str, hint: str) -> torch.device:
    """``device``, or that of the model's first parameter (CPU without one); never the meta device."""
    if device is None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
    device = torch.device(device)
    if device.type == "meta":
        raise ValueError(f"{fn}: nothing can be timed on the meta device; {hint}")
    return device
