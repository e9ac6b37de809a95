"""Worker for tests/test_sharding.py's at-use cases: ``torchrun --standalone --nproc_per_node=2 _at_use_worker.py OUT``.

Two gloo ranks. Each scenario trains a small model for ``STEPS`` steps from the same start twice: the compiled
sharded step (``aot_eager``; the shards are gathered where the loss uses them and each gradient is
reduce-scattered in its backward, :mod:`funcamp._at_use`) and the eager unsharded data-parallel step (the
reference), and records the whole parameters and metrics of every step. The loss asks the step's layout for
each parameter at its use (``param_at_use``, the hook ``funcamp.nn.functionalize`` calls) through
:func:`at_use`, except in the ``direct`` scenario (parameters used directly: gathered up front) and the
``mixed`` one (both). The compiled runs also record each collective's dtype and bytes, from the traced graph.
Also the op alone: eager, under ``torch.func.grad`` and plain autograd, against the mean of the whole gradients;
and the ``bf16`` scenario compiled with inductor: what its backward keeps of the forward's gathers. Importing
this module has no side effects.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
import torch.distributed as dist

import funcamp as fa
from funcamp import _at_use, _scope, optim, parallel, sharding

B, F_IN, HIDDEN, CLASSES = 4, 7, 5, 3
STEPS = 8
POISON_STEP = 3


def init_params() -> dict[str, torch.Tensor]:
    """Awkward shapes: 7 and 5 rows (padding on 2 ranks), 1 row (rank 1 holds only padding), 0-d, a bf16 master."""
    g = torch.Generator().manual_seed(0)
    return {
        "w1": torch.randn(F_IN, HIDDEN, generator=g) / F_IN**0.5,
        "b1": torch.zeros(HIDDEN),
        "w2": torch.randn(HIDDEN, HIDDEN, generator=g) / HIDDEN**0.5,  # used twice: a module called twice
        "head": torch.randn(HIDDEN, CLASSES, generator=g) / HIDDEN**0.5,
        "row": (torch.randn(1, CLASSES, generator=g) * 0.1).to(torch.bfloat16),  # mixed dtypes: bf16 master
        "temp": torch.tensor(1.0),  # 0-d
    }


def batches(world: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(99)
    out = []
    for step in range(STEPS):
        p = torch.zeros(world * B)
        if step == POISON_STEP:
            p[(world - 1) * B :] = 1e38  # one rank's gradient overflows: every rank skips
        x = torch.randn(world * B, F_IN, generator=g)
        y = torch.randint(0, CLASSES, (world * B,), generator=g)
        out.append({"x": x, "y": y, "poison": p, "n": (torch.arange(world * B) % 3 != 0).float()})
    return out


def at_use(p: Any, name: str) -> torch.Tensor:
    """``p[name]`` as ``funcamp.nn.functionalize`` materializes it at its module's use."""
    hook = getattr(_scope.current(), "param_at_use", None)
    return p[name] if hook is None else hook(name, p[name])


def make_loss_fn(policy: fa.Policy, mode: str = "at_use"):
    """An MLP; ``w2`` is applied three times (a weight used in several places, once as ``nn.Linear`` applies it),
    ``head`` in float32 (cast after the gather); ``mode``: ``at_use`` (every use through the hook), ``direct``
    (none), ``mixed`` (the hook, plus an L2 term on the parameters as the loss was handed them), ``losssum``."""
    get = (lambda p, k: p[k]) if mode == "direct" else at_use

    def loss_fn(params: Any, batch: Any) -> Any:
        c = policy.compute_dtype

        def w(name: str) -> torch.Tensor:
            return get(params, name).to(c)

        x = batch["x"].to(c)
        h = torch.tanh(x @ w("w1") + w("b1"))
        h = torch.tanh(h @ w("w2"))
        # the same weight again, gathered per use, applied as a plain nn.Linear applies its weight: F.linear
        # transposes it, a view of the gathered tensor that the backward must make again from a new gather
        h = torch.tanh(torch.nn.functional.linear(h, w("w2")))
        # and a third time: the three uses' bfloat16 gradients must add up in the master's float32 before the
        # reduce-scatter, as the unsharded step adds them (two terms round alike in bfloat16, three do not)
        h = torch.tanh(h @ w("w2"))
        # the head in float32: a cast of the gathered weight, which the backward must make again as well
        logits = ((h.float() @ w("head").float() + w("row")) * w("temp")).float()
        trap = (w("b1") * batch["poison"].mean().to(c)).sum().float()
        if mode == "losssum":
            per = torch.nn.functional.cross_entropy(logits, batch["y"], reduction="none") * batch["n"]
            return fa.LossSum(per.sum() + trap, batch["n"].sum())
        loss = torch.nn.functional.cross_entropy(logits, batch["y"]) + trap
        if mode == "mixed":  # weight decay written into the loss, on the parameters as handed to it
            loss = loss + 1e-3 * sum(v.float().square().sum() for v in params.values())
        return loss

    return loss_fn


SCENARIOS: dict[str, dict[str, Any]] = {
    # gathered in bf16 (FSDP2's param_dtype), reduced on a bf16 wire with the loss scale: the operations of
    # mean_gradients on the gradients the unsharded step makes (a module's two uses added in float32): bitwise
    "bf16": dict(policy="p=f32,c=bf16,o=f32,r=bf16", mode="at_use", k=1, gather=torch.bfloat16),
    # f32 throughout: the scaled gradient reduced, then unscaled (a power-of-two scale: bitwise too)
    "f32": dict(policy="p=f32,c=f32", mode="at_use", k=1),
    # at use and directly (an L2 term on the parameters as handed to the loss): both gradients, reduced once
    "mixed": dict(policy="p=f32,c=bf16,o=f32,r=bf16", mode="mixed", k=1),
    # two micro-batches, a LossSum: reduced per micro-batch (not bitwise, see the test)
    "losssum_k2": dict(policy="p=f32,c=f32", mode="losssum", k=2),
    # funcamp.nn.functionalize of a module with a tied weight and a module called twice
    # (gathered in float32: its LayerNorm computes in float32, which a bf16 gather would round)
    "functionalize": dict(policy="p=f32,c=bf16,o=f32,r=bf16", mode="functionalize", k=1),
}


class Tied(torch.nn.Module):
    """Linear(7, 5) -> tanh -> ``mid`` twice -> ``tied`` (its weight is ``mid``'s) -> LayerNorm -> Linear(5, 3)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid, self.tied = (
            torch.nn.Linear(F_IN, HIDDEN),
            torch.nn.Linear(HIDDEN, HIDDEN),
            torch.nn.Linear(HIDDEN, HIDDEN),
        )
        self.tied.weight = self.mid.weight
        self.norm, self.head = torch.nn.LayerNorm(HIDDEN), torch.nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.mid(torch.tanh(self.mid(h))))
        return self.head(self.norm(torch.tanh(self.tied(h))))


def functionalized(policy: fa.Policy) -> tuple[Any, dict[str, torch.Tensor]]:
    return fa.nn.functionalize(Tied(), policy)


def make_functionalized_loss(policy: fa.Policy) -> Any:
    apply_fn, _ = functionalized(policy)

    def loss_fn(params: Any, batch: Any) -> torch.Tensor:
        logits = apply_fn(params, batch["x"]).float()
        trap = (params["inp.bias"].float() * batch["poison"].mean()).sum()
        return torch.nn.functional.cross_entropy(logits, batch["y"]) + trap

    return loss_fn


def _setup(name: str, group: Any, sharded: bool) -> tuple[Any, ...]:
    """``(policy, optimizer, params, layout, loss_fn)`` of scenario ``name`` (``layout`` None unsharded)."""
    cfg = SCENARIOS[name]
    policy = fa.get_policy(cfg["policy"])
    opt = optim.adamw(1e-2, weight_decay=0.1)
    params = functionalized(policy)[1] if cfg["mode"] == "functionalize" else init_params()
    layout = sharding.shard_layout(params, group, gather_dtype=cfg.get("gather")) if sharded else None
    loss_fn = make_functionalized_loss(policy) if cfg["mode"] == "functionalize" else make_loss_fn(policy, cfg["mode"])
    return policy, opt, params, layout, loss_fn


def run(name: str, group: Any, rank: int, *, sharded: bool) -> dict[str, Any]:
    cfg = SCENARIOS[name]
    policy, opt, params, layout, loss_fn = _setup(name, group, sharded)
    scale = fa.DynamicLossScale(2.0**15, period=3)
    state = fa.TrainState.create(params, opt, loss_scale=scale, shard=layout, data_parallel=group, policy=policy)
    counter = None
    if sharded:
        from torch._dynamo.testing import CompileCounterWithBackend

        torch._dynamo.reset()
        counter = CompileCounterWithBackend("aot_eager")
    step = fa.make_train_step(
        loss_fn,
        opt,
        accumulation_steps=cfg["k"],
        compile=sharded,
        backend=counter,
    )
    records = []
    for batch in batches(group.size()):
        mine = {k: v[rank * B : (rank + 1) * B] for k, v in batch.items()}
        state, m = step(state, mine)
        whole = sharding.unshard_params(state.params, layout, group) if sharded else state.params
        records.append(
            {
                "params": {k: v.detach().clone() for k, v in whole.items()},
                **{k: m[k].clone() for k in ("loss", "loss_scale", "grads_finite", "grad_norm", "skipped_steps")},
            }
        )
    out: dict[str, Any] = {"records": records}
    if counter is not None:
        out["frame_count"] = counter.frame_count
        out["code"] = "\n".join(
            m.code for g in counter.graphs for m in g.modules() if isinstance(m, torch.fx.GraphModule)
        )
        out["collectives"] = _collectives(counter.graphs)
    return out


def _collectives(graphs: list[Any]) -> list[tuple[str, str, int]]:
    """``(op, dtype, bytes)`` of each all-gather and reduce-scatter of the Dynamo graphs (and their subgraphs, the
    Functions' forwards and backwards), in graph order, from the traced values: what the collective sends and
    receives (an all-gather's result, a reduce-scatter's input: every rank's rows)."""
    out = []
    for graph in graphs:
        for module in graph.modules():
            if not isinstance(module, torch.fx.GraphModule):
                continue
            for node in module.graph.nodes:
                name = str(node.target)
                if node.op != "call_function" or not ("all_gather" in name or "reduce_scatter" in name):
                    continue
                op = "all_gather" if "all_gather" in name else "reduce_scatter"
                val = node.meta["example_value"] if op == "all_gather" else node.args[0].meta["example_value"]
                out.append((op, str(val.dtype), val.numel() * val.element_size()))
    return out


def _from_gathers(graph: Any) -> set[Any]:
    """The forward nodes of ``graph`` computed from the forward's gathers alone: a gather's own nodes, and every
    forward node whose inputs are all such nodes (a view, a cast, a Linear's transposed weight: any op)."""
    from funcamp.passes import tags as ptags

    made: set[Any] = set()
    for node in graph.nodes:
        tags = ptags._tags(node)
        if node.op != "call_function" or tags.get(ptags._PHASE) != "forward":
            continue
        if tags.get(ptags._GATHER) or (node.all_input_nodes and all(i in made for i in node.all_input_nodes)):
            made.add(node)
    return made


def _after_forward(graph: Any) -> set[Any]:
    """The nodes after the forward: those tagged backward, and the untagged ones (the update; a node an inductor
    pattern rewrote, which loses its tag) placed after the first backward node."""
    from funcamp.passes import tags as ptags

    out, started = set(), False
    for node in graph.nodes:
        phase = ptags._tags(node).get(ptags._PHASE) if node.op == "call_function" else None
        started = started or phase == "backward"
        if phase == "backward" or (started and phase is None):
            out.add(node)
    return out


def _inductor(group: Any, rank: int, name: str) -> dict[str, Any]:
    """Scenario ``name`` compiled with inductor, 2 steps: the post-grad graph after funcamp's pass.

    For each all-gather its phase tag, and what the backward keeps of the forward's gathers: every node after the
    forward (the backward, the update) that reads a forward value computed from gathered parameters alone (the
    gathered tensor, or a view or cast of it, whatever op made it), which the pass must have given a new gather."""
    from torch._inductor import config as inductor_config

    from funcamp.passes import tags as ptags

    graphs: list[Any] = []
    policy, opt, params, layout, loss_fn = _setup(name, group, sharded=True)
    scale = fa.DynamicLossScale(2.0**15, period=3)
    state = fa.TrainState.create(params, opt, loss_scale=scale, shard=layout, data_parallel=group, policy=policy)
    torch._dynamo.reset()
    step = fa.make_train_step(loss_fn, opt)  # the layout, group and policy: the state's
    with inductor_config.patch(post_grad_custom_post_pass=graphs.append):
        for batch in batches(group.size())[:2]:
            state, m = step(state, {k: v[rank * B : (rank + 1) * B] for k, v in batch.items()})
    graph = graphs[0]
    gathers = []
    for node in graph.nodes:
        if node.target is torch.ops._c10d_functional.all_gather_into_tensor.default:
            gathers.append(ptags._tags(node).get(ptags._PHASE))
    made, later = _from_gathers(graph), _after_forward(graph)
    kept = [f"{n.name} ({n.target}) -> {u.name} ({u.target}, {ptags._tags(u)})" for n in made for u in n.users]
    kept = [k for k, u in zip(kept, (u for n in made for u in n.users)) if u in later]
    whole = sharding.unshard_params(state.params, layout, group)
    return {"gathers": gathers, "leaks": kept, "params": whole, "finite": bool(m["grads_finite"])}


def _op_alone(group: Any, rank: int) -> dict[str, Any]:
    """The op on its own: eager ``torch.func.grad`` and plain autograd, a parameter used twice, vs the whole mean."""
    world = group.size()
    g = torch.Generator().manual_seed(5)
    whole = torch.randn(5, 3, generator=g)
    layout = sharding.shard_layout({"w": whole}, group)
    shard = sharding.shard_params({"w": whole}, layout)["w"]
    spec = _at_use.Spec((5, 3), layout.rows(0), world, torch.float32, None, group)
    x = torch.randn(4, 5, generator=g) + rank

    def loss(s: torch.Tensor) -> torch.Tensor:
        uses = _at_use.Uses([s], [spec], None)
        a, b = uses.at_use(uses.whole[0]), uses.at_use(uses.whole[0])
        return (torch.tanh(x @ a) * (x @ b)).sum()

    ref_w = whole.clone().requires_grad_()
    (torch.tanh(x @ ref_w) * (x @ ref_w)).sum().backward()
    mean = ref_w.grad.clone()
    dist.all_reduce(mean, group=group)
    mean = sharding.shard_params({"w": mean / world}, layout)["w"]
    func = torch.func.grad(loss)(shard)
    s = shard.clone().requires_grad_()
    (auto,) = torch.autograd.grad(loss(s), s)
    return {"mean": mean, "func": func, "autograd": auto}


def main(out: str) -> None:
    torch.set_num_threads(1)
    rank, world, _ = parallel.setup_from_env("gloo", timeout_s=120)
    group = parallel.resolve_group(True)
    results: dict[str, Any] = {
        "rank": rank,
        "op": _op_alone(group, rank),
        "inductor": _inductor(group, rank, "bf16"),
    }
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(SCENARIOS)
    for name in names:
        results[name] = {
            "sharded": run(name, group, rank, sharded=True),
            "plain": run(name, group, rank, sharded=False),
        }
    torch.save(results, f"{out}/rank{rank}.pt")
    parallel.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
