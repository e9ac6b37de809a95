"""Worker for tests/test_sharding.py: ``torchrun --standalone --nproc_per_node=4 _shard_worker.py OUT``.

One launch of 4 gloo ranks on CPU. Ranks {0, 1} and {2, 3} form two groups of two that run the
2-rank scenarios (each pair its own share of them), then all four run the 4-rank scenarios on the
default group. Each scenario trains the same small model for ``STEPS`` steps twice from the same
start: sharded (``make_train_step(shard=layout)``) and unsharded data parallel (``data_parallel=group``,
the reference), and records per step the whole parameters (the sharded ones all-gathered eagerly
after the step) and the metrics; the eager sharded runs also record their first step's collectives (dtype and
bytes). Each rank saves ``OUT/rank<r>.pt``. Importing this module has no
side effects (pytest imports it).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

import torch
import torch.distributed as dist

import funcamp as fa
from funcamp import _tree, optim, parallel, sharding

B = 4  # per-rank batch
STEPS = 20
POISON_STEP = 6  # 0-based: the seventh step has a non-finite gradient on one rank
F_IN, HIDDEN, CLASSES = 7, 5, 3  # shapes that do not divide by 2 or 4: padding everywhere
PERIOD = 4  # the dynamic loss scale grows every 4 finite steps: it changes during the run


def init_params(seed: int = 0) -> dict[str, torch.Tensor]:
    """Parameters of every awkward shape: rows not divisible by 2 or 4, a 1-row matrix, a 0-d scalar."""
    g = torch.Generator().manual_seed(seed)
    return {
        "w1": torch.randn(F_IN, HIDDEN, generator=g) / F_IN**0.5,
        "b1": torch.zeros(HIDDEN),
        "w2": torch.randn(HIDDEN, CLASSES, generator=g) / HIDDEN**0.5,
        "row": torch.randn(1, CLASSES, generator=g) * 0.1,  # 1 row: ranks > 0 hold only padding
        "temp": torch.tensor(1.0),  # 0-d
    }


def batches(world: int, poison_rank: int, poison: float) -> list[dict[str, torch.Tensor]]:
    """``STEPS`` global batches of ``world * B`` samples; rank r's rows are ``[r*B, (r+1)*B)``."""
    g = torch.Generator().manual_seed(1234 + world)
    out = []
    for step in range(STEPS):
        p = torch.zeros(world * B)
        if step == POISON_STEP:
            p[poison_rank * B : (poison_rank + 1) * B] = poison
        x = torch.randn(world * B, F_IN, generator=g)
        out.append({"x": x, "y": torch.randint(0, CLASSES, (world * B,), generator=g), "poison": p})
    return out


def shard_batch(batch: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    return {k: v[rank * B : (rank + 1) * B] for k, v in batch.items()}


def make_loss_fn(policy: fa.Policy):
    def loss_fn(params: Any, batch: Any) -> torch.Tensor:
        p, x = policy.cast_to_compute((params, batch["x"]))
        h = torch.tanh(x @ p["w1"] + p["b1"])
        logits = policy.cast_to_output((h @ p["w2"] + p["row"]) * p["temp"]).float()
        loss = torch.nn.functional.cross_entropy(logits, batch["y"])
        # Zero unless poisoned; then d/d(b1) = poison * loss_scale overflows (8 * 2**15 in f16, 1e38 * 2**15 in f32).
        trap = (p["b1"] * batch["poison"].mean().to(p["b1"].dtype)).sum().float()
        return loss + trap

    return loss_fn


SCENARIOS: dict[str, dict[str, Any]] = {
    # float32 policy: sharded == unsharded bitwise on 2 ranks
    "f32": dict(policy="p=f32,c=f32", poison=1e38, k=1),
    # bfloat16 compute, bfloat16 wire (loss scale on the wire), 2 micro-batches
    "bf16": dict(policy="p=f32,c=bf16,o=f32,r=bf16", poison=1e38, k=2),
    # float16 compute and wire, the poisoned step overflows the float16 backward
    "f16": dict(policy="p=f32,c=f16,o=f32,r=f16", poison=8.0, k=1),
    # gathered in the compute dtype (FSDP2's param_dtype): the same numbers, since the loss casts every parameter
    "bf16_gather": dict(policy="p=f32,c=bf16,o=f32", poison=1e38, k=1, gather="compute"),
}
PAIR_SCENARIOS = (("f32", "f16"), ("bf16", "bf16_gather"))  # pair 0 (ranks 0, 1), pair 1 (ranks 2, 3)
WORLD_SCENARIOS = ("f32", "bf16", "f16")


def optimizer() -> optim.GradientTransformation:
    """AdamW with weight decay on every parameter (padding rows must stay zero through it)."""
    return optim.adamw(optim.warmup_cosine_decay(2e-2, warmup=3, total=STEPS), weight_decay=0.1)


def run(
    name: str,
    group: Any,
    rank: int,
    *,
    sharded: bool,
    compile_backend: Any = None,
    opt: optim.GradientTransformation | None = None,
    from_state: bool = False,
) -> dict[str, Any]:
    """Scenario ``name`` for ``STEPS`` steps on ``group`` (this process is ``rank`` in it).

    ``from_state``: the step is built without ``shard=`` and ``data_parallel=`` (it takes both from the state)."""
    cfg = SCENARIOS[name]
    policy = fa.get_policy(cfg["policy"])
    opt = opt or optimizer()
    world = group.size()
    params = init_params()
    gather = policy.compute_dtype if cfg.get("gather") == "compute" else None
    layout = sharding.shard_layout(params, group, gather_dtype=gather) if sharded else None
    state = fa.TrainState.create(params, opt, loss_scale=fa.DynamicLossScale(2.0**15, period=PERIOD), shard=layout)
    where = {} if from_state else {"data_parallel": group, "shard": layout}
    step = fa.make_train_step(
        make_loss_fn(policy),
        opt,
        accumulation_steps=cfg["k"],
        policy=policy,
        compile=compile_backend is not None,
        backend=compile_backend,
        **where,
    )
    records, wire = [], []
    for n, batch in enumerate(batches(world, world - 1, cfg["poison"])):
        eager_sharded_first = n == 0 and sharded and compile_backend is None
        with _recording(wire) if eager_sharded_first else contextlib.nullcontext():
            state, m = step(state, shard_batch(batch, rank))
        whole = sharding.unshard_params(state.params, layout, group) if sharded else state.params
        records.append(
            {
                "params": {k: v.detach().clone() for k, v in whole.items()},
                "new_loss_scale": state.loss_scale.loss_scale.clone(),
                **{
                    k: m[k].clone()
                    for k in (
                        "loss",
                        "loss_scale",
                        "grads_finite",
                        "grad_norm",
                        "skipped_steps",
                        "nonfinite_leaf",
                        "learning_rate",
                    )
                },
            }
        )
    out = {"records": records, "wire": wire}
    if sharded:
        out["shards"] = {k: v.clone() for k, v in state.params.items()}
        out["opt_shards"] = _tree.tree_map(lambda x: x.clone(), state.opt_state)
        out["state_bytes"] = _tree.tree_bytes(state.params) + _tree.tree_bytes(state.opt_state)
    else:
        out["state_bytes"] = _tree.tree_bytes(state.params) + _tree.tree_bytes(state.opt_state)
    return out


@contextlib.contextmanager
def _recording(wire: list[tuple[str, str, int]]) -> Any:
    """Record ``(op, dtype, bytes)`` of each functional all-gather (its result) and reduce-scatter (its input) run
    inside: what travels, every rank's rows."""
    from unittest import mock

    from torch.distributed import _functional_collectives as funcol

    def spy(name: str, real: Any) -> Any:
        def call(x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            out = real(x, *args, **kwargs)
            seen = out if name == "all_gather" else x
            wire.append((name, str(seen.dtype), seen.numel() * seen.element_size()))
            return out

        return call

    with (
        mock.patch.object(funcol, "all_gather_single", spy("all_gather", funcol.all_gather_single)),
        mock.patch.object(funcol, "reduce_scatter_single", spy("reduce_scatter", funcol.reduce_scatter_single)),
    ):
        yield


def _resume(out: str, group: Any, rank: int) -> dict[str, Any]:
    """f32 scenario sharded: 10 steps, save (DCP), 10 more; and load + the same 10 (must be bitwise)."""
    policy = fa.get_policy(SCENARIOS["f32"]["policy"])
    opt, params = optimizer(), init_params()
    layout = sharding.shard_layout(params, group)

    def fresh() -> fa.TrainState:
        return fa.TrainState.create(params, opt, loss_scale=fa.DynamicLossScale(2.0**15, period=PERIOD), shard=layout)

    step = fa.make_train_step(
        make_loss_fn(policy), opt, data_parallel=group, policy=policy, shard=layout, compile=False
    )
    data = [shard_batch(b, rank) for b in batches(group.size(), group.size() - 1, SCENARIOS["f32"]["poison"])]
    state = fresh()
    for batch in data[:10]:
        state, _ = step(state, batch)
    path = f"{out}/resume{group.size()}"
    at_save = {
        "params": sharding.unshard_params(state.params, layout, group),
        "mu": sharding.unshard_params(state.opt_state[0].mu, layout, group),
    }
    fa.checkpoint.save_sharded(path, {"state": state, "config": {"steps": 10}}, layout, group=group)
    for batch in data[10:]:
        state, _ = step(state, batch)
    resumed = fa.checkpoint.load_sharded(path, {"state": fresh(), "config": {"steps": 0}}, layout, group=group)
    assert resumed["config"] == {"steps": 10}
    state2 = resumed["state"]
    for batch in data[10:]:
        state2, _ = step(state2, batch)
    return {"straight": state, "resumed": state2, "at_save": at_save}


def _load_into(path: str, group: Any) -> dict[str, Any]:
    """Load a sharded checkpoint (of another world size) into this group's layout; the whole params back."""
    params, opt = init_params(), optimizer()
    layout = sharding.shard_layout(params, group)
    like = {
        "state": fa.TrainState.create(
            params, opt, loss_scale=fa.DynamicLossScale(2.0**15, period=PERIOD), shard=layout
        ),
        "config": {"steps": 0},
    }
    out: dict[str, Any] = {}
    try:
        fa.checkpoint.load_sharded(path, like, layout, group=group, reshard=False)
    except fa.checkpoint.CheckpointMismatchError as e:
        out["no_reshard"] = str(e)
    state = fa.checkpoint.load_sharded(path, like, layout, group=group)["state"]
    out["whole"] = sharding.unshard_params(state.params, layout, group)
    out["mu"] = sharding.unshard_params(state.opt_state[0].mu, layout, group)
    out["step"] = state.step
    return out


FSDP2_POLICIES = {"f32": "f32", "bf16": "p=f32,c=bf16,o=f32"}


def _fsdp2(group: Any, i: int) -> dict[str, Any]:
    """FSDP2 (``fully_shard`` + ``MixedPrecisionPolicy`` + ``torch.optim.AdamW``) vs funcamp's sharded step.

    The same Linear(7, 5) -> tanh -> Linear(5, 3) (shapes that need padding on 2 ranks), the same
    batches and AdamW hyperparameters, 20 steps, float32 and bfloat16 compute (FSDP2's ``param_dtype``;
    gradients reduced in float32 by both). Returns the whole parameters of both, or the error FSDP2 raised.
    """
    import copy

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(7)
    data = [
        (torch.randn(2 * B, F_IN, generator=g), torch.randint(0, CLASSES, (2 * B,), generator=g)) for _ in range(STEPS)
    ]
    data = [(x[i * B : (i + 1) * B], y[i * B : (i + 1) * B]) for x, y in data]
    for name, policy_str in FSDP2_POLICIES.items():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(F_IN, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, CLASSES))
        start = copy.deepcopy(model)
        policy = fa.get_policy(policy_str)
        try:
            mesh = DeviceMesh.from_group(group, "cpu")
            half = None if policy.compute_dtype == torch.float32 else policy.compute_dtype
            mp = MixedPrecisionPolicy(param_dtype=half, reduce_dtype=torch.float32, output_dtype=torch.float32)
            for m in (model[0], model[2], model):
                fully_shard(m, mesh=mesh, mp_policy=mp)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
            for x, y in data:
                loss = torch.nn.functional.cross_entropy(model(x).float(), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            fsdp = {k: v.full_tensor().detach().clone() for k, v in model.state_dict().items()}
        except Exception as e:  # the test skips with this reason
            return {"error": f"{type(e).__name__}: {e}"}
        apply_fn, params = fa.nn.functionalize(start, policy)
        layout = sharding.shard_layout(params, group)
        fopt = optim.adamw(1e-2, weight_decay=0.1)
        state = fa.TrainState.create(params, fopt, shard=layout)

        def loss_fn(p: Any, batch: Any, apply_fn: Any = apply_fn) -> torch.Tensor:
            return torch.nn.functional.cross_entropy(apply_fn(p, batch[0]).float(), batch[1])

        step = fa.make_train_step(loss_fn, fopt, data_parallel=group, policy=policy, shard=layout, compile=False)
        for batch in data:
            state, _ = step(state, batch)
        initial = {k: v.detach().clone() for k, v in start.named_parameters()}
        out[name] = {"fsdp2": fsdp, "funcamp": sharding.unshard_params(state.params, layout, group), "initial": initial}
    return out


def _errors(group: Any, i: int) -> dict[str, str]:
    """Bad input on a pair: ranks that disagree on the policy or on a shape, a per-shard clip."""
    out = {}
    params = init_params()
    opt = optimizer()
    layout = sharding.shard_layout(params, group)
    policy = "p=f32,c=bf16,o=f32" if i == 1 else "p=f32,c=f16,o=f32"
    try:
        fa.make_train_step(make_loss_fn(fa.get_policy(policy)), opt, data_parallel=group, policy=policy, shard=layout)
    except ValueError as e:
        out["policy"] = str(e)
    if i == 1:
        params = dict(params, w1=torch.zeros(F_IN + 1, HIDDEN))
    other = sharding.shard_layout(params, group)
    try:
        fa.make_train_step(make_loss_fn(fa.get_policy("f32")), opt, data_parallel=group, shard=other)
    except ValueError as e:
        out["shape"] = str(e)
    return out


def _old_sharded_clip(max_norm: float, group: Any) -> optim.GradientTransformation:
    """A frozen copy of ``funcamp.sharding.clip_by_global_norm`` before the layout carried the norm (commit
    2699137): the reference the one ``optim.clip_by_global_norm`` must equal bitwise in a sharded step."""
    from torch.distributed import _functional_collectives as funcol

    from funcamp.optim.base import compute_dtype, empty_init

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        leaves = [u for u in _tree.tree_leaves(updates) if _tree.is_floating(u)]
        sumsq = sum((torch.sum(torch.square(u.double())) for u in leaves), torch.zeros((), dtype=torch.float64))
        sumsq = funcol.wait_tensor(funcol.all_reduce(sumsq, "sum", group))
        norm = torch.sqrt(sumsq)
        clip = torch.isfinite(norm) & (norm > max_norm)
        factor = torch.where(clip, max_norm / norm, torch.ones_like(norm))

        def leaf(u: torch.Tensor) -> torch.Tensor:
            c = compute_dtype(u.dtype)
            return (u.to(c) * factor.to(c)).to(u.dtype)

        return _tree.tree_map(lambda u: leaf(u) if _tree.is_floating(u) else u, updates), state

    return optim.GradientTransformation(empty_init, update)


def _clip(group: Any, rank: int) -> dict[str, Any]:
    """``optim.clip_by_global_norm`` in a sharded step built from the state, vs the frozen old sharded clip
    (bitwise), vs the deprecated ``sharding.clip_by_global_norm`` alias, vs ``optim.clip_by_global_norm`` in the
    unsharded data-parallel step (round-off); 20 steps each; and the same step compiled (aot_eager)."""
    import warnings

    from torch._dynamo.testing import CompileCounterWithBackend

    clip = lambda: optim.chain(optim.clip_by_global_norm(0.5), optimizer())  # noqa: E731
    out = {
        "sharded": run("f32", group, rank, sharded=True, from_state=True, opt=clip())["records"],
        "old": run("f32", group, rank, sharded=True, opt=optim.chain(_old_sharded_clip(0.5, group), optimizer())),
        "plain": run("f32", group, rank, sharded=False, opt=clip())["records"],
    }
    out["old"] = out["old"]["records"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        alias = optim.chain(sharding.clip_by_global_norm(0.5, group), optimizer())
    out["warning"] = [str(w.message) for w in caught if issubclass(w.category, DeprecationWarning)]
    out["alias"] = run("f32", group, rank, sharded=True, opt=alias)["records"]
    counter = CompileCounterWithBackend("aot_eager")
    out["compiled"] = run("f32", group, rank, sharded=True, from_state=True, opt=clip(), compile_backend=counter)
    out["compiled"] = out["compiled"]["records"]
    out["compile"] = {"frame_count": counter.frame_count, "code": [g.code for g in counter.graphs]}
    return out


ROUNDING_STEPS = 8


def rounding_params() -> dict[str, torch.Tensor]:
    """bfloat16 masters of :func:`init_params`' awkward shapes, plus ``twin``: 8 rows, one (2, 16) block 4 times, so
    that every rank's shard of it (2 and 4 ranks) holds the same values."""
    g = torch.Generator().manual_seed(5)
    params = {k: v.to(torch.bfloat16) for k, v in init_params().items()}
    params["twin"] = torch.randn(2, 16, generator=g).to(torch.bfloat16).repeat(4, 1)
    return params


def rounding_batches() -> list[dict[str, torch.Tensor]]:
    """Per step, a bfloat16-exact coefficient per parameter (the same on every rank), twin's 4 blocks equal."""
    g = torch.Generator().manual_seed(6)
    out = []
    for _ in range(ROUNDING_STEPS):
        batch = {k: torch.randn(v.shape, generator=g).to(torch.bfloat16).float() for k, v in rounding_params().items()}
        batch["twin"] = batch["twin"][:2].repeat(4, 1)
        out.append(batch)
    return out


def rounding_loss(params: Any, batch: Any) -> torch.Tensor:
    """``sum_k <p_k, c_k>``: the gradient is exactly ``c_k`` (8 significant bits), so its mean over 2 or 4 ranks
    is exact in any order, and a sharded run can equal the unsharded one bitwise on 4 ranks too."""
    return sum((params[k].float() * batch[k]).sum() for k in sorted(params))


def rounding_optimizer(layout: Any = None) -> optim.GradientTransformation:
    return optim.stochastic_rounding(optim.adamw(1e-2, weight_decay=0.1), seed=11, layout=layout)


def _rounding(group: Any, rank: int, *, with_offsets: bool = True) -> dict[str, Any]:
    """bfloat16 masters with stochastic rounding (issue 26 item 11): sharded (the step built from the state, the
    wrapper without ``layout=``: it takes the step's) and unsharded data parallel, ``ROUNDING_STEPS`` steps of
    exact gradients; the whole parameters per step. ``with_offsets=False`` makes the sharded layout give no
    element offsets (each rank hashes its shard's own indices): what the code before issue 26's fix did."""
    from unittest import mock

    from funcamp.train import Sharded

    del rank
    params = rounding_params()
    layout = sharding.shard_layout(params, group)
    out: dict[str, Any] = {}
    for sharded in (True, False):
        opt = rounding_optimizer()
        state = fa.TrainState.create(params, opt, shard=layout if sharded else None)
        step = fa.make_train_step(rounding_loss, opt, data_parallel=None if sharded else group, compile=False)
        records = []
        with mock.patch.object(Sharded, "element_offsets", lambda self: None) if not with_offsets else _nothing():
            for batch in rounding_batches():
                state, m = step(state, batch)
                assert bool(m["grads_finite"])
                whole = sharding.unshard_params(state.params, layout, group) if sharded else state.params
                records.append({k: v.clone() for k, v in whole.items()})
        out["sharded" if sharded else "plain"] = records
    if with_offsets:  # layout= the step's own layout agrees; another rank's is refused at the first call, on every rank
        opt = rounding_optimizer(layout)
        state = fa.TrainState.create(params, opt, shard=layout)
        out["given_layout"] = _catch(lambda: fa.make_train_step(rounding_loss, opt, compile=False)(state, batch))
        other = layout.for_rank((layout.rank + 1) % layout.world_size)
        opt = rounding_optimizer(other)
        state = fa.TrainState.create(params, opt, shard=layout)
        out["other_rank"] = _catch(lambda: fa.make_train_step(rounding_loss, opt, compile=False)(state, batch))
    return out


def _nothing() -> Any:
    import contextlib

    return contextlib.nullcontext()


def _catch(fn: Any) -> str:
    """``fn()``'s error as ``"Type: message"``, or ``"ok"``."""
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "ok"


def _fixes(out: str, group: Any, i: int, pair: int) -> dict[str, Any]:
    """Mistakes a newcomer made (issue 16's trial), each on a pair of ranks; every check is symmetric."""
    import dataclasses
    import os

    res: dict[str, Any] = {}
    params, opt = init_params(), optimizer()
    policy = fa.get_policy("f32")
    loss_fn = make_loss_fn(policy)
    layout = sharding.shard_layout(params, group)
    # 4. a sharded clip of another group (None: each shard alone): now a deprecated alias of optim's, right anywhere
    res["clip_none"] = _catch(
        lambda: fa.make_train_step(
            loss_fn, optim.chain(sharding.clip_by_global_norm(0.5, None), opt), data_parallel=group, shard=layout
        )
    )
    # 5. parameters that differ between ranks (no broadcast_params): sharded at create, unsharded at the first call
    other = init_params(seed=i)  # rank 0 of the pair: seed 0 (the same as params), rank 1: seed 1
    res["differ_sharded"] = _catch(lambda: fa.TrainState.create(other, opt, shard=layout))
    dp_step = fa.make_train_step(loss_fn, opt, data_parallel=group, policy=policy, compile=False)
    batch = shard_batch(batches(2, 0, 0.0)[0], i)
    res["differ_dp"] = _catch(lambda: dp_step(fa.TrainState.create(other, opt), batch))
    # 6. a layout of another world size or rank
    lay4 = dataclasses.replace(layout, world_size=4)
    state = fa.TrainState.create(params, opt, shard=layout)
    res["lay4_create"] = _catch(lambda: fa.TrainState.create(params, opt, shard=lay4))
    res["lay4_save"] = _catch(
        lambda: fa.checkpoint.save_sharded(f"{out}/lay4_{pair}", {"state": state}, lay4, group=group)
    )
    res["rank0_create"] = _catch(lambda: fa.TrainState.create(params, opt, shard=layout.for_rank(0)))
    # 7. a sharded state given to a step built without shard=: the step takes the layout from the state
    res["sharded_state_plain_step"] = _catch(lambda: dp_step(state, batch))
    # 3. a one-process layout saved from both ranks of a 2-rank job
    lay1 = sharding.shard_layout(params, None)
    one = fa.TrainState.create(params, opt, shard=lay1)
    res["lay1_save"] = _catch(lambda: fa.checkpoint.save_sharded(f"{out}/lay1_{pair}", {"state": one}, lay1))
    res["lay1_dir"] = os.path.exists(f"{out}/lay1_{pair}")
    # 2a. a replicated whole tensor shaped like a shard (an EMA of "row", 1 row: on 2 ranks its shard is whole)
    path = f"{out}/ema_{pair}"
    ema = {k: v + 1 for k, v in params.items()}
    fa.checkpoint.save_sharded(path, {"state": state, "ema": ema}, layout, group=group)
    back = fa.checkpoint.load_sharded(
        path, {"state": fa.TrainState.create(params, opt, shard=layout), "ema": params}, layout, group=group
    )
    res["ema_back"] = back["ema"]
    res["ema_want"] = ema
    res["mu_back"] = sharding.unshard_params(back["state"].opt_state[0].mu, layout, group)
    latest = open(f"{path}/LATEST").read()
    like = {"state": fa.TrainState.create(params, opt, shard=layout), "ema": params}
    res["rank0_load"] = _catch(lambda: fa.checkpoint.load_sharded(path, like, layout.for_rank(0), group=group))
    # 2b. tensors that differ between ranks (a rank tag, a per-rank RNG state): refused, nothing written
    tag = {"state": state, "rank_tag": torch.tensor([float(i)]), "ema": ema}
    res["rank_tag"] = _catch(lambda: fa.checkpoint.save_sharded(path, tag, layout, group=group))
    torch.manual_seed(100 + i)
    rng = {"state": state, "rng": torch.get_rng_state()}
    res["rng"] = _catch(lambda: fa.checkpoint.save_sharded(path, rng, layout, group=group))
    res["latest_kept"] = open(f"{path}/LATEST").read() == latest
    dist.barrier(group=group)
    return res


def _codes(graph: Any) -> str:
    """The code of a Dynamo graph and of its subgraphs (an autograd.Function's forward and backward are some)."""
    return "\n".join(m.code for m in graph.modules() if isinstance(m, torch.fx.GraphModule))


def main(out: str) -> None:
    torch.set_num_threads(1)
    # The pairs do different work before the world's collectives, so a rank of the pair done first waits there for
    # the other pair: under the suite's load (2 cores, the other xdist worker compiling with inductor) more than
    # 120 s, which failed the job once. The job's own limit (TORCHRUN_TIMEOUT_S) is what bounds a hang.
    rank, world, device = parallel.setup_from_env(timeout_s=400)
    assert world == 4 and device.type == "cpu", (world, device)
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both
    pair, i = pairs[rank // 2], rank % 2
    results: dict[str, Any] = {"rank": rank, "pair": {}, "world": {}}
    for name in PAIR_SCENARIOS[rank // 2]:
        results["pair"][name] = {
            "sharded": run(name, pair, i, sharded=True),
            "plain": run(name, pair, i, sharded=False),
        }
    results["errors"] = _errors(pair, i)
    results["fixes"] = _fixes(out, pair, i, rank // 2)
    results["rounding_pair"] = _rounding(pair, i)
    if rank < 2:
        from torch._dynamo.testing import CompileCounterWithBackend

        counter = CompileCounterWithBackend("aot_eager")
        results["compiled"] = run("f16", pair, i, sharded=True, compile_backend=counter, from_state=True)["records"]
        results["compile"] = {"frame_count": counter.frame_count, "code": [_codes(g) for g in counter.graphs]}
    else:
        results["clip"] = _clip(pair, i)
        results["fsdp2"] = _fsdp2(pair, i)
    # Checkpoints: save on 2 ranks (pair 0) and on 4, load each on the other world size (and in the test: on 1).
    results["resume"] = _resume(out, pairs[rank // 2], i) if rank < 2 else None
    group = parallel.resolve_group(True)
    results["resume4"] = _resume(out, group, rank)
    dist.barrier()
    results["load_2_on_4"] = _load_into(f"{out}/resume2", group)
    results["load_4_on_2"] = _load_into(f"{out}/resume4", pair)
    for name in WORLD_SCENARIOS:
        results["world"][name] = {
            "sharded": run(name, group, rank, sharded=True),
            "plain": run(name, group, rank, sharded=False),
        }
    results["rounding_world"] = _rounding(group, rank)
    results["rounding_world_no_layout"] = _rounding(group, rank, with_offsets=False)  # the negative control
    torch.save(results, f"{out}/rank{rank}.pt")
    parallel.shutdown()


KILL_STEP = 3  # rank 1 kills itself (SIGKILL) before this step; a checkpoint was saved after step 2
KILL_TIMEOUT_S = 10  # the collective timeout of the killed-rank run


def killed(out: str) -> None:
    """Two ranks started by hand (not torchrun, which would stop the survivor itself): rank 1 dies mid-run.

    Rank 0 prints ``SURVIVOR <seconds> <error>`` when its next step fails, the seconds counted from
    the start of that step.
    """
    import os
    import signal
    import time

    torch.set_num_threads(1)
    rank, world, _ = parallel.setup_from_env("gloo", timeout_s=KILL_TIMEOUT_S)
    policy = fa.get_policy("f32")
    params, opt = init_params(), optimizer()
    group = parallel.resolve_group(True)
    layout = sharding.shard_layout(params, group)
    state = fa.TrainState.create(params, opt, shard=layout)
    step = fa.make_train_step(
        make_loss_fn(policy), opt, data_parallel=group, policy=policy, shard=layout, compile=False
    )
    for n, batch in enumerate(batches(world, 0, 0.0)[:5], start=1):
        if n == KILL_STEP and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        t0 = time.perf_counter()
        try:
            state, _ = step(state, shard_batch(batch, rank))
        except Exception as e:
            print(f"SURVIVOR {time.perf_counter() - t0:.1f} {type(e).__name__}: {e}".replace("\n", " "), flush=True)
            os._exit(3)
        if n == KILL_STEP - 1:
            fa.checkpoint.save_sharded(f"{out}/killed", {"state": state}, layout, group=group)


if __name__ == "__main__":
    if sys.argv[2:] == ["killed"]:
        killed(sys.argv[1])
    else:
        main(sys.argv[1])
