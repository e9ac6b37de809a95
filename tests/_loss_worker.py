"""Worker for tests/test_loss_sum.py: ``torchrun --standalone --nproc_per_node=2 _loss_worker.py OUT``.

Two gloo ranks on the CPU. Each case takes one train step (SGD, learning rate 1, so the parameters move by
minus the gradient) on this rank's rows of a global batch and records the new parameters and the metrics:

- ``token/<layout>/k<k>``: a token-classification loss returned as :class:`funcamp.LossSum` (the sum of the
  non-padding tokens' cross entropy, and their count), with uneven padding (one sequence all padding), data
  parallel or sharded, ``accumulation_steps`` 1, 2 and 4; the test compares with the float64 token mean of
  the whole global batch.
- ``token/<layout>/compiled``: the same with k=2, compiled (``aot_eager``), with its graph count.
- ``lossonly/<layout>``: a loss that is not finite on rank 1 alone while every gradient is finite (a
  ``log(0)`` term of the data): every rank must skip, sharded as unsharded.
- ``reference/<layout>``: 3 steps of the step assembled from stages, of the same with ``donate=True``,
  and of the frozen copy of the step before the redesign (tests/_reference_step.py), bfloat16 compute on
  a bfloat16 wire, 2 micro-batches, a gradient overflow on rank 1 at the second step: whether every state
  leaf and metric is bitwise equal.

Each rank saves ``OUT/rank<r>.pt``. Importing this module has no side effects (pytest imports it).
"""

from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Any

import torch

import funcamp as fa
from funcamp import _tree, optim, parallel, sharding

WORLD = 2
ROWS = 4  # sequences per rank
T, F, C = 6, 5, 3  # tokens per sequence, features, classes (5 rows: padding in every shard)
KS = (1, 2, 4)


def init_params() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(F, C, generator=g) / F**0.5, "b": torch.randn(C, generator=g) * 0.1}


def global_batch() -> dict[str, torch.Tensor]:
    """``WORLD * ROWS`` sequences with 0 to ``T`` real tokens each (labels -100 on padding)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(WORLD * ROWS, T, F, generator=g, dtype=torch.float64).float()
    labels = torch.randint(0, C, (WORLD * ROWS, T), generator=g)
    lengths = torch.tensor([6, 1, 0, 3, 2, 6, 5, 1])  # uneven; sequence 2 (rank 0) has no real token
    labels[torch.arange(T)[None, :] >= lengths[:, None]] = -100
    return {"x": x, "labels": labels, "z": torch.ones(WORLD * ROWS)}


def rows(batch: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    return {k: v[rank * ROWS : (rank + 1) * ROWS] for k, v in batch.items()}


def token_loss(params: Any, batch: Any) -> fa.LossSum:
    logits = batch["x"] @ params["w"] + params["b"]
    total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
    return fa.LossSum(total, (batch["labels"] != -100).sum())


def loss_only_nonfinite(params: Any, batch: Any) -> torch.Tensor:
    """Finite gradients; the loss is -inf where ``z`` holds a 0 (a log(0) of the data, not of the parameters)."""
    logits = batch["x"][:, 0] @ params["w"] + params["b"]
    return torch.nn.functional.cross_entropy(logits, batch["labels"][:, 0].clamp(min=0)) + torch.log(batch["z"]).sum()


def one_step(loss_fn: Any, batch: Any, group: Any, sharded: bool, k: int = 1, backend: str | None = None) -> dict:
    params, opt = init_params(), optim.sgd(1.0)
    layout = sharding.shard_layout(params, group) if sharded else None
    state = fa.TrainState.create(params, opt, loss_scale=fa.DynamicLossScale(2.0**10), shard=layout)
    counter = None
    if backend is not None:
        from torch._dynamo.testing import CompileCounterWithBackend

        counter = backend = CompileCounterWithBackend(backend)
    step = fa.make_train_step(
        loss_fn,
        opt,
        accumulation_steps=k,
        data_parallel=group,
        shard=layout,
        compile=backend is not None,
        backend=backend,
    )
    new, m = step(state, batch)
    whole = sharding.unshard_params(new.params, layout, group) if sharded else new.params
    out = {
        "params": {n: v.clone() for n, v in whole.items()},
        "loss_scale": new.loss_scale.loss_scale.clone(),
        **{n: m[n].clone() for n in ("loss", "grads_finite", "skipped_steps", "grad_norm")},
    }
    if counter is not None:
        out["frame_count"] = counter.frame_count
    return out


def _trapped_loss(params: Any, batch: Any) -> torch.Tensor:
    """bfloat16 compute; where ``z`` holds 1e37 the gradient of ``b`` overflows the bfloat16 backward."""
    p = {k: v.to(torch.bfloat16) for k, v in params.items()}
    logits = (batch["x"][:, 0].to(torch.bfloat16) @ p["w"] + p["b"]).float()
    trap = (p["b"].sum() * batch["z"].mean().to(torch.bfloat16)).float()
    return torch.nn.functional.cross_entropy(logits, batch["labels"][:, 0].clamp(min=0)) + trap


def _equal_trees(a: Any, b: Any) -> bool:
    la, sa = _tree.tree_flatten(a)
    lb, sb = _tree.tree_flatten(b)
    return sa == sb and all(
        (x.dtype == y.dtype and torch.equal(x, y)) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb)
    )


def against_reference(batch: Any, group: Any, sharded: bool, rank: int) -> dict:
    import _reference_step as reference

    policy = "p=f32,c=bf16,o=f32,r=bf16"
    runs = []
    donating = functools.partial(fa.make_train_step, donate=True)
    for build in (fa.make_train_step, reference.make_train_step, donating):
        params, opt = init_params(), optim.adamw(1e-2, weight_decay=0.1)
        layout = sharding.shard_layout(params, group) if sharded else None
        state = fa.TrainState.create(params, opt, loss_scale=fa.DynamicLossScale(2.0**12, period=1), shard=layout)
        step = build(
            _trapped_loss, opt, accumulation_steps=2, data_parallel=group, policy=policy, shard=layout, compile=False
        )
        history = []
        for i in range(3):
            z = torch.full((ROWS,), 1e37 if (i == 1 and rank == 1) else 1.0)
            state, m = step(state, dict(batch, z=z))
            kept = _tree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, state)
            history.append((dataclasses.replace(kept, layout=None), m))  # the layout a deprecated argument gave
        runs.append(history)
    return {
        "equal": all(_equal_trees(a, b) for a, b in zip(runs[0], runs[1])),
        "donated_equal": all(_equal_trees(a, b) for a, b in zip(runs[0], runs[2])),
        "skipped": runs[0][-1][0].skipped_steps.clone(),
    }


def main(out: str) -> None:
    torch.set_num_threads(1)
    rank, world, device = parallel.setup_from_env(timeout_s=300)
    assert world == WORLD and device.type == "cpu", (world, device)
    group = parallel.resolve_group(True)
    batch = rows(global_batch(), rank)
    results: dict[str, Any] = {}
    for layout, sharded in (("dp", False), ("shard", True)):
        for k in KS:
            results[f"token/{layout}/k{k}"] = one_step(token_loss, batch, group, sharded, k)
        results[f"token/{layout}/compiled"] = one_step(token_loss, batch, group, sharded, 2, backend="aot_eager")
        poisoned = dict(batch, z=torch.zeros(ROWS) if rank == 1 else batch["z"])
        results[f"lossonly/{layout}"] = one_step(loss_only_nonfinite, poisoned, group, sharded)
        results[f"reference/{layout}"] = against_reference(batch, group, sharded, rank)
    torch.save(results, f"{out}/rank{rank}.pt")
    parallel.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
