"""Numerics of the data-parallel gradient reduction: the loss scale protects the wire (issue 11, item 2).

A float16 or bfloat16 all-reduce of float32 gradients carries them with the loss scale applied,
divided by the world size before the sum (in float32), and unscales the mean in float32 after it,
as ``DistributedDataParallel`` with ``torch.amp.GradScaler`` reduces the scaled gradients (see
:func:`funcamp.parallel.mean_gradients`). The distributed cases run in one launch of
tests/_dist_worker.py under ``torchrun --nproc_per_node=4`` (about 20 s on 2 cores): ranks {0, 1} and
{2, 3} are two groups of two, then all four are one group of four (:func:`_dist_worker.numerics`).

How the checks were checked: the worker was run against the code before this change (``git archive``
of 7661d86 with this worker, less its bitwise case, which needs the new ``loss_scale`` keyword): the
handed input gave ``[0, 5.96e-8, 3.04e-6, 1.0004e-3]`` (3e-8 lost,
1e-7 off by 40%), every f16 and bf16 ``tiny`` cell of the sweep had relative error 1.0 (flushed to
zero), and the overflow case never skipped a step. With the division moved after the sum instead
(``_share`` sending ``x`` and the mean divided after), every f16 and bf16 ``near_overflow`` cell
failed (inf, step skipped) and the loss scale backed off at every step.
"""

from __future__ import annotations

import _dist_worker as W
import pytest
import torch
from test_parallel import HERE, run_torchrun

import funcamp as fa
from funcamp import optim

# Unit round-off of each wire dtype: 2**-(significand bits).
UNIT_ROUNDOFF = {"f16": 2.0**-11, "bf16": 2.0**-8, "f32": 2.0**-24}
WORLDS = (2, W.NUM_RANKS)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("numerics")
    run_torchrun([str(HERE / "_dist_worker.py"), str(out), "numerics"], nproc=W.NUM_RANKS)
    return [torch.load(out / f"numerics_rank{r}.pt", weights_only=True) for r in range(W.NUM_RANKS)]


def _groups(world: int) -> list[list[int]]:
    return [[0, 1], [2, 3]] if world == 2 else [list(range(W.NUM_RANKS))]


# ---------------------------------------------------------------------------------------------------
# The handed input


def test_handed_input_f16_reduce_with_loss_scale(ranks):
    """Issue 11 item 2: two ranks, ``p=f32,c=f16,o=f32,r=f16``, ``StaticLossScale(2**16)``, SGD lr 1.

    The true mean gradient is ``[3e-8, 1e-7, 3e-6, 1e-3]`` (to the float16 rounding of each rank's
    input, 2**-11); after one step the parameters must be minus it within 2**-9 relative. Measured:
    4.0e-4 at most (the reduce dtype's rounding); before: ``[0, 5.96e-8, 3.04e-6, 1.0004e-3]``.
    """
    exact = (W.handed_grads(0).double() + W.handed_grads(1).double()) / 2 * 2.0**-15
    wanted = torch.tensor(W.HANDED_MEAN, dtype=torch.float64)
    assert torch.allclose(exact, wanted, rtol=2.0**-10, atol=0)
    for policy in W.HANDED_POLICIES:  # r=f16, and the default r=f32 (unchanged)
        for r in ranks:
            got = -r["handed"][policy]["w"].double()
            assert bool(r["handed"][policy]["grads_finite"])
            assert torch.allclose(got, wanted, rtol=2.0**-9, atol=0), (policy, got.tolist())
            assert torch.allclose(got, exact, rtol=2.0**-10, atol=0), (policy, got.tolist())


# ---------------------------------------------------------------------------------------------------
# The sweep: reduce dtype x gradient magnitude x world size


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("magnitude", W.MAGNITUDES)
@pytest.mark.parametrize("wire", list(W.WIRES))
def test_reduction_sweep(ranks, wire, magnitude, world):
    """The reduced mean gradient is within ``(world + 1/2) * u`` of the float64 mean, relative, per element.

    ``u`` is the wire dtype's unit round-off. Each rank's share is rounded once to the wire dtype and
    each of the ``world - 1`` additions of the ring all-reduce rounds once (all values are positive,
    so relative errors add up): ``world * u``; the half ``u`` covers the float32 rounding where a
    ``bf16/tiny`` mean is unscaled back into float32's subnormal range. The magnitudes are defined
    by :func:`_dist_worker.sweep_grads`. Measured (largest over the cells, in units of ``u``):
    world 2: f16 1.42, bf16 1.46, f32 0.98; world 4: f16 2.20, bf16 1.74, f32 2.50
    (relative: f16 1.1e-3, bf16 6.8e-3, f32 1.5e-7).
    """
    key = f"{wire}/{magnitude}/{world}"
    for members in _groups(world):
        mean = torch.stack([W.sweep_grads(wire, magnitude, world, i) for i in range(world)]).double().mean(0)
        first = ranks[members[0]]["sweep"][key]
        for m in members:  # every rank of the group took the same step
            assert torch.equal(ranks[m]["sweep"][key]["w"], first["w"])
            assert bool(ranks[m]["sweep"][key]["grads_finite"])
        err = ((-first["w"].double() - mean).abs() / mean).max().item()
        assert err <= (world + 0.5) * UNIT_ROUNDOFF[wire], (key, err / UNIT_ROUNDOFF[wire])


def test_reduction_without_a_narrower_wire_is_unchanged(ranks):
    """Where the wire is as wide as the gradient, the loss scale is not applied: bitwise the same.

    The scale is 1000 (not a power of two), so scaling and unscaling would change low bits.
    """
    for r in ranks:
        for dtype, (plain, scaled) in r["bitwise"].items():
            assert torch.equal(plain["n"], scaled["n"]) and plain["n"].dtype == torch.int64
            assert torch.equal(plain["a"], scaled["a"]) and scaled["a"].dtype == torch.float32
            if dtype == str(torch.float32):  # float64 "b" on a float32 wire: scaled, equal to f32 round-off
                assert scaled["b"].dtype == torch.float64
                assert torch.allclose(plain["b"], scaled["b"], rtol=2.0**-22, atol=0)
            else:
                assert torch.equal(plain["b"], scaled["b"])


# ---------------------------------------------------------------------------------------------------
# Overflow on the wire backs off the loss scale on every rank


def test_wire_overflow_backs_off_the_loss_scale_on_every_rank(ranks):
    """``p=f32,c=bf16,o=f32,r=f16``, ``DynamicLossScale(2**15)``: rank 1's scaled gradient 8 * 2**15 is
    finite in bfloat16 and float32, but its share 2**17 (then 2**16 after one back-off) overflows float16.

    As with DDP + GradScaler (whose ``unscale_`` finds the inf in the reduced gradients), the step is
    skipped and the scale halves on every rank until the share fits: 2**15 -> 2**14 -> 2**13, then
    the step applies the true mean ``[1, 4.5]``.
    """
    alone = W._steps(
        W.overflow_loss_fn, W.OVERFLOW_POLICY, fa.DynamicLossScale(2.0**15), {"x": W.overflow_grads(1)}, None
    )
    assert bool(alone[0]["grads_finite"])  # one process with rank 1's data: no overflow without the wire
    for r in ranks:
        records = r["overflow"]
        assert [bool(x["grads_finite"]) for x in records] == [False, False, True]
        assert [float(x["loss_scale"]) for x in records] == [2.0**15, 2.0**14, 2.0**13]
        assert [float(x["new_loss_scale"]) for x in records] == [2.0**14, 2.0**13, 2.0**13]
        assert torch.equal(records[1]["w"], torch.zeros(2))  # skipped steps keep the parameters
        assert torch.equal(records[2]["w"], torch.tensor([-1.0, -4.5]))


def test_compiled_reduction_is_one_graph_without_recompiles(ranks):
    """The overflow case compiled (aot_eager, fullgraph): one graph for three steps while the scale
    changes (it is a tensor), three all-reduces (gradients, finite flag, loss), no host sync, and
    the same records as eager."""
    for r in ranks[:2]:
        assert r["compile"]["frame_count"] == 1 and len(r["compile"]["code"]) == 1
        code = r["compile"]["code"][0]
        assert code.count("_c10d_functional.all_reduce(") == 3
        assert "_local_scalar_dense" not in code and ".item()" not in code
        for got, want in zip(r["overflow_compiled"], r["overflow"]):
            assert all(torch.equal(got[k], want[k]) for k in want)


# ---------------------------------------------------------------------------------------------------
# The same kind in one process: micro-batches are summed in float32


@pytest.mark.parametrize("scale", [None, 2.0**8], ids=["no_loss_scale", "static_2**8"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_micro_batches_are_summed_in_float32(dtype, scale):
    """64 micro-batches, parameters in ``dtype``: the gradient is the float64 mean rounded once to ``dtype``.

    Each micro-batch's gradient is a value in [0.5, 1) with 8 significant bits; their float32 sum
    and the division by 64 are exact, so the step must equal the correctly rounded mean bitwise. Before this change,
    without a loss scale (``NoOpLossScale`` does not unscale, so nothing made the gradients float32)
    the sum ran in ``dtype``: off by up to 1.5e-2 relative in bfloat16 and 2.5e-3 in float16.
    """
    k, n = 64, 32
    u = torch.rand(k, n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = (0.5 + 0.5 * u).to(torch.bfloat16).to(dtype)  # 8 significant bits: float32 sums of 64 are exact
    opt = optim.sgd(1.0)
    loss_scale = None if scale is None else fa.StaticLossScale(scale)
    state = fa.TrainState.create({"w": torch.zeros(n, dtype=dtype)}, opt, loss_scale=loss_scale)
    step = fa.make_train_step(lambda p, b: (p["w"] * b["x"]).sum(), opt, accumulation_steps=k, compile=False)
    state, metrics = step(state, {"x": x})
    assert bool(metrics["grads_finite"])
    assert torch.equal(-state.params["w"], x.double().mean(0).to(dtype))
