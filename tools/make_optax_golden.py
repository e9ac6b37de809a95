"""Generate golden reference data from the real ``optax`` library (optax 0.2.8, jax 0.10.2, CPU).

The output is committed as ``tests/golden/optax_trajectories.json``; ``tests/test_optax_parity.py``
compares funcamp against it. jax and optax are NOT dependencies of funcamp (not at runtime, not in CI):
this script is only run by hand, in a private virtualenv.

How to run (from the repository root)::

    python3 -m venv /tmp/jaxenv
    /tmp/jaxenv/bin/pip install jax jaxlib optax==0.2.8 numpy
    /tmp/jaxenv/bin/python tools/make_optax_golden.py

It records, for each case, the parameters after each of ``STEPS`` updates (optax's own
``init``/``update``/``apply_updates``, un-jitted) from fixed parameters and fixed per-step gradients
(``numpy.random.RandomState``, written into the file, so funcamp replays exactly the same inputs): once in
float32 (jax's default) and once in float64 (the script re-runs itself with ``JAX_ENABLE_X64=1``), and
optax's schedules at every step of a range. The parameters are a nested dict (``{"enc": {"w", "b"},
"dec": {"w", "b"}}``), so that the mask and label trees can be prefixes of it, as optax allows.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "golden", "optax_trajectories.json")
GENERATOR = "tools/make_optax_golden.py"
STEPS = 10
SHAPES = {"enc": {"w": (2, 3), "b": (3,)}, "dec": {"w": (3, 2), "b": (2,)}}


def _nested(fn):
    return {group: {name: fn(group, name, shape) for name, shape in leaves.items()} for group, leaves in SHAPES.items()}


def inputs(seed: int = 0) -> tuple[dict, list[dict]]:
    """Parameters and STEPS gradients, float64 values rounded to float32 (the same numbers in both runs)."""
    rng = np.random.RandomState(seed)
    params = _nested(lambda g, n, s: rng.standard_normal(s).astype(np.float32).tolist())
    grads = [_nested(lambda g, n, s: rng.standard_normal(s).astype(np.float32).tolist()) for _ in range(STEPS)]
    return params, grads


def optimizers():
    """name -> (optax optimizer, the funcamp call that the test builds for it, as text)."""
    import optax

    adam_prefix = optax.adamw(0.1, weight_decay=0.5, mask={"enc": False, "dec": True})
    partial_mask = {"enc": True, "dec": {"w": False, "b": True}}
    labels = {"enc": "slow", "dec": {"w": "fast", "b": "frozen"}}
    return {
        "adam_eps_root": (optax.adam(0.05, 0.9, 0.999, 1e-8, 1e-3), "optim.adam(0.05, 0.9, 0.999, 1e-8, 1e-3)"),
        "adam_nesterov": (optax.adam(0.05, nesterov=True), "optim.adam(0.05, nesterov=True)"),
        "nadam": (optax.nadam(0.05, b1=0.8, b2=0.99), "optim.adam(0.05, 0.8, 0.99, nesterov=True)"),
        "adamw_nesterov_eps_root": (
            optax.adamw(0.05, 0.9, 0.99, 1e-6, 1e-4, weight_decay=0.1, nesterov=True),
            "optim.adamw(0.05, 0.9, 0.99, 1e-6, 1e-4, weight_decay=0.1, nesterov=True)",
        ),
        "adamw_prefix_mask": (adam_prefix, "optim.adamw(0.1, weight_decay=0.5, mask={'enc': False, 'dec': True})"),
        "masked_prefix": (
            optax.masked(optax.sgd(0.1, momentum=0.9), partial_mask),
            "optim.masked(optim.sgd(0.1, momentum=0.9), {'enc': True, 'dec': {'w': False, 'b': True}})",
        ),
        "masked_prefix_extra_args_false": (
            optax.masked(optax.adam(0.1), {"enc": False, "dec": True}, mask_compatible_extra_args=False),
            "optim.masked(optim.adam(0.1), {'enc': False, 'dec': True}, mask_compatible_extra_args=False)",
        ),
        "multi_transform_prefix": (
            optax.multi_transform(
                {"slow": optax.adam(0.01), "fast": optax.sgd(0.1), "frozen": optax.set_to_zero()}, labels
            ),
            "optim.multi_transform({'slow': optim.adam(0.01), 'fast': optim.sgd(0.1), "
            "'frozen': optim.set_to_zero()}, {'enc': 'slow', 'dec': {'w': 'fast', 'b': 'frozen'}})",
        ),
        "adamw_warmup_cosine_exponent": (
            optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 0.1, 3, 10, 0.01, exponent=2.0), weight_decay=0.1),
            "optim.adamw(optim.warmup_cosine_decay(0.1, 3, 10, end_value=0.01, exponent=2.0), weight_decay=0.1)",
        ),
    }


def schedules():
    """name -> (optax schedule, the funcamp call, as text, and the steps to evaluate)."""
    import optax

    wcd = optax.warmup_cosine_decay_schedule
    return {
        "wcd_exponent_2": (wcd(0.0, 1.0, 5, 25, 0.1, exponent=2.0), "warmup_cosine_decay(1.0, 5, 25, end_value=0.1, "
                           "exponent=2.0)"),
        "wcd_exponent_0.5": (wcd(0.2, 1.0, 5, 25, 0.0, exponent=0.5), "warmup_cosine_decay(1.0, 5, 25, init_value=0.2, "
                             "exponent=0.5)"),
        "wcd_peak_0": (wcd(0.0, 0.0, 5, 25), "warmup_cosine_decay(0.0, 5, 25)"),
        "wcd_peak_0_init_0.1": (wcd(0.1, 0.0, 5, 25), "warmup_cosine_decay(0.0, 5, 25, init_value=0.1)"),
        "wcd_peak_0_end_0.1": (wcd(0.0, 0.0, 5, 25, 0.1), "refused: optax drops end_value when the peak is 0"),
        "wcd_no_warmup_exponent_3": (wcd(0.0, 2.0, 0, 20, 0.5, exponent=3.0), "warmup_cosine_decay(2.0, 0, 20, "
                                     "end_value=0.5, exponent=3.0)"),
        "cosine_exponent_2": (optax.cosine_decay_schedule(1.0, 20, 0.1, 2.0), "cosine_decay(1.0, 20, 0.1, 2.0)"),
    }  # fmt: skip


def run_cases(dtype_name: str) -> dict:
    import jax.numpy as jnp
    import optax

    dtype = {"float32": jnp.float32, "float64": jnp.float64}[dtype_name]
    params0, grads = inputs()

    def to_jax(tree):
        return {g: {n: jnp.asarray(np.asarray(v, np.float64), dtype) for n, v in d.items()} for g, d in tree.items()}

    def to_list(tree):
        out = {}
        for g, d in tree.items():
            out[g] = {}
            for n, v in d.items():
                a = np.asarray(v)
                assert a.dtype == np.dtype(dtype_name), (g, n, a.dtype)
                out[g][n] = a.astype(np.float64).tolist()
        return out

    cases = {}
    for name, (opt, funcamp_call) in optimizers().items():
        params = to_jax(params0)
        state = opt.init(params)
        trajectory = []
        for g in grads:
            updates, state = opt.update(to_jax(g), state, params)
            params = optax.apply_updates(params, updates)
            trajectory.append(to_list(params))
        cases[name] = {"funcamp": funcamp_call, "params_after_each_step": trajectory}
    scheds = {}
    for name, (schedule, funcamp_call) in schedules().items():
        values = [float(np.asarray(schedule(jnp.asarray(t, jnp.int32)))) for t in range(30)]
        scheds[name] = {"funcamp": funcamp_call, "values_at_steps_0_to_29": values}
    return {"cases": cases, "schedules": scheds}


def main() -> None:
    if "--child" in sys.argv:
        import jax

        x64 = bool(jax.config.jax_enable_x64)
        print(json.dumps(run_cases("float64" if x64 else "float32")))
        return
    import jax
    import optax

    runs = {}
    for dtype_name, x64 in (("float32", "0"), ("float64", "1")):
        env = {**os.environ, "JAX_ENABLE_X64": x64, "JAX_PLATFORMS": "cpu"}
        out = subprocess.run([sys.executable, __file__, "--child"], env=env, check=True, capture_output=True, text=True)
        runs[dtype_name] = json.loads(out.stdout)
    params, grads = inputs()
    golden = {
        "generator": GENERATOR,
        "optax_version": optax.__version__,
        "jax_version": jax.__version__,
        "numpy_version": np.__version__,
        "platform": "cpu",
        "driver": (
            "optax's own init/update/apply_updates, un-jitted, one update per step, from 'params' with the "
            "per-step 'grads' (float32 values, drawn with numpy.random.RandomState(0)); 'float32' is jax's default "
            "precision, 'float64' the same run with JAX_ENABLE_X64=1 (every array float64). Each case's "
            "'funcamp' is the funcamp call the test builds for the optax optimizer of the same name. Schedules: "
            "optax's value at each int32 step count 0..29 (float32 in the 'float32' run)."
        ),
        "steps": STEPS,
        "params": params,
        "grads": grads,
        "float32": runs["float32"],
        "float64": runs["float64"],
    }
    with open(OUT, "w") as f:  # one line per top-level entry and case: small, and diffs stay readable
        f.write("{\n")
        entries = []
        for key, value in golden.items():
            if key in ("float32", "float64"):
                parts = []
                for section, items in value.items():
                    rows = ",\n".join(
                        f"   {json.dumps(k)}: {json.dumps(v, separators=(',', ':'))}" for k, v in items.items()
                    )
                    parts.append(f"  {json.dumps(section)}: {{\n{rows}\n  }}")
                entries.append(f" {json.dumps(key)}: {{\n" + ",\n".join(parts) + "\n }")
            else:
                entries.append(f" {json.dumps(key)}: {json.dumps(value, separators=(',', ':'))}")
        f.write(",\n".join(entries) + "\n}\n")
    json.loads(open(OUT).read())  # it parses
    counts = {k: len(v) for k, v in golden["float32"].items()}
    print(f"wrote {OUT}: {counts['cases']} optimizer cases, {counts['schedules']} schedules")


if __name__ == "__main__":
    main()
