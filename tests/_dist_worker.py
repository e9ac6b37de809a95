"""Worker for tests/test_parallel.py, run as ``torchrun --standalone --nproc_per_node=2 _dist_worker.py OUT``.

Each rank runs every scenario on its shard of the batches and saves what it saw per step to
``OUT/<scenario>_rank<r>.pt``; the test compares the ranks with each other and with one process run
on the whole batch (:func:`run`, without ``data_parallel``). Kept small: one compiled scenario, the
others eager. Importing this module has no side effects (pytest imports it for doctests).
"""

from __future__ import annotations

import sys
from typing import Any

import torch

import funcamp as fa
from funcamp import optim, parallel

B = 4  # per-rank batch
STEPS = 5
POISON_STEP = 2  # 0-based: the third step
F_IN, HIDDEN, CLASSES = 8, 16, 4


def init_params(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(F_IN, HIDDEN, generator=g) / F_IN**0.5,
        "b1": torch.zeros(HIDDEN),
        "w2": torch.randn(HIDDEN, CLASSES, generator=g) / HIDDEN**0.5,
    }


def batches(world: int = 2, poison_rank: int | None = None) -> list[dict[str, torch.Tensor]]:
    """``STEPS`` global batches of ``world * B`` samples; rank r's shard is rows ``[r*B, (r+1)*B)``.

    ``poison`` is 0 except, with ``poison_rank``, on that rank's rows at ``POISON_STEP``: there it
    makes the float16 backward overflow (the loss itself stays finite).
    """
    g = torch.Generator().manual_seed(1234)
    out = []
    for step in range(STEPS):
        poison = torch.zeros(world * B)
        if poison_rank is not None and step == POISON_STEP:
            poison[poison_rank * B : (poison_rank + 1) * B] = 8.0
        out.append(
            {
                "x": torch.randn(world * B, F_IN, generator=g),
                "y": torch.randint(0, CLASSES, (world * B,), generator=g),
                "poison": poison,
            }
        )
    return out


def shard(batch: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    return {k: v[rank * B : (rank + 1) * B] for k, v in batch.items()}


def make_loss_fn(policy: fa.Policy):
    def loss_fn(params: Any, batch: Any) -> torch.Tensor:
        p, x = policy.cast_to_compute((params, batch["x"]))
        h = torch.tanh(x @ p["w1"] + p["b1"])
        logits = policy.cast_to_output(h @ p["w2"]).float()
        loss = torch.nn.functional.cross_entropy(logits, batch["y"])
        # Zero unless poisoned; then d/d(b1) = poison * loss_scale overflows float16 (32768 * 8 > 65504).
        trap = (p["b1"] * batch["poison"].mean().to(p["b1"].dtype)).sum().float()
        return loss + trap

    return loss_fn


def make_buffer_loss_fn(policy: fa.Policy):
    """``loss_fn(params, buffers, batch) -> (loss, new_buffers)``: a running mean of the inputs and a count."""
    base = make_loss_fn(policy)

    def loss_fn(params: Any, buffers: Any, batch: Any) -> Any:
        new = {"mean": 0.9 * buffers["mean"] + 0.1 * batch["x"].mean(0), "count": buffers["count"] + 1}
        return base(params, batch), new

    return loss_fn


SCENARIOS: dict[str, dict[str, Any]] = {
    # name: policy, loss scale, optimizer, accumulation steps, poisoned rank
    "bf16": dict(policy="p=f32,c=bf16,o=f32", scale=None, opt="adam", k=1, poison=None),
    "bf16_accum": dict(policy="p=f32,c=bf16,o=f32", scale=None, opt="adam", k=2, poison=None),
    "f16": dict(policy="p=f32,c=f16,o=f32", scale=2.0**15, opt="adam", k=1, poison=None),
    "f16_inf": dict(policy="p=f32,c=f16,o=f32", scale=2.0**15, opt="adam", k=1, poison=1),
    "f32": dict(policy="p=f32,c=f32", scale=None, opt="sgd", k=1, poison=None),
    "r_f32": dict(policy="p=f32,c=f32,r=f32", scale=None, opt="sgd", k=1, poison=None),
    "r_bf16": dict(policy="p=f32,c=f32,r=bf16", scale=None, opt="sgd", k=1, poison=None),
    "buffers": dict(policy="p=f32,c=bf16,o=f32", scale=None, opt="adam", k=1, poison=None, buffers=True),
}


def _optimizer(name: str) -> optim.GradientTransformation:
    return optim.adam(1e-2) if name == "adam" else optim.sgd(0.5)


def run(
    name: str,
    params: dict[str, torch.Tensor],
    rank: int | None = None,
    *,
    data_parallel: Any = None,
    compile_backend: Any = None,
    accumulation_steps: int | None = None,
) -> list[dict[str, Any]]:
    """Run scenario ``name`` for ``STEPS`` steps; ``rank`` None means one process on the whole batch.

    ``accumulation_steps`` overrides the scenario's (one process with ``2 * k`` micro-batches does the
    same float operations per micro-batch as two ranks with ``k`` each).
    """
    cfg = SCENARIOS[name]
    policy = fa.get_policy(cfg["policy"])
    opt = _optimizer(cfg["opt"])
    scale = fa.DynamicLossScale(cfg["scale"]) if cfg["scale"] else fa.NoOpLossScale()
    buffers = {"mean": torch.zeros(F_IN), "count": torch.zeros((), dtype=torch.int32)} if cfg.get("buffers") else None
    state = fa.TrainState.create(params, opt, loss_scale=scale, buffers=buffers)
    step = fa.make_train_step(
        make_buffer_loss_fn(policy) if buffers else make_loss_fn(policy),
        opt,
        accumulation_steps=accumulation_steps or cfg["k"],
        data_parallel=data_parallel,
        policy=policy,
        compile=compile_backend is not None,
        backend=compile_backend,
    )
    world = 1 if rank is None else 2
    records = []
    for batch in batches(2, cfg["poison"]):
        state, m = step(state, batch if rank is None else shard(batch, rank))
        records.append(
            {
                "params": {k: v.detach().clone() for k, v in state.params.items()},
                "loss_scale": m["loss_scale"].clone(),
                "new_loss_scale": state.loss_scale.loss_scale.clone(),
                "grads_finite": m["grads_finite"].clone(),
                "loss": m["loss"].clone(),
                "skipped_steps": state.skipped_steps.clone(),
                "world": world,
                "buffers": state.buffers,
            }
        )
    return records


def _collectives(rank: int) -> dict[str, Any]:
    """Direct checks of the helpers: flag agreement, mean, broadcast (eager and compiled)."""
    group = parallel.resolve_group(True)
    flags = [parallel.all_ranks_true(torch.tensor(v), group) for v in (rank == 0, True, False)]
    compiled_flag = torch.compile(parallel.all_ranks_true, fullgraph=True, backend="aot_eager")
    mean = parallel.mean_over_ranks(torch.tensor(float(rank + 1)), group)
    grads = {"a": torch.full((3,), float(rank)), "b": torch.full((2, 2), 2.0**-12 * (rank + 1))}
    return {
        "flags": [bool(f) for f in flags],
        "compiled_flag": bool(compiled_flag(torch.tensor(rank == 1), group)),
        "mean": float(mean),
        "grads_f16": parallel.mean_gradients(grads, group, torch.float16),
        "before_broadcast": init_params(seed=rank),
        "after_broadcast": parallel.broadcast_params(init_params(seed=rank)),
    }


def _bytes_in(name: str, params: Any, rank: int) -> tuple[list[dict[str, Any]], int, list[torch.dtype]]:
    """Run ``name`` eagerly, recording the bytes and dtypes this rank sends into all_reduce."""
    from torch.distributed import _functional_collectives as funcol

    sent: list[tuple[int, torch.dtype]] = []
    original = funcol.all_reduce

    def counting(x: torch.Tensor, op: str, group: Any, tag: str = "") -> torch.Tensor:
        sent.append((x.numel() * x.element_size(), x.dtype))
        return original(x, op, group, tag)

    funcol.all_reduce = counting
    try:
        records = run(name, params, rank, data_parallel=True)
    finally:
        funcol.all_reduce = original
    # The first all_reduce of each step is the gradient bucket (then the finite flag, then the loss).
    per_step = len(sent) // STEPS
    grad_calls = sent[::per_step]
    return records, sum(b for b, _ in grad_calls) // STEPS, [d for _, d in grad_calls]


def main(out: str) -> None:
    torch.set_num_threads(1)
    rank, world, device = parallel.setup_from_env(timeout_s=60)
    assert world == 2 and device.type == "cpu", (world, device)
    params = parallel.broadcast_params(init_params(seed=rank))  # rank 1 starts from rank 0's draw
    results: dict[str, Any] = {"rank": rank, "is_main": parallel.is_main_process()}
    results["collectives"] = _collectives(rank)

    from torch._dynamo.testing import CompileCounterWithBackend

    counter = CompileCounterWithBackend("aot_eager")
    results["bf16_compiled"] = run("bf16", params, rank, data_parallel=True, compile_backend=counter)
    results["compile"] = {
        "frame_count": counter.frame_count,
        "graphs": len(counter.graphs),
        "code": [g.code for g in counter.graphs],
    }
    for name in ("bf16", "bf16_accum", "f16", "f16_inf", "f32", "buffers"):
        results[name] = run(name, params, rank, data_parallel=True)
    for name in ("r_f32", "r_bf16"):
        results[name], results[name + "_bytes"], results[name + "_dtypes"] = _bytes_in(name, params, rank)
    torch.save(results, f"{out}/rank{rank}.pt")
    parallel.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
