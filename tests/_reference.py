"""The loss-scale rule of ``DynamicLossScale``'s docstring, as a few lines of Python: the reference
that tests/test_properties.py and tests/test_faults.py compare ``adjust`` against."""

import numpy as np


def reference_adjust(state: tuple[np.float32, int, int], finite: bool, opts: dict) -> tuple[np.float32, int, int]:
    """The rule of ``DynamicLossScale``'s docstring, in Python with numpy float32 arithmetic."""
    scale, counter, left = state
    growth, hysteresis = np.float32(opts.get("growth_factor", 2.0)), opts.get("hysteresis", 1)
    if finite:
        counter = (counter + 1) % opts.get("period", 2000)
        if counter == 0:
            with np.errstate(over="ignore"):  # overflow to inf is part of the rule
                grown = scale * growth
            if opts.get("max_loss_scale") is not None:
                grown = min(grown, np.float32(opts["max_loss_scale"]))
            scale = grown if np.isfinite(grown) else scale
        return scale, counter, hysteresis
    if left <= 1:
        backoff = opts.get("backoff_factor")
        scale = scale / growth if backoff is None else scale * np.float32(backoff)
        scale = max(scale, np.float32(opts.get("min_loss_scale", 1.0)))
    return scale, 0, max(left - 1, 1)
