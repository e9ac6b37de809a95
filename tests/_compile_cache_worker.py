"""One process of tests/test_compile_cache.py: load the compile cache, run two compiled steps, save the cache.

    python tests/_compile_cache_worker.py CACHE_DIR OUT_PREFIX [scan]

Writes ``OUT_PREFIX.json`` (the load and save results, inductor's and AOTAutograd's cache counters, the compile
phases, the C++ libraries in the inductor cache at the end) and ``OUT_PREFIX.pt`` (the tensors of the state
after two steps). ``TORCHINDUCTOR_CACHE_DIR`` is the caller's choice (an empty one: what a fresh machine has).
With ``scan``, the model's middle is a run of three alike blocks that ``functionalize(scan=)`` stacks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

import funcamp as fa
from funcamp import compile_cache, optim


def main(cache_dir: str, out: str, scan: bool = False) -> None:
    torch.manual_seed(0)
    if scan:
        blocks = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), nn.GELU()) for _ in range(3)])
        model = nn.Sequential(nn.Linear(8, 16), blocks, nn.Linear(16, 4))
    else:
        model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 4))
    policy = "params=float32,compute=bfloat16,output=float32"
    apply_fn, params = fa.nn.functionalize(model, policy, scan="1" if scan else None)
    assert tuple(getattr(apply_fn, "scan", ())) == (("1",) if scan else ())
    opt = optim.adamw(1e-2, weight_decay=0.1)
    state = fa.TrainState.create(params, opt, loss_scale=fa.DynamicLossScale(2.0**15))

    def loss_fn(p, batch):
        return torch.nn.functional.cross_entropy(apply_fn(p, batch["x"]), batch["y"])

    step = fa.make_train_step(loss_fn, opt)
    g = torch.Generator().manual_seed(1)
    batches = [{"x": torch.randn(32, 8, generator=g), "y": torch.randint(4, (32,), generator=g)} for _ in range(2)]
    key = compile_cache.step_key(state, batches[0], extra={"test": "compile_cache"})
    file = compile_cache.path(cache_dir, key)
    loaded = compile_cache.load(file, key)
    for batch in batches:
        state, metrics = step(state, batch)
    saved = compile_cache.save(file, key)
    from torch._dynamo.utils import compile_times, counters
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    root = Path(cache_dir())
    result = {
        "load": {"action": loaded.action, "artifacts": loaded.artifacts, "message": str(loaded)},
        "save": {"action": saved.action, "artifacts": saved.artifacts, "message": str(saved)},
        "inductor": dict(counters["inductor"]),
        "aot_autograd": dict(counters["aot_autograd"]),
        "libraries": sorted(f"{lib.parent.name}/{lib.name}" for lib in root.glob("??/*.so")),
        "phases": dict(zip(*compile_times(repr="csv", aggregate=True))),
        "loss": float(metrics["loss"]),
        "file": str(file),
    }
    leaves = [x for x in fa._tree.tree_leaves(state) if isinstance(x, torch.Tensor)]
    torch.save(leaves, out + ".pt")
    with open(out + ".json", "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], scan=sys.argv[3:] == ["scan"])
