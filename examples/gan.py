"""A GAN on a ring of 8 Gaussians, built from funcamp's train-step stages: two models, two optimizers, two losses,
a loss scale for each loss, one compiled graph.

    python examples/gan.py                     # 2000 steps, float16 compute, TensorBoard logs in runs/gan
    python examples/gan.py --steps 20 --no-compile --logdir /tmp/gan

``make_train_step`` trains one model on one loss. A GAN trains two, each on its own loss: the discriminator
on real against generated points, the generator on fooling the discriminator. Their gradients live on
different scales, and one overflowing must not skip (or back off the scale of) the other, so each loss has
its own :class:`funcamp.DynamicLossScale`, as apex's ``num_losses`` gives each loss its own scaler. The step
below is :func:`funcamp.train.run` twice, once per model, each with its own :class:`funcamp.TrainState`
(parameters, optimizer state, loss scale, skip counters); :func:`funcamp.train.assemble` compiles the whole step
into one ``torch.compile(fullgraph=True)`` graph, with the graph passes, flat storage and the traced-autograd route
of ``make_train_step``, that does not recompile as the scales move. Both scales go to TensorBoard (``d/amp/loss_scale``,
``g/amp/loss_scale``) with the losses.

The data are 2-d points from 8 Gaussians on a circle of radius 2 (standard deviation 0.05), a
function of the seed and the step. The end-of-run line gives the fraction of generated points within 0.25
of a mode (``near_mode``; 1.0 is perfect) and how many of the 8 modes have at least 2% of them.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from typing import Any

import torch

import funcamp as fa
from funcamp import optim
from funcamp.train import assemble, run

LATENT = 8
MODES = 8


def ring_batch(seed: int, step: int, n: int) -> dict[str, torch.Tensor]:
    """``n`` real points and ``n`` latent vectors for ``step`` (a function of ``seed`` and ``step``)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    angle = torch.randint(0, MODES, (n,), generator=g).float() * (2 * math.pi / MODES)
    centers = 2.0 * torch.stack([torch.cos(angle), torch.sin(angle)], dim=1)
    return {"real": centers + 0.05 * torch.randn(n, 2, generator=g), "z": torch.randn(n, LATENT, generator=g)}


def mlp(inputs: int, outputs: int, hidden: int) -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(inputs, hidden),
        torch.nn.LeakyReLU(0.2),
        torch.nn.Linear(hidden, hidden),
        torch.nn.LeakyReLU(0.2),
        torch.nn.Linear(hidden, outputs),
    )


def build(args: argparse.Namespace) -> tuple[Any, dict[str, fa.TrainState], Any]:
    """``(gan_step, states, generate)``: the pure step, the two initial states, the generator's function."""
    torch.manual_seed(args.seed)
    policy = fa.get_policy(args.policy)
    g_apply, g_params = fa.nn.functionalize(mlp(LATENT, 2, args.hidden), policy)
    d_apply, d_params = fa.nn.functionalize(mlp(2, 1, args.hidden), policy)
    d_opt = optim.adam(args.lr, b1=0.5, b2=0.999)
    g_opt = optim.adam(args.lr, b1=0.5, b2=0.999)
    bce = torch.nn.functional.binary_cross_entropy_with_logits

    def d_loss(params: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        real, fake = d_apply(params, batch["real"]).float(), d_apply(params, batch["fake"]).float()
        return bce(real, torch.ones_like(real)) + bce(fake, torch.zeros_like(fake))

    def gan_step(states: dict[str, fa.TrainState], batch: dict[str, torch.Tensor]) -> tuple[dict, dict]:
        d, g = states["d"], states["g"]
        fake = g_apply(g.param_tree(), batch["z"]).detach().float()
        d_record = run(d_loss, d_opt, d, {"real": batch["real"], "fake": fake})
        d_params_now = d.param_tree()  # the generator's loss sees the discriminator before this step's update

        def g_loss(params: Any, z: torch.Tensor) -> torch.Tensor:
            logits = d_apply(d_params_now, g_apply(params, z)).float()
            return bce(logits, torch.ones_like(logits))

        g_record = run(g_loss, g_opt, g, batch["z"])
        metrics = {f"d/{k}": v for k, v in d_record.metrics.items()}
        metrics.update({f"g/{k}": v for k, v in g_record.metrics.items()})
        return {"d": d_record.new_state, "g": g_record.new_state}, metrics

    def loss_scale() -> fa.LossScale:  # one object per loss: shared tensors would alias the two states
        if policy.compute_dtype == torch.float16:
            return fa.DynamicLossScale(2.0**15, period=args.scale_period)
        return fa.NoOpLossScale()

    states = {
        "d": fa.TrainState.create(d_params, d_opt, loss_scale=loss_scale()),
        "g": fa.TrainState.create(g_params, g_opt, loss_scale=loss_scale()),
    }
    return gan_step, states, g_apply


def mode_coverage(points: torch.Tensor) -> tuple[float, int]:
    """``(near_mode, modes_hit)``: the fraction of points within 0.25 of a mode, the modes with >= 2% of them."""
    angle = torch.arange(MODES).float() * (2 * math.pi / MODES)
    centers = 2.0 * torch.stack([torch.cos(angle), torch.sin(angle)], dim=1)
    dist = torch.cdist(points.float(), centers)
    near, which = dist.min(dim=1)
    close = near < 0.25
    counts = torch.bincount(which[close], minlength=MODES)
    return float(close.float().mean()), int((counts >= 0.02 * len(points)).sum())


def _tags() -> dict[str, str | None]:
    tags: dict[str, str | None] = {}
    for model in ("d", "g"):
        for name, tag in fa.tensorboard.DEFAULT_TAGS.items():
            tags[f"{model}/{name}"] = None if tag is None else f"{model}/{tag}"
    return tags


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--steps", type=int, default=2000, help="train steps (default 2000)")
    p.add_argument("--batch-size", type=int, default=256, help="points per step (default 256)")
    p.add_argument("--hidden", type=int, default=128, help="hidden width of both MLPs (default 128)")
    p.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate of both models (default 1e-3)")
    p.add_argument(
        "--policy",
        default="params=float32,compute=float16,output=float32",
        help="precision policy of both models (default float16 compute, a dynamic loss scale per loss)",
    )
    p.add_argument("--scale-period", type=int, default=200, help="finite steps between loss-scale growths")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-compile", action="store_true", help="run the step eagerly")
    p.add_argument("--backend", default="inductor", help="torch.compile backend (default inductor)")
    p.add_argument("--logdir", default="runs/gan", help="TensorBoard directory (default runs/gan)")
    p.add_argument("--log-every", type=int, default=50, help="steps between TensorBoard writes (default 50)")
    args = p.parse_args(argv)
    if args.steps < 1 or args.batch_size < 1 or args.log_every < 1:
        p.error("--steps, --batch-size and --log-every must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Train; return the last metrics (floats), the coverage, the graph count and the states."""
    args = parse_args(argv)
    gan_step, states, generate = build(args)
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # the graphs Dynamo makes, counted
    gan_step = assemble(gan_step, compile=not args.no_compile, backend=args.backend)
    start, metrics = time.perf_counter(), {}
    with fa.TensorBoardLogger(args.logdir, log_every=args.log_every, tags=_tags()) as logger:
        for step in range(args.steps):
            states, metrics = gan_step(states, ring_batch(args.seed, step, args.batch_size))
            logger.log(metrics, step=step)
    host = {k: float(v) for k, v in metrics.items()}
    frames = None if args.no_compile else torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs_before
    with torch.no_grad():
        points = generate(states["g"].param_tree(), ring_batch(args.seed + 1, 0, 2048)["z"])
    near, modes = mode_coverage(points)
    print(
        f"done: {args.steps} steps in {time.perf_counter() - start:.1f} s, "
        f"d loss {host['d/loss']:.3f} (scale {host['d/loss_scale']:g}, {host['d/skipped_steps']:.0f} skipped), "
        f"g loss {host['g/loss']:.3f} (scale {host['g/loss_scale']:g}, {host['g/skipped_steps']:.0f} skipped), "
        f"near_mode {near:.2f}, modes {modes}/{MODES}"
        + ("" if frames is None else f", {frames} graph(s)")
        + f"; tensorboard --logdir {args.logdir}"
    )
    return {
        "metrics": host,
        "near_mode": near,
        "modes": modes,
        "graphs": frames,
        "states": states,
    }


if __name__ == "__main__":
    main(sys.argv[1:])
