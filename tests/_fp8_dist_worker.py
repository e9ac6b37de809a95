"""Worker for tests/test_fp8.py, run as ``torchrun --standalone --nproc_per_node=2 _fp8_dist_worker.py OUT``.

Each rank runs :data:`STEPS` calls of a small compiled step (aot_eager, fullgraph) that does what
``make_train_step`` does with buffers under data parallelism: forward, one finite flag for all ranks,
:func:`funcamp.parallel.reduce_buffers` on the new buffers, keep them only where the step is finite.
The model is a delayed-recipe fp8 Linear, a BatchNorm (running statistics: averaged) and another fp8
Linear. Rank r's inputs have a different size each step (:func:`inputs`); at :data:`ZERO_STEP` rank 0's
input is all zeros, at :data:`SKIP_STEP` rank 1's loss is inf. Each rank saves, per step, the buffers it
started from, its own new buffers before the reduction and the kept ones, to ``OUT/rank<r>.pt``.
Importing this module has no side effects (pytest imports it).
"""

from __future__ import annotations

import sys

import torch

import funcamp as fa
from funcamp import fp8, optim, parallel

STEPS = 4
ZERO_STEP = 1  # rank 0's input is all zeros: its amax is 0, its scale stays as it was
SKIP_STEP = 2  # rank 1's loss is inf: every rank keeps its old buffers
RECIPE = fp8.Recipe("delayed", amax_history_len=4)


def make_model() -> tuple:
    """``(apply_fn, params, buffers)`` of the fp8 model, the same on every rank (seed 0)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 32))
    model = fp8.convert(model, RECIPE, filter=["0", "2"])
    return fa.nn.functionalize(model, "f32", module_policies=fp8.MODULE_POLICIES, with_buffers=True)


def inputs(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, ok)``: rank r's ``(16, 32)`` input and the loss factor. The inputs grow 10x a step (so each
    step's amax is a new maximum of the history) and the rank with the larger one alternates."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(16, 32, generator=gen) * 10.0**step * (1.0 + 2.0 * ((step + rank) % 2))
    if step == ZERO_STEP and rank == 0:
        x = torch.zeros_like(x)
    ok = torch.tensor(torch.inf if step == SKIP_STEP and rank == 1 else 1.0)
    return x, ok


def main(out: str) -> None:
    rank, world, _ = parallel.setup_from_env("gloo")
    assert world == 2, world
    group = parallel.resolve_group(True)
    apply_fn, params, buffers = make_model()

    def step(buffers, x, ok):  # the buffer logic of make_train_step's data-parallel branch
        y, new = apply_fn(params, buffers, x)
        finite = parallel.all_ranks_true(torch.isfinite(y.square().mean() * ok), group)
        reduced = parallel.reduce_buffers(new, group, reductions=apply_fn.buffer_reductions)  # as the fp8 layers say
        return new, fa.select_tree(finite, reduced, buffers)

    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    steps = []
    for s in range(STEPS):
        x, ok = inputs(s, rank)
        local, kept = compiled(buffers, x, ok)
        steps.append({"start": buffers, "local": local, "kept": kept})
        buffers = kept
    eager = parallel.reduce_buffers(steps[0]["local"], group, reductions=apply_fn.buffer_reductions)  # eager: waits
    legacy = parallel.reduce_buffers(steps[0]["local"], group)  # no reductions: fp8's names (deprecated fallback)

    # make_train_step itself (data_parallel=True): one step from the initial buffers on this rank's input.
    def loss_fn(p, b, x):
        y, new = apply_fn(p, b, x)
        return y.square().mean(), new

    opt = optim.sgd(0.0)
    state = fa.TrainState.create(params, opt, buffers=make_model()[2], buffer_reductions=apply_fn.buffer_reductions)
    train_step = fa.make_train_step(loss_fn, opt, data_parallel=True, backend="aot_eager")
    x, _ = inputs(0, rank)
    state, _ = train_step(state, x)
    old_state = fa.TrainState.create(params, opt, buffers=make_model()[2])  # made without buffer_reductions=
    old_state, _ = fa.make_train_step(loss_fn, opt, data_parallel=True, compile=False)(old_state, x)
    torch.save(
        {
            "steps": steps,
            "eager": eager,
            "legacy": legacy,
            "frames": counter.frame_count,
            "train_step_buffers": state.buffers,
            "train_step_legacy_buffers": old_state.buffers,
        },
        f"{out}/rank{rank}.pt",
    )
    parallel.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
