"""Generate golden reference data from the real ``jmp`` library (jmp 0.0.4).

The output is committed under ``tests/golden/`` as golden data; funcamp's
tests compare against it. jax and jmp are NOT dependencies of funcamp (not at
runtime, not in CI): this script is only run by hand, in a private virtualenv.

How to run (from the repository root)::

    python3 -m venv /tmp/jmpvenv
    /tmp/jmpvenv/bin/pip install jax jmp==0.0.4 numpy
    /tmp/jmpvenv/bin/python tools/make_jmp_golden.py

It writes:

* ``tests/golden/jmp_loss_scale.json``: step-by-step trajectories of
  ``jmp.DynamicLossScale.adjust`` (float32 scales recorded exactly, int
  counters), driven un-jitted; every case is also re-run through a jitted
  ``adjust`` and the JSON records whether the two agree (they do not when
  ``min_loss_scale != 1``: jmp 0.0.4's ``tree_flatten`` drops
  ``min_loss_scale``, so across a jit boundary it resets to the default 1.0;
  nor for factor 3, where jitted XLA computes ``scale * (1/3)`` instead of
  ``scale / 3``). The plain trajectories are also checked against a float32
  NumPy model of the update rule.
* ``tests/golden/jmp_policy.json``: what ``jmp.get_policy(s)`` returns on CPU
  (dtypes mapped to torch-style names), or the exception type it raises.
"""

import itertools
import json
import os
import sys

import jax
import jax.numpy as jnp
import jmp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(ROOT, "tests", "golden")
GENERATOR = "tools/make_jmp_golden.py"

# ---------------------------------------------------------------------------
# Loss scale trajectories
# ---------------------------------------------------------------------------

# (name, initial_scale, period, factor, min_loss_scale, seed, p_nonfinite, steps)
LOSS_SCALE_CASES = [
    ("a_defaults_p0.001", 2.0**15, 2000, 2, 1.0, 0, 0.001, 3000),
    ("a_defaults_p0.0005", 2.0**15, 2000, 2, 1.0, 1, 0.0005, 3000),
    ("b_period1_p0.3", 2.0**15, 1, 2, 1.0, 2, 0.3, 3000),
    ("c_period2_p0.3", 2.0**15, 2, 2, 1.0, 3, 0.3, 3000),
    ("d_period5_p0.1", 2.0**15, 5, 2, 1.0, 4, 0.1, 3000),
    ("e_period10_factor3_p0.05", 2.0**15, 10, 3, 1.0, 5, 0.05, 3000),
    ("f_saturate_2pow127", 2.0**120, 1, 2, 1.0, 6, 0.01, 3000),
    ("g_backoff_to_floor", 2.0**15, 100, 2, 1.0, 7, 0.9, 3000),
    ("h_tiny_floor", 1.0, 3, 2, 2.0**-10, 8, 0.8, 3000),
    # Extra edge cases.
    ("i_factor3_saturate", 2.0**120, 1, 3, 1.0, 9, 0.01, 3000),
    ("j_floor_not_power_of_factor", 2.0**4, 2, 2, 3.0, 10, 0.6, 3000),
    ("k_initial_below_floor", 0.5, 2, 2, 1.0, 11, 0.5, 300),
    ("l_all_finite_period2000", 2.0**15, 2000, 2, 1.0, 12, 0.0, 4500),
]


def draw_flags(seed, p_nonfinite, steps):
    """finite[i] = RandomState(seed).random_sample(steps)[i] >= p_nonfinite."""
    rng = np.random.RandomState(seed)
    return rng.random_sample(steps) >= p_nonfinite


def _record(state):
    scale = np.asarray(state.loss_scale)
    counter = np.asarray(state.counter)
    assert scale.dtype == np.float32, scale.dtype
    assert counter.dtype == np.int32, counter.dtype
    return float(scale), int(counter)


def run_trajectory(initial, period, factor, min_scale, flags, jit):
    state = jmp.DynamicLossScale(
        jnp.asarray(initial, jnp.float32),
        period=period,
        factor=factor,
        min_loss_scale=jnp.asarray(min_scale, jnp.float32),
    )
    step = jax.jit(lambda s, g: s.adjust(g)) if jit else (lambda s, g: s.adjust(g))
    scales, counters = [], []
    for flag in flags:
        state = step(state, jnp.asarray(bool(flag)))
        s, c = _record(state)
        scales.append(s)
        counters.append(c)
    return scales, counters


def numpy_reference(initial, period, factor, min_scale, flags, reciprocal=False, floor_override=None):
    """Float32 NumPy model of jmp 0.0.4 adjust, used only to cross-check.

    reciprocal=True models backoff as x * float32(1/factor) (what XLA's jit
    does for a constant divisor); floor_override models a lost min_loss_scale.
    """
    f32 = np.float32
    scale, counter = f32(initial), 0
    floor = f32(min_scale if floor_override is None else floor_override)
    fac = f32(factor)
    scales, counters = [], []
    with np.errstate(over="ignore"):
        for flag in flags:
            if flag:
                if counter == period - 1:
                    grown = scale * fac
                    if np.isfinite(grown):
                        scale = grown
                counter = (counter + 1) % period
            else:
                backed = scale * (f32(1) / fac) if reciprocal else scale / fac
                scale = max(floor, backed)
                counter = 0
            scales.append(float(scale))
            counters.append(counter)
    return scales, counters


def explain_jit(initial, period, factor, min_scale, flags, jscales, jcounters):
    reasons = []
    for recip, floor in [(False, 1.0), (True, None), (True, 1.0)]:
        got = numpy_reference(initial, period, factor, min_scale, flags, recip, floor)
        if got == (jscales, jcounters):
            parts = []
            if floor is not None:
                parts.append("min_loss_scale reset to 1.0 (dropped by tree_flatten)")
            if recip:
                parts.append("backoff computed as scale * float32(1/factor) instead of scale / factor")
            reasons.append(" and ".join(parts))
    return reasons[0] if reasons else "unexplained"


def make_loss_scale_cases():
    cases = []
    for name, initial, period, factor, min_scale, seed, p, steps in LOSS_SCALE_CASES:
        flags = draw_flags(seed, p, steps)
        scales, counters = run_trajectory(initial, period, factor, min_scale, flags, jit=False)
        jscales, jcounters = run_trajectory(initial, period, factor, min_scale, flags, jit=True)
        ref = numpy_reference(initial, period, factor, min_scale, flags)
        assert ref == (scales, counters), f"{name}: plain jmp != numpy model"
        for s in scales:
            assert np.isfinite(s), (name, s)
            assert float(np.float32(s)) == s, (name, s)
        case = {
            "name": name,
            "initial_scale": initial,
            "period": period,
            "factor": factor,
            "min_loss_scale": min_scale,
            "seed": seed,
            "p_nonfinite": p,
            "steps": steps,
            "flags": "".join("1" if f else "0" for f in flags),
            "scales": scales,
            "counters": counters,
            "jit_identical": scales == jscales and counters == jcounters,
        }
        if not case["jit_identical"]:
            diverge = next(i for i in range(steps) if scales[i] != jscales[i] or counters[i] != jcounters[i])
            case["jit_first_divergence_step"] = diverge
            case["jit_explained_by"] = explain_jit(initial, period, factor, min_scale, flags, jscales, jcounters)
            case["jit_scales"] = jscales
            case["jit_counters"] = jcounters
        cases.append(case)
        print(
            f"{name}: final scale {scales[-1]!r}, min {min(scales)!r}, "
            f"max {max(scales)!r}, jit_identical={case['jit_identical']}",
            file=sys.stderr,
        )
    return cases


# ---------------------------------------------------------------------------
# Policies
# ---------------------------------------------------------------------------

KEYS = {"p": ("p", "params"), "c": ("c", "compute"), "o": ("o", "output")}
DTYPE_NAMES = ["half", "full", "f16", "float16", "bf16", "bfloat16", "f32", "float32", "f64", "float64"]

REJECT_CANDIDATES = [
    "",
    "c=f16,",
    ",c=f16",
    "c=f16,,o=f32",
    "p=f32,x=f16",
    "x=f16",
    "x=float8",
    "c=float8",
    "c=f8",
    "c=f16=f32",
    "p=f16=bf16=f32",
    " c=f16",
    "c =f16",
    "c= f16",
    "c=f16 ",
    "p=f32, c=f16",
    "C=F16",
    "C=f16",
    "c=F16",
    "P=f32",
    "fp16",
    "fp32",
    "F16",
    "FULL",
    "Half",
    "f",
    "h",
    "b",
    "bf",
    "float",
    "double",
    "int8",
    "f16,bf16",
    "c=",
    "=f16",
    "=",
    "c:f16",
    "c=f16;o=f32",
    "param=f32",
    "parameters=f32",
    "out=f16",
    "comp=f16",
    "p=int32",
    "c=float",
]


def dtype_name(dtype):
    return jnp.dtype(dtype).name  # float16 / bfloat16 / float32 / float64


def policy_case(s):
    try:
        pol = jmp.get_policy(s)
    except Exception as e:  # noqa: BLE001 - we record whatever jmp raises
        return {"input": s, "error": type(e).__name__, "message": str(e)}
    return {
        "input": s,
        "param": dtype_name(pol.param_dtype),
        "compute": dtype_name(pol.compute_dtype),
        "output": dtype_name(pol.output_dtype),
    }


def policy_inputs():
    inputs = []
    # Single-dtype strings.
    inputs += DTYPE_NAMES
    # Every key alias with every dtype name, alone.
    for pos in ("p", "c", "o"):
        for alias in KEYS[pos]:
            for d in DTYPE_NAMES:
                inputs.append(f"{alias}={d}")
    # Two keys, short aliases, both orders, a representative dtype subset.
    sub = ["half", "full", "bf16", "f32", "f64"]
    for k1, k2 in itertools.permutations(("p", "c", "o"), 2):
        for d1 in sub:
            for d2 in sub:
                inputs.append(f"{k1}={d1},{k2}={d2}")
    # Two keys with long aliases / mixed aliases.
    for k1, k2 in itertools.permutations(("p", "c", "o"), 2):
        for a1 in KEYS[k1]:
            for a2 in KEYS[k2]:
                inputs.append(f"{a1}=float16,{a2}=bfloat16")
    # Three keys, all orders, all alias combinations.
    for perm in itertools.permutations(("p", "c", "o")):
        for aliases in itertools.product(*(KEYS[k] for k in perm)):
            dts = ("f32", "bf16", "f16")
            inputs.append(",".join(f"{a}={d}" for a, d in zip(aliases, dts)))
    # Three keys, all short, a dtype grid.
    for d1, d2, d3 in itertools.product(["f16", "bf16", "f32", "f64"], repeat=3):
        inputs.append(f"p={d1},c={d2},o={d3}")
    # Duplicate keys (last one wins?).
    inputs += ["c=f16,c=bf16", "p=f16,params=bf16", "o=f32,output=f16,o=bf16", "c=f16,compute=f32"]
    inputs += REJECT_CANDIDATES
    seen, out = set(), []
    for s in inputs:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def make_policy_cases():
    return [policy_case(s) for s in policy_inputs()]


# ---------------------------------------------------------------------------


def write_json(path, header, cases):
    """One case per line: compact but diff-friendly."""
    with open(path, "w") as f:
        f.write("{\n")
        for k, v in header.items():
            f.write(f" {json.dumps(k)}: {json.dumps(v)},\n")
        f.write(' "cases": [\n')
        for i, c in enumerate(cases):
            sep = "," if i + 1 < len(cases) else ""
            f.write("  " + json.dumps(c, separators=(",", ":")) + sep + "\n")
        f.write(" ]\n}\n")


def main():
    assert jmp.__version__ == "0.0.4", jmp.__version__
    platform = jax.devices()[0].platform
    assert platform == "cpu", platform
    os.makedirs(OUT_DIR, exist_ok=True)
    common = {
        "generator": GENERATOR,
        "jmp_version": jmp.__version__,
        "jax_version": jax.__version__,
        "numpy_version": np.__version__,
        "platform": platform,
        "jax_enable_x64": bool(jax.config.jax_enable_x64),
    }

    ls_cases = make_loss_scale_cases()
    ls_header = dict(common)
    ls_header.update(
        {
            "driver": "plain (un-jitted) DynamicLossScale.adjust, one call per step; "
            "'scales'/'counters' are from the plain run. Each case was also "
            "run with jax.jit(lambda s, g: s.adjust(g)); 'jit_identical' says "
            "whether it matched, and if not 'jit_scales'/'jit_counters' hold "
            "the jitted trajectory and 'jit_explained_by' why it differs "
            "(jmp 0.0.4 tree_flatten drops min_loss_scale, which resets to "
            "1.0 under jit; XLA's jit also turns division by a constant "
            "non-power-of-two factor into a reciprocal multiply). Plain "
            "scales equal a float32 NumPy model using true division.",
            "state_init": "jmp.DynamicLossScale(jnp.asarray(initial_scale, jnp.float32), "
            "period=period, factor=factor, "
            "min_loss_scale=jnp.asarray(min_loss_scale, jnp.float32)); "
            "counter starts at 0",
            "flags_rule": "finite = numpy.random.RandomState(seed).random_sample(steps) "
            ">= p_nonfinite; flags[i] == '1' means grads finite at step i",
            "values": "scales[i]/counters[i] are the state after step i; scales are "
            "float32 values stored exactly as Python floats",
        }
    )
    write_json(os.path.join(OUT_DIR, "jmp_loss_scale.json"), ls_header, ls_cases)

    pol_cases = make_policy_cases()
    pol_header = dict(common)
    pol_header.update(
        {
            "half_dtype": dtype_name(jmp.half_dtype()),
            "note": "dtypes mapped to torch-style names via jnp.dtype(d).name; "
            "'half' is jmp.half_dtype(), float16 on non-TPU backends. f64 "
            "policies report float64 even though, with x64 disabled, jax "
            "would cast to float32. Rejected inputs record the exception "
            "type name in 'error' and str(exception) in 'message'.",
        }
    )
    write_json(os.path.join(OUT_DIR, "jmp_policy.json"), pol_header, pol_cases)

    # Validate: load back and check counts / shapes.
    with open(os.path.join(OUT_DIR, "jmp_loss_scale.json")) as f:
        ls = json.load(f)
    assert len(ls["cases"]) == len(LOSS_SCALE_CASES)
    for c, spec in zip(ls["cases"], LOSS_SCALE_CASES):
        assert c["name"] == spec[0]
        n = c["steps"]
        assert len(c["flags"]) == len(c["scales"]) == len(c["counters"]) == n
        assert c == next(x for x in ls_cases if x["name"] == c["name"])
    with open(os.path.join(OUT_DIR, "jmp_policy.json")) as f:
        pol = json.load(f)
    assert pol["cases"] == pol_cases
    n_err = sum("error" in c for c in pol_cases)
    print(f"loss scale: {len(ls_cases)} cases; policy: {len(pol_cases)} cases ({n_err} rejected)", file=sys.stderr)


if __name__ == "__main__":
    main()
