"""Mixed-precision fundamentals, shown with funcamp: underflow, lost updates, loss scaling, memory.

    python examples/amp_basics.py

1. float16 underflows: 2**-25 becomes 0, 2**-24 (the smallest float16 subnormal) survives; bfloat16 has
   float32's exponent range and keeps both.
2. Lost updates: 1 + 1e-4 == 1 in float16 and bfloat16 (too few mantissa bits), not in float32. One
   hundred SGD updates of -6e-4 from 1.0 reach 0.9400020 with a float32 master copy and leave a bfloat16
   parameter at 1.0: why funcamp keeps master parameters in float32 (``params=float32`` in the policy).
3. Loss scaling: a gradient of 1e-8 computed in float16 flushes to zero; multiplying the loss by 2**15
   first brings it into float16's range, and funcamp unscales it in float32 afterwards. Rule of thumb
   (from jmp): the loss scale times the largest gradient must stay below 65504, float16's maximum.
4. Memory: GPT-2 (124M parameters) in float32, float16 and bfloat16, and what mixed-precision AdamW
   training holds per parameter.

Everything runs on the CPU in about a second; :func:`main` returns the numbers it prints (tests check them).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpt import GPT, SIZES  # noqa: E402

import funcamp as fa  # noqa: E402
from funcamp import optim  # noqa: E402

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
MIB = 2**20


def underflow() -> dict[str, float]:
    """What becomes of 2**-24 and 2**-25 in float16 and bfloat16."""
    return {
        "f16(2**-25)": torch.tensor(2.0**-25, dtype=F16).item(),
        "f16(2**-24)": torch.tensor(2.0**-24, dtype=F16).item(),
        "bf16(2**-25)": torch.tensor(2.0**-25, dtype=BF16).item(),
        "f16 max": torch.finfo(F16).max,
        "f16 smallest normal": torch.finfo(F16).tiny,
    }


def sgd_from_one(dtype: torch.dtype, steps: int = 100, lr: float = 6e-4) -> float:
    """``steps`` funcamp SGD updates with gradient 1 of a parameter 1.0 stored in ``dtype``."""
    opt = optim.sgd(lr)
    params = {"w": torch.ones((), dtype=dtype)}
    state = opt.init(params)
    for _ in range(steps):
        updates, state = opt.update({"w": torch.ones((), dtype=dtype)}, state, params)
        params = optim.apply_updates(params, updates)  # the sum is rounded to the parameter's dtype
    return params["w"].item()


def lost_update() -> dict[str, float]:
    """1 + 1e-4 per dtype, and 100 updates of -6e-4 per master dtype."""
    one_plus = {f"1 + 1e-4 in {n}": (torch.ones((), dtype=d) + 1e-4).item() for n, d in _NAMES.items()}
    master = get_master_demo()
    return {**one_plus, **{f"100 updates, {n} params": sgd_from_one(d) for n, d in _NAMES.items()}, **master}


def get_master_demo() -> dict[str, float]:
    """The mixed policy: float32 master, bfloat16 compute copy of the updated parameter."""
    policy = fa.get_policy("params=float32,compute=bfloat16,output=float32")
    w = torch.tensor(sgd_from_one(F32), dtype=policy.param_dtype)
    return {"bf16 compute copy of the f32 master": policy.cast_to_compute(w).item()}


def loss_scaling(scale: float = 2.0**15) -> dict[str, float]:
    """The gradient of ``1e-4 * sum(w * x)`` with ``x = 1e-4``, computed in float16, with and without scaling.

    The exact gradient is 1e-8 per element (float32 reference); float16's smallest subnormal is 5.96e-8.
    """
    policy = fa.get_policy("params=float32,compute=float16,output=float32")
    x = torch.full((4,), 1e-4)

    def loss_fn(params: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        p, xc = policy.cast_to_compute((params, x))
        return policy.cast_to_output((p["w"] * xc).sum() * 1e-4)

    params = {"w": torch.ones(4)}
    plain = fa.grad_and_value(loss_fn, fa.NoOpLossScale())(params, x)
    scaled = fa.grad_and_value(loss_fn, fa.StaticLossScale(scale))(params, x)
    reference = torch.func.grad(lambda p, x: (p["w"] * x).sum() * 1e-4)(params, x)
    return {
        "f32 reference gradient": reference["w"][0].item(),
        "f16 gradient, no loss scale": plain.grads["w"][0].item(),
        f"f16 gradient, loss scale 2**{int(torch.log2(torch.tensor(scale)))}": scaled.grads["w"][0].item(),
        "grads finite with scaling": bool(scaled.grads_finite),
    }


def gpt2_memory() -> dict[str, Any]:
    """Parameter bytes of a GPT-2-shaped model (examples/gpt.py, 124M) per dtype, in MiB."""
    with torch.device("meta"):  # shapes only: no 500 MB allocation
        model = GPT(SIZES["gpt2-124m"])
    try:
        from funcamp.memory import memory_footprint

        measure, how = memory_footprint, "funcamp.memory.memory_footprint"
    except ImportError:  # pragma: no cover - older funcamp
        measure, how = fa.tree_bytes, "funcamp.tree_bytes"
    params = dict(model.named_parameters())
    out: dict[str, Any] = {"parameters": sum(p.numel() for p in params.values()), "measured with": how}
    for name in _NAMES:
        out[f"{name} MiB"] = measure(fa.get_policy(name).cast_to_param(params)) / MIB
    n = out["parameters"]
    # f32 master + f32 gradient + two f32 AdamW moments + a half compute copy of the weights.
    out["mixed-precision AdamW training MiB (16 + 2 bytes/param, before activations)"] = n * 18 / MIB
    return out


_NAMES = {"float16": F16, "bfloat16": BF16, "float32": F32}


def _format(value: Any) -> str:
    """A number for the value column: bools as True/False, ints with thousands separators."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if value.is_integer():
        return f"{value:g}"
    return f"{value:.7f}" if 1e-3 <= abs(value) < 1e4 else f"{value:.6e}"


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    """Print every section and return its numbers."""
    del argv
    sections = {
        "1. float16 underflow": underflow(),
        "2. lost updates (why master weights stay float32)": lost_update(),
        "3. loss scaling rescues small float16 gradients": loss_scaling(),
        "4. memory footprint of GPT-2 (124M parameters)": gpt2_memory(),
    }
    for title, numbers in sections.items():
        notes = [f"{key} {value}" for key, value in numbers.items() if isinstance(value, str)]
        print(title + (f" ({'; '.join(notes)})" if notes else ""))  # text beside the title, numbers in the column
        for key, value in numbers.items():
            if not isinstance(value, str):
                print(f"  {key:<76} {_format(value)}")
    return sections


if __name__ == "__main__":
    main(sys.argv[1:])
