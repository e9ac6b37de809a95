"""A frozen copy of funcamp's train step as it was before the stages redesign (commit 3bfc906, issue 23).

tests/test_stages.py compares the assembled step with it, bitwise, in one process: every state leaf and metric,
eager and compiled. Only the step's arithmetic is kept (no argument checks at the first call, no eager re-run of
errors); do not change it, except where a name it imports moves (the calls of sharding.check_optimizer, a
build-time check that became a deprecated no-op, were removed).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from funcamp import _tree, numerics, parallel, sharding
from funcamp.grad import scaled_grad_and_value
from funcamp.loss_scale import NoOpLossScale
from funcamp.optim import GradientTransformation, apply_updates, learning_rate
from funcamp.policy import Policy, get_policy
from funcamp.train import LossSum, TrainState, _loss, _probes  # noqa: F401  (TrainState: the state this step takes)
from funcamp.train._storage import PerLeaf


def _micro_batches(batch: Any, k: int) -> list[Any]:
    if k == 1:
        return [batch]
    leaves, spec = _tree.tree_flatten(batch)
    chunks = []
    for path, leaf in zip(_tree.tree_paths(batch), leaves):
        if not isinstance(leaf, torch.Tensor) or leaf.ndim == 0 or leaf.shape[0] % k:
            shape = tuple(leaf.shape) if isinstance(leaf, torch.Tensor) else type(leaf).__name__
            raise ValueError(
                f"make_train_step: with accumulation_steps={k}, every batch leaf must be a tensor whose first "
                f"dimension is divisible by {k}; leaf {path!r} is {shape}"
            )
        chunks.append(leaf.chunk(k))
    return [_tree.tree_unflatten(spec, [c[i] for c in chunks]) for i in range(k)]


def make_train_step(
    loss_fn: Callable[..., Any],
    optimizer: GradientTransformation,
    *,
    has_aux: bool = False,
    accumulation_steps: int = 1,
    max_consecutive_skips: int | None = None,
    compile: bool = True,
    backend: str | None = None,
    data_parallel: Any = None,
    policy: Policy | str | None = None,
    telemetry: numerics.Telemetry | int | None = None,
    shard: sharding.ShardLayout | None = None,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]:
    if not callable(loss_fn):
        raise TypeError(f"make_train_step: loss_fn must be callable, got {type(loss_fn).__name__}")
    if not isinstance(optimizer, GradientTransformation):
        raise TypeError(
            f"make_train_step: optimizer must be a funcamp.optim.GradientTransformation, got {type(optimizer).__name__}"
        )
    if not isinstance(accumulation_steps, int) or isinstance(accumulation_steps, bool) or accumulation_steps < 1:
        raise ValueError(f"make_train_step: accumulation_steps must be an int >= 1, got {accumulation_steps!r}")
    if max_consecutive_skips is not None and (not isinstance(max_consecutive_skips, int) or max_consecutive_skips < 1):
        raise ValueError(
            f"make_train_step: max_consecutive_skips must be None or an int >= 1, got {max_consecutive_skips!r}"
        )
    reduce_dtype = None if policy is None else get_policy(policy).reduce_dtype
    telemetry = numerics.as_telemetry(telemetry)
    group = parallel.resolve_group(data_parallel)  # None: one process
    k = accumulation_steps
    if shard is not None:
        _check_shard(shard, group, optimizer, policy, telemetry)

    def step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, Any]]:
        with_buffers = state.buffers is not None
        if with_buffers:
            # The buffers come back through aux; the loss_fn's own aux (if any) rides along.
            def fun(params: Any, buffers: Any, mb: Any) -> Any:
                returned = loss_fn(params, buffers, mb)
                if not (isinstance(returned, tuple) and len(returned) == 2):
                    got = f"a tuple of {len(returned)}" if isinstance(returned, tuple) else type(returned).__name__
                    form = "((loss, aux), new_buffers)" if has_aux else "(loss, new_buffers)"
                    raise TypeError(
                        f"make_train_step: with state.buffers, loss_fn(params, buffers, batch) must return {form}; "
                        f"got {got}"
                    )
                out, new_buffers = returned
                loss, aux = out if has_aux else (out, ())
                value, record = _loss.differentiated(loss, "make_train_step")
                return value, (new_buffers, aux, record)
        else:

            def fun(params: Any, buffers: Any, mb: Any) -> Any:
                out = loss_fn(params, mb)
                loss, aux = out if has_aux else (out, ())
                value, record = _loss.differentiated(loss, "make_train_step")
                return value, ((), aux, record)

        grad_fn = scaled_grad_and_value(fun, state.loss_scale, has_aux=True)
        # Sharded: differentiate the whole parameters, all-gathered once (the collective is not differentiated).
        whole = state.params if shard is None else sharding.all_gather_params(state.params, shard, group)
        # torch.func wants tensors (or empty containers) in aux: () stands for "no buffers".
        buffers, total, losses, sums, aux = (state.buffers if with_buffers else ()), None, [], [], ()
        for mb in _micro_batches(batch, k):
            grads32, (loss, (buffers, aux, record)) = grad_fn(whole, buffers, mb)
            if record:  # a LossSum: the gradient of this micro-batch's mean, weighted by its count
                grads32 = _tree.tree_map(lambda g, c=record[1]: g * c.to(g.dtype), grads32)
                sums.append(torch.stack(record))
            total = grads32 if total is None else _tree.tree_map(torch.add, total, grads32)
            losses.append(loss.float())
        params = state.params
        if sums:  # sum(total) / sum(count) over micro-batches and ranks: one float64 all_reduce of two numbers
            summed = sum(sums[1:], sums[0])
            summed = summed if group is None else parallel.sum_over_ranks(summed, group)
            ranks = 1 if group is None else group.size()  # the reduction below divides by the ranks again
            total = _tree.tree_map(lambda g: g * (ranks / summed[1]).to(g.dtype), total)
            loss = (summed[0] / summed[1]).float()
        else:  # the mean of the micro-batch means (then of the rank means)
            if k > 1:
                total = _tree.tree_map(lambda g: g / k, total)
            loss = torch.stack(losses).mean() if k > 1 else losses[0]
        scale = None if isinstance(state.loss_scale, NoOpLossScale) else state.loss_scale.loss_scale
        if shard is not None:  # this rank's rows of the mean over ranks, same rule as mean_gradients
            total = sharding.reduce_scatter_gradients(total, shard, group, reduce_dtype, loss_scale=scale)
        elif group is not None:  # the mean over micro-batches, then over ranks (float32 in, float32 out)
            # On a narrower wire (r=f16/bf16) the gradients travel scaled and are unscaled after the sum, as
            # DDP + GradScaler; an overflow there makes them non-finite on every rank (skip, back off).
            total = parallel.mean_gradients(total, group, reduce_dtype, loss_scale=scale)
        grads = _tree.tree_map(lambda g, p: g.to(p.dtype), total, params)
        if shard is not None:  # over all shards (padding rows excluded), the loss of every rank: one all_reduce
            finite, flags, grad_norm = sharding.global_stats(grads, shard, group, loss)
        else:
            flags = _tree.finite_flags(grads)
            finite, grad_norm = flags.all() & torch.isfinite(loss), _tree.global_norm(grads)
        if group is not None:
            if shard is None:
                finite = parallel.all_ranks_true(finite, group)
            if not sums:  # a LossSum's mean is over all ranks already
                loss = parallel.mean_over_ranks(loss, group)
            if with_buffers and _tree.tree_leaves(state.buffers):
                # Running statistics averaged, fp8 amax histories max-reduced and scales min-reduced
                # (parallel.register_buffer_reduction), so that ranks stay identical.
                buffers = parallel.reduce_buffers(buffers, group)

        updates, new_opt_state = optimizer.update(grads, state.opt_state, params)
        new_params = apply_updates(params, updates)
        if shard is not None:  # padding stays exactly zero, whatever the optimizer does there
            new_params = sharding.zero_padding(new_params, shard)
        skipped = state.skipped_steps + (~finite).to(torch.int32)
        consecutive = torch.where(finite, torch.zeros_like(state.consecutive_skips), state.consecutive_skips + 1)
        new_state = state.replace(
            step=state.step + 1,
            params=_tree.select_tree(finite, new_params, params),
            opt_state=_tree.select_tree(finite, new_opt_state, state.opt_state),
            loss_scale=state.loss_scale.adjust(finite),
            buffers=_tree.select_tree(finite, buffers, state.buffers) if with_buffers else None,
            skipped_steps=skipped,
            consecutive_skips=consecutive,
        )
        first_bad = torch.argmax((~flags).to(torch.int32)) if flags.numel() else torch.zeros((), dtype=torch.long)
        metrics = {
            "loss": loss,
            # On the parameters' device (state.step lives there): NoOpLossScale has no tensor to carry a
            # device, and a stateless optimizer's learning_rate is a NaN made on the CPU.
            "loss_scale": state.loss_scale.loss_scale.to(state.step.device),
            "grads_finite": finite,
            "grad_norm": grad_norm,
            "learning_rate": learning_rate(new_opt_state).to(state.step.device),
            "skipped_steps": skipped,
            "consecutive_skips": consecutive,
            "nonfinite_leaf": torch.where(flags.all(), -1, first_bad.to(torch.int32)),
        }
        if max_consecutive_skips is not None:
            metrics["too_many_skips"] = consecutive >= max_consecutive_skips
        if has_aux:
            metrics["aux"] = aux
        if telemetry is not None:  # every N steps, by torch.cond on the step count: one graph
            active = (state.step + 1) % telemetry.every == 0
            # Averaged over ranks, the gradients are views of one reduced buffer, and torch.cond refuses
            # operands that alias each other: give it copies (data parallelism with telemetry only).
            seen = grads if group is None else _tree.tree_map(torch.clone, grads)
            applied = None
            if telemetry.lost_updates:  # the lost-update meter: the updates as applied, the parameters kept
                carry, _ = _probes._carry(state.opt_state, new_state.opt_state, params, PerLeaf())
                applied = numerics.AppliedUpdate(updates, new_state.params, finite, carry)
            metrics.update(numerics.telemetry_metrics(seen, params, metrics["loss_scale"], telemetry, active, applied))
        return new_state, metrics

    if compile:
        return torch.compile(step, fullgraph=True, backend=backend or "inductor")
    return step


def _check_shard(shard: Any, group: Any, optimizer: GradientTransformation, policy: Any, telemetry: Any) -> None:
    """The argument checks of ``make_train_step(shard=...)`` (build time, host side)."""
    if not isinstance(shard, sharding.ShardLayout):
        raise TypeError(
            f"make_train_step: shard must be None or a funcamp.sharding.ShardLayout "
            f"(funcamp.sharding.shard_layout(params, group)), got {type(shard).__name__}"
        )
    if group is None and shard.world_size != 1:
        raise ValueError(
            f"make_train_step: shard= is a layout over {shard.world_size} ranks; pass data_parallel=True (or the "
            "group it was made for)"
        )
    if telemetry is not None:
        raise ValueError("make_train_step: telemetry= is not supported with shard= (it reads whole gradients)")
    if group is not None:
        sharding.check_consistent(shard, group, policy=None if policy is None else get_policy(policy))
