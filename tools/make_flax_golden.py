"""Generate golden loss-scale trajectories from the real ``flax`` library (flax 0.12.8, jax 0.10.2, CPU).

The output is committed as ``tests/golden/flax_dynamic_scale.json``; ``tests/test_loss_scale.py`` checks
that funcamp's ``DynamicLossScale`` with flax's settings spelled in funcamp's names (``period =
growth_interval + 1``, ``min_loss_scale`` = float32's tiny, ``backoff_factor``, ``max_loss_scale`` = float32's
max) reproduces them step by step. jax and flax are NOT dependencies of funcamp (not at runtime, not in
CI): this script is only run by hand, in a private virtualenv.

How to run (from the repository root)::

    python3 -m venv /tmp/jaxenv
    /tmp/jaxenv/bin/pip install jax jaxlib flax==0.12.8 numpy
    /tmp/jaxenv/bin/python tools/make_flax_golden.py

Each trajectory is flax's own ``flax.training.dynamic_scale.DynamicScale.value_and_grad`` run un-jitted,
one call per step, on ``fun(p, x) = sum(p * x)`` with ``x = [1, 0.5, 0.25]`` (so that ``scale * x`` is
finite up to float32's max) and an ``inf`` in it on the steps that must be non-finite (``finite[i] =
numpy.random.RandomState(seed).random_sample(steps)[i] >= p_nonfinite``); after each step it records the
returned ``dynamic_scale.scale`` (float32, exactly), ``fin_steps`` and ``finite``.
Flags and scales are stored run-length encoded (``[[value, repeats], ...]``); ``fin_steps`` as the steps
where it is 0 (elsewhere it is one more than at the step before, 0 before the first, which the script checks).
"""

from __future__ import annotations

import json
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "golden", "flax_dynamic_scale.json")
GENERATOR = "tools/make_flax_golden.py"
F32_TINY = float(np.finfo(np.float32).tiny)

# name -> (DynamicScale keyword arguments, [(seed, p_nonfinite, steps), ...])
CONFIGS = {
    "defaults": ({}, [(0, 0.0, 2100), (1, 0.0005, 2300), (2, 0.5, 200), (3, 1.0, 200)]),
    "interval_0": (
        {"growth_interval": 0, "scale": 2.0**15},
        [(4, 0.0, 40), (5, 0.1, 200), (6, 0.3, 200), (7, 0.7, 200)],
    ),
    "interval_3_factor_3_backoff_0.25": (
        {"growth_interval": 3, "growth_factor": 3.0, "backoff_factor": 0.25, "scale": 1000.0},
        [(8, 0.0, 60), (9, 0.1, 200), (10, 0.3, 200), (11, 0.7, 200)],
    ),
    "interval_2_near_the_floor": (
        {"growth_interval": 2, "scale": 2.0**-120},
        [(12, 0.9, 100), (13, 0.6, 200), (14, 0.95, 200), (15, 0.2, 200)],
    ),
    "interval_0_near_the_top": (
        {"growth_interval": 0, "scale": 2.0**124},
        [(16, 0.0, 10), (17, 0.05, 200), (18, 0.2, 200), (19, 0.5, 200)],
    ),
}


# The example of docs/loss-scaling.md and of DynamicLossScale's docstring: these flags, given, not drawn.
DOCS_EXAMPLE = ({"growth_interval": 2}, [True, True, True, True, False, True, True, True])


def rle(values):
    out = []
    for v in values:
        if out and out[-1][0] == v:
            out[-1][1] += 1
        else:
            out.append([v, 1])
    return out


def run(kwargs, seed, p_nonfinite, steps, finite=None):
    import jax.numpy as jnp
    from flax.training.dynamic_scale import DynamicScale

    if finite is None:
        finite = np.random.RandomState(seed).random_sample(steps) >= p_nonfinite
    ds = DynamicScale(**kwargs)
    p = jnp.ones(3, jnp.float32)

    def fun(p, x):
        return jnp.sum(p * x)

    scales, fin_steps, flags = [], [], []
    for ok in finite:
        x = jnp.asarray([1.0, 0.5, 0.25 if ok else np.inf], jnp.float32)  # scale * x stays finite
        ds, is_finite, _, _ = ds.value_and_grad(fun)(p, x)
        scale = np.asarray(ds.scale)
        assert scale.dtype == np.float32, scale.dtype
        assert bool(is_finite) == bool(ok)
        scales.append(float(scale))
        fin_steps.append(int(ds.fin_steps))
        flags.append(bool(is_finite))
    # fin_steps is 0 where it resets (a non-finite step, a growth) and one more than the step before elsewhere:
    # stored as the steps where it is 0, with a check that the rest follows.
    zeros = [i for i, n in enumerate(fin_steps) if n == 0]
    previous = 0  # the initial fin_steps
    for n in fin_steps:
        assert n == 0 or n == previous + 1
        previous = n
    return {"finite": rle(flags), "scales": rle(scales), "fin_steps_zero_at": zeros}


def main() -> None:
    import flax
    import jax
    from flax.training.dynamic_scale import DynamicScale

    default = DynamicScale()
    cases = {}
    for name, (kwargs, sequences) in CONFIGS.items():
        ds = DynamicScale(**kwargs)
        settings = {
            "growth_factor": ds.growth_factor,
            "backoff_factor": ds.backoff_factor,
            "growth_interval": ds.growth_interval,
            "scale": float(ds.scale),
            "minimum_scale": None if ds.minimum_scale is None else float(ds.minimum_scale),
        }
        runs = [{"seed": s, "p_nonfinite": p, "steps": n, **run(kwargs, s, p, n)} for s, p, n in sequences]
        cases[name] = {"flax_arguments": kwargs, "flax_settings": settings, "runs": runs}
    kwargs, flags = DOCS_EXAMPLE
    ds = DynamicScale(**kwargs)
    settings = {"growth_factor": ds.growth_factor, "backoff_factor": ds.backoff_factor}
    settings.update(growth_interval=ds.growth_interval, scale=float(ds.scale), minimum_scale=float(ds.minimum_scale))
    example = {"seed": None, "p_nonfinite": None, "steps": len(flags), **run(kwargs, None, None, None, flags)}
    cases["docs_example"] = {"flax_arguments": kwargs, "flax_settings": settings, "runs": [example]}
    golden = {
        "generator": GENERATOR,
        "flax_version": flax.__version__,
        "jax_version": jax.__version__,
        "numpy_version": np.__version__,
        "platform": "cpu",
        "flax_defaults": {
            "growth_factor": default.growth_factor,
            "backoff_factor": default.backoff_factor,
            "growth_interval": default.growth_interval,
            "scale": float(default.scale),
            "minimum_scale": float(default.minimum_scale),
            "float32_tiny": F32_TINY,
        },
        "driver": (
            "flax.training.dynamic_scale.DynamicScale.value_and_grad, un-jitted, one call per step, on "
            "fun(p, x) = sum(p * x), x = [1, 0.5, 0.25] with an inf on the non-finite steps (finite[i] = "
            "RandomState(seed).random_sample(steps)[i] >= p_nonfinite); after each step the returned scale "
            "(float32) and finite, run-length encoded as [[value, repeats], ...], and fin_steps as the steps "
            "where it is 0 (elsewhere one more than the step before)."
        ),
        "cases": cases,
    }
    with open(OUT, "w") as f:
        f.write(json.dumps(golden, separators=(",", ":")).replace('},{"seed"', '},\n{"seed"') + "\n")
    json.loads(open(OUT).read())
    print(f"wrote {OUT}: {sum(len(c['runs']) for c in cases.values())} trajectories")


if __name__ == "__main__":
    main()
