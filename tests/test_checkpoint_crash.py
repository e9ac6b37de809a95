"""Crash-safe checkpoints: a writer killed with SIGKILL while saving keeps the previous checkpoint.

``tests/_ckpt_writer.py`` trains a tiny model in a subprocess and checkpoints after every step. It is
killed with SIGKILL (no cleanup, no ``finally``) at a deterministic point inside ``save`` (half the
bytes written; the temporary file complete but not yet renamed) and at random moments after it
announced a save (the writer stops after that save ends, so the kill lands in it or after it
whatever the machine's load, and the survivor is that step's state or the one before). Each time,
the checkpoint on disk must load (``torch.load(weights_only=True)`` too) and equal, bitwise, the
state after the last step whose save had started; training resumed from it must end bitwise equal
to an uninterrupted run.
"""

from __future__ import annotations

import importlib.util
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from funcamp import _tree, checkpoint
from funcamp.checkpoint import _atomic

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs POSIX SIGKILL")

WRITER_PATH = Path(__file__).with_name("_ckpt_writer.py")
_spec = importlib.util.spec_from_file_location("_ckpt_writer", WRITER_PATH)
writer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(writer)

RANDOM_KILLS = 4
SEED = 20240607  # for the random kill points; fixed so a failure reproduces


@pytest.fixture(scope="module")
def reference() -> list[Any]:
    """States after 0, 1, ..., STEPS steps of the uninterrupted run (in this process, one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        step, state = writer.make_step(), writer.initial_state()
        states = [state]
        for k in range(writer.STEPS):
            state, _ = step(state, writer.batch(k))
            states.append(state)
    finally:
        torch.set_num_threads(threads)
    return states


def _equal(a: Any, b: Any) -> bool:
    la, sa = _tree.tree_flatten(a)
    lb, sb = _tree.tree_flatten(b)
    return sa == sb and all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(la, lb))


def _start(directory: Path, mode: str) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.Popen(
        [sys.executable, str(WRITER_PATH), str(directory), mode],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _kill_after(proc: subprocess.Popen, line: str, delay: float = 0.0) -> list[str]:
    """Read the writer's lines until ``line``, wait ``delay`` seconds, SIGKILL it; return what it said."""
    seen = []
    for out in proc.stdout:
        seen.append(out.strip())
        if seen[-1] == line:
            break
    else:
        proc.wait(timeout=60)
        raise AssertionError(f"writer ended before {line!r}: {seen[-3:]}; stderr: {proc.stderr.read()[-2000:]}")
    time.sleep(delay)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    proc.stdout.close()
    proc.stderr.close()
    return seen


def _check_survivor(directory: Path, reference: list[Any], candidates: list[int]) -> Any:
    """The checkpoint loads and equals the reference state after one of ``candidates`` steps; returns it."""
    path = directory / "ckpt.pt"
    raw = torch.load(path, weights_only=True)  # nothing pickled beyond plain containers and tensors
    assert raw["format"] == "funcamp.checkpoint"
    loaded = checkpoint.load(path, like=writer.payload(reference[0]))
    k = int(loaded["state"].step)
    assert k in candidates, (k, candidates)
    assert _equal(loaded["state"], reference[k])  # tensors bitwise; loss-scale options via the treespec
    assert torch.equal(loaded["ballast"], torch.full((writer.BALLAST,), float(k)))
    return loaded["state"]


def _resume(state: Any, reference: list[Any]) -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        step = writer.make_step()
        for k in range(int(state.step), writer.STEPS):
            state, _ = step(state, writer.batch(k))
    finally:
        torch.set_num_threads(threads)
    assert _equal(state, reference[-1])
    assert int(state.skipped_steps) == int(reference[-1].skipped_steps) > 0


@pytest.mark.parametrize("mode", ["midwrite", "beforerename"])
def test_kill_inside_save_keeps_previous_checkpoint(tmp_path, reference, mode):
    at = 12
    proc = _start(tmp_path, f"{mode}:{at}")
    seen = _kill_after(proc, f"paused {at}")
    assert proc.returncode == -signal.SIGKILL
    assert f"saved {at - 1}" in seen and f"saved {at}" not in seen
    leftovers = [p for p in tmp_path.iterdir() if p.name != "ckpt.pt"]
    assert len(leftovers) == 1  # the killed save's temporary file, never renamed
    if mode == "midwrite":  # a truncated file is refused with a clear error, not half-read
        with pytest.raises(checkpoint.CorruptCheckpointError, match="truncated or corrupt"):
            checkpoint.load(leftovers[0])
    state = _check_survivor(tmp_path, reference, [at - 1])
    _resume(state, reference)
    # The next save of the same target removes the killed writer's temporary file, and nothing else: not a
    # live process's (this one's), not another host's, not another target's, not an unrecognised name.
    host = _atomic._host()
    keep = [
        f".ckpt.pt.{host}-{os.getpid()}.live.tmp",
        f".ckpt.pt.otherhost-{proc.pid}.x.tmp",
        f".other.pt.{host}-{proc.pid}.x.tmp",
        ".ckpt.pt.abcd1234.tmp",
        "notes.txt",
    ]
    for name in keep:
        (tmp_path / name).write_text("x")
    checkpoint.save(tmp_path / "ckpt.pt", writer.payload(state))
    assert not leftovers[0].exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(keep + ["ckpt.pt"])


def test_random_kills_while_saving(tmp_path, reference):
    rng = random.Random(SEED)
    survived = []
    for i in range(RANDOM_KILLS):
        directory = tmp_path / f"run{i}"
        directory.mkdir()
        target = rng.randrange(2, writer.STEPS)
        proc = _start(directory, f"loop:{target}")
        seen = _kill_after(proc, f"saving {target}", delay=rng.uniform(0.0, 0.02))
        assert proc.returncode == -signal.SIGKILL, seen[-3:]
        state = _check_survivor(directory, reference, [target - 1, target])
        survived.append((target, int(state.step)))
        _resume(state, reference)
    assert len(survived) == RANDOM_KILLS
