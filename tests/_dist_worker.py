"""Worker for tests/test_parallel.py, run as ``torchrun --standalone --nproc_per_node=2 _dist_worker.py OUT``.

Each rank runs every scenario on its shard of the batches and saves what it saw per step to
``OUT/<scenario>_rank<r>.pt``; the test compares the ranks with each other and with one process run
on the whole batch (:func:`run`, without ``data_parallel``). Kept small: one compiled scenario, the
others eager. Importing this module has no side effects (pytest imports it for doctests).

With ``numerics`` after ``OUT`` (``torchrun --nproc_per_node=4 _dist_worker.py OUT numerics``) it runs
the cases of tests/test_numerics_parallel.py instead (:func:`numerics`): the precision of the gradient
reduction on 2 and 4 ranks in one launch.
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
    state = fa.TrainState.create(
        params, opt, loss_scale=scale, buffers=buffers, data_parallel=data_parallel, policy=policy
    )
    step = fa.make_train_step(
        make_buffer_loss_fn(policy) if buffers else make_loss_fn(policy),
        opt,
        accumulation_steps=accumulation_steps or cfg["k"],
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
    # The first all_reduce of each step is the gradient bucket (then the loss, then the finite flag).
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
    # Telemetry in a compiled data-parallel step reducing in the gradients' own dtype, where the averaged
    # gradients are views of one buffer (torch.cond refused them as aliased operands before).
    policy = fa.get_policy("f32")
    opt = optim.sgd(0.1)
    state = fa.TrainState.create(params, opt, data_parallel=True, policy=policy)
    step = fa.make_train_step(make_loss_fn(policy), opt, telemetry=2, backend="aot_eager")
    results["telemetry"] = []
    for batch in batches()[:2]:
        state, metrics = step(state, shard(batch, rank))
        results["telemetry"].append({k: v for k, v in metrics.items() if k.startswith("numerics/")})
    torch.save(results, f"{out}/rank{rank}.pt")
    parallel.shutdown()


# ---------------------------------------------------------------------------------------------------
# Numerics of the gradient reduction (tests/test_numerics_parallel.py): one launch of NUM_RANKS ranks.
# Ranks {0, 1} and {2, 3} form two groups of two that run the world-2 cases side by side (each group on
# its own data), then all four run the world-4 cases on the default group. Every case is one eager SGD
# step (lr 1, from zeros, so the new parameters are minus the reduced gradient) unless it says otherwise.

NUM_RANKS = 4
SWEEP_SCALE = 2.0**16  # the loss scale of every sweep case
SWEEP_N = 64  # gradient elements per rank and case
WIRES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}
MAGNITUDES = ("tiny", "normal", "near_overflow")
HANDED_MEAN = (3e-8, 1e-7, 3e-6, 1e-3)  # issue 11, item 2: the true mean gradient over two ranks
HANDED_POLICIES = ("p=f32,c=f16,o=f32,r=f16", "p=f32,c=f16,o=f32")
OVERFLOW_POLICY = "p=f32,c=bf16,o=f32,r=f16"
OVERFLOW_STEPS = 3


def sweep_grads(wire: str, magnitude: str, world: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s float32 gradient (``SWEEP_N`` positive values) in one sweep case.

    Each rank sends ``g * SWEEP_SCALE / world`` on a float16 or bfloat16 wire (the loss scale is
    applied there) and ``g / world`` on a float32 one (nothing is scaled), so the magnitudes are
    placed by what the wire carries:

    - ``tiny``: what a rank sends is in [1, 4) times the wire's smallest normal number (below it
      without the loss scale: the scale's job is to keep such gradients);
    - ``normal``: ``g`` in [2**-12, 2**-4), typical gradients;
    - ``near_overflow``: ``g * SWEEP_SCALE`` in [0.5, 0.9] times the wire's largest finite number on
      every rank (the largest scaled gradient it can carry), so the sum over the ranks overflows the
      wire where their mean does not.
    """
    info = torch.finfo(WIRES[wire])
    seed = 1000 * list(WIRES).index(wire) + 100 * MAGNITUDES.index(magnitude) + 10 * world + rank
    u = torch.rand(SWEEP_N, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    if magnitude == "tiny":
        g = info.tiny * 4.0**u * world / (1.0 if wire == "f32" else SWEEP_SCALE)
    elif magnitude == "normal":
        g = 2.0 ** (-12 + 8 * u)
    else:
        g = (0.5 + 0.4 * u) * info.max / SWEEP_SCALE
    return g.float()


def handed_grads(rank: int) -> torch.Tensor:
    """Rank ``rank`` (0 or 1)'s input ``a`` of :func:`handed_loss_fn`: float16, (0.5 + rank) * mean * 2**15.

    Its gradient is ``a * 2**-15`` exactly, and the mean over the two ranks is ``HANDED_MEAN`` to
    float16 rounding of ``a`` (2**-11 relative).
    """
    return (torch.tensor(HANDED_MEAN, dtype=torch.float64) * 2.0**15 * (0.5 + rank)).half()


def handed_loss_fn(policy: fa.Policy):
    """``sum(w * a) * 2**-15`` with the product and sum in the compute dtype (float16).

    The factor keeps the float16 backward finite under the loss scale 2**16: the gradient that enters
    the float16 part is 2**-15 * 2**16 = 2, and ``d/dw = 2 * a`` in float16, exactly.
    """

    def loss_fn(params: Any, batch: Any) -> torch.Tensor:
        w = policy.cast_to_compute(params)["w"]
        return policy.cast_to_output((w * batch["a"]).sum()).float() * 2.0**-15

    return loss_fn


def linear_loss_fn(params: Any, batch: Any) -> torch.Tensor:
    """``sum(w * g)`` in float32: its gradient is ``g``, exactly (times the loss scale, a power of 2)."""
    return (params["w"] * batch["g"]).sum()


def overflow_loss_fn(params: Any, batch: Any) -> torch.Tensor:
    """``sum(w * x)`` computed in bfloat16, as :data:`OVERFLOW_POLICY` says: scaled gradients overflow only float16."""
    policy = fa.get_policy(OVERFLOW_POLICY)
    w = policy.cast_to_compute(params)["w"]
    return policy.cast_to_output((w * batch["x"].to(w.dtype)).sum()).float()


def overflow_grads(rank: int) -> torch.Tensor:
    """Rank 1's gradient 8 times the loss scale 2**15, halved, is 2**17 > 65504: inf on a float16 wire."""
    return torch.tensor([1.0, 8.0]) if rank == 1 else torch.tensor([1.0, 1.0])


def _steps(loss_fn, policy, scale, batch, group, steps=1, compile_backend=None) -> list[dict[str, Any]]:
    opt = optim.sgd(1.0)
    state = fa.TrainState.create(
        {"w": torch.zeros(batch[next(iter(batch))].shape)}, opt, loss_scale=scale, data_parallel=group, policy=policy
    )
    step = fa.make_train_step(
        loss_fn,
        opt,
        compile=compile_backend is not None,
        backend=compile_backend,
    )
    records = []
    for _ in range(steps):
        state, m = step(state, batch)
        records.append(
            {
                "w": state.params["w"].clone(),
                "grads_finite": m["grads_finite"].clone(),
                "loss_scale": m["loss_scale"].clone(),
                "new_loss_scale": state.loss_scale.loss_scale.clone(),
            }
        )
    return records


def _sweep(group: Any, world: int, rank: int) -> dict[str, Any]:
    out = {}
    for wire in WIRES:
        for magnitude in MAGNITUDES:
            batch = {"g": sweep_grads(wire, magnitude, world, rank)}
            scale = fa.StaticLossScale(SWEEP_SCALE)
            out[f"{wire}/{magnitude}/{world}"] = _steps(linear_loss_fn, f"p=f32,c=f32,r={wire}", scale, batch, group)[0]
    return out


def _bitwise(group: Any, rank: int) -> dict[str, Any]:
    """``mean_gradients`` with and without a loss scale where the wire is not narrower: must be equal."""
    g = torch.Generator().manual_seed(rank)
    grads = {"a": torch.randn(5, 3, generator=g), "b": torch.randn(7, generator=g).double(), "n": torch.arange(3)}
    scale = torch.tensor(1000.0)  # not a power of two: scaling and unscaling would round
    return {
        str(dtype): (
            parallel.mean_gradients(grads, group, dtype),
            parallel.mean_gradients(grads, group, dtype, loss_scale=scale),
        )
        for dtype in (None, torch.float32, torch.float64)
    }


def numerics(out: str) -> None:
    """Run the cases of tests/test_numerics_parallel.py; save them to ``OUT/numerics_rank<r>.pt``."""
    torch.set_num_threads(1)
    rank, world, device = parallel.setup_from_env(timeout_s=300)
    assert world == NUM_RANKS and device.type == "cpu", (world, device)
    pairs = [torch.distributed.new_group([0, 1]), torch.distributed.new_group([2, 3])]  # every rank makes both
    pair, i = pairs[rank // 2], rank % 2
    results: dict[str, Any] = {"rank": rank}
    handed = {"a": handed_grads(i)}
    results["handed"] = {
        p: _steps(handed_loss_fn(fa.get_policy(p)), p, fa.StaticLossScale(2.0**16), handed, pair)[0]
        for p in HANDED_POLICIES
    }
    results["sweep"] = _sweep(pair, 2, i)
    results["bitwise"] = _bitwise(pair, i)
    overflow = {"x": overflow_grads(i)}
    results["overflow"] = _steps(
        overflow_loss_fn, OVERFLOW_POLICY, fa.DynamicLossScale(2.0**15), overflow, pair, OVERFLOW_STEPS
    )
    results["sweep"].update(_sweep(parallel.resolve_group(True), NUM_RANKS, rank))
    if rank < 2:  # the overflow case once more, compiled: still one graph, no recompile as the scale changes
        from torch._dynamo.testing import CompileCounterWithBackend

        counter = CompileCounterWithBackend("aot_eager")
        results["overflow_compiled"] = _steps(
            overflow_loss_fn, OVERFLOW_POLICY, fa.DynamicLossScale(2.0**15), overflow, pair, OVERFLOW_STEPS, counter
        )
        results["compile"] = {"frame_count": counter.frame_count, "code": [g.code for g in counter.graphs]}
    torch.save(results, f"{out}/numerics_rank{rank}.pt")
    parallel.shutdown()


if __name__ == "__main__":
    if sys.argv[2:] == ["numerics"]:
        numerics(sys.argv[1])
    else:
        main(sys.argv[1])
