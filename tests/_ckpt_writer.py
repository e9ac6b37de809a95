"""Helper for tests/test_checkpoint_crash.py: a training run that checkpoints after every step.

Run as ``python tests/_ckpt_writer.py DIR MODE`` it trains ``STEPS`` steps of a tiny model and, after
each step ``k`` (1-based), prints ``saving k``, calls ``funcamp.checkpoint.save(DIR/ckpt.pt, ...)`` and
prints ``saved k``. The parent test kills it with SIGKILL. ``MODE`` is

- ``loop:K``: nothing else until step K's save has ended; then it prints ``paused K`` and sleeps, so the
  parent's kill, sent at a random moment after the ``saving K`` line, lands inside step K's save or after
  it, never in a later step's, whatever the machine's load;
- ``midwrite:K``: at step K, ``torch.save`` writes only the first half of the bytes into the
  temporary file, prints ``paused K`` and sleeps (the parent kills it mid-write);
- ``beforerename:K``: at step K, the temporary file is complete and fsynced but ``os.replace``
  prints ``paused K`` and sleeps (the parent kills it before the rename).

The test imports this file for ``make_step``, ``initial_state`` and ``batch`` so that the parent's
uninterrupted run is the same computation. Everything is deterministic (seeded, one thread, eager).
"""

from __future__ import annotations

import io
import os
import sys
import time
from typing import Any

import torch

import funcamp as fa
from funcamp import checkpoint, optim

STEPS = 24
SHAPES = {"b1": (16,), "b2": (1,), "w1": (8, 16), "w2": (16, 1)}
BALLAST = 2**19  # float32 elements saved with the state (2 MiB), so that a save takes a while


def optimizer() -> optim.GradientTransformation:
    return optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(1e-2, weight_decay=0.01))


def loss_fn(params: dict, batch: dict) -> torch.Tensor:
    p = {k: v.to(torch.bfloat16) for k, v in params.items()}
    h = torch.tanh(batch["x"].to(torch.bfloat16) @ p["w1"] + p["b1"])
    return ((h @ p["w2"] + p["b2"]).float() - batch["y"]).square().mean() + batch["poison"]


def make_step():
    return fa.make_train_step(loss_fn, optimizer(), compile=False)


def initial_state() -> fa.TrainState:
    gen = torch.Generator().manual_seed(0)
    params = {k: torch.randn(s, generator=gen) * 0.3 for k, s in SHAPES.items()}
    return fa.TrainState.create(params, optimizer(), loss_scale=fa.DynamicLossScale(2.0**8, period=3))


def batch(step: int) -> dict:
    """The batch of step ``step`` (0-based); every 7th step (3, 10, ...) has a non-finite loss."""
    gen = torch.Generator().manual_seed(1000 + step)
    poison = torch.tensor(float("inf") if step % 7 == 3 else 0.0)
    return {"x": torch.randn(32, 8, generator=gen), "y": torch.randn(32, 1, generator=gen), "poison": poison}


def payload(state: fa.TrainState) -> dict[str, Any]:
    return {"state": state, "ballast": torch.full((BALLAST,), float(int(state.step)))}


def _pause(step: int) -> None:
    print(f"paused {step}", flush=True)
    time.sleep(600)


def _install_pause(mode: str, step_box: list[int]) -> None:
    kind, _, at = mode.partition(":")
    if kind == "midwrite":
        real_save = torch.save

        def half_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
            if step_box[0] != int(at):
                return real_save(obj, f, *args, **kwargs)
            buf = io.BytesIO()
            real_save(obj, buf, *args, **kwargs)
            data = buf.getvalue()
            f.write(data[: len(data) // 2])
            f.flush()
            os.fsync(f.fileno())
            _pause(step_box[0])

        torch.save = half_save
    elif kind == "beforerename":
        real_replace = os.replace

        def paused_replace(src: Any, dst: Any) -> None:
            if step_box[0] == int(at):
                _pause(step_box[0])
            real_replace(src, dst)

        os.replace = paused_replace
    elif kind != "loop":
        raise SystemExit(f"unknown mode {mode!r}; expected loop:K, midwrite:K or beforerename:K")


def main(directory: str, mode: str) -> None:
    torch.set_num_threads(1)
    path = os.path.join(directory, "ckpt.pt")
    step_box = [0]
    _install_pause(mode, step_box)
    step, state = make_step(), initial_state()
    for k in range(STEPS):
        state, _ = step(state, batch(k))
        step_box[0] = k + 1
        print(f"saving {k + 1}", flush=True)
        checkpoint.save(path, payload(state))
        print(f"saved {k + 1}", flush=True)
        if mode == f"loop:{k + 1}":
            _pause(k + 1)
    print("done", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
