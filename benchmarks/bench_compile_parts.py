"""Benchmark: the first compile of each part of the train step, each alone, against torch's compiled optimizer.

    python benchmarks/bench_compile_parts.py --parts optimizer,torch_optimizer --repeats 3
    python benchmarks/bench_compile_parts.py --parts optimizer,check_select,torch_optimizer --baseline /tmp/base
    python benchmarks/bench_compile_parts.py --parts step,torch_optimizer --repeats 1

Where the first compile of the main job's step goes, part by part, on the main job's GPT ("small" of
``examples/gpt.py``: 4 layers, 27 parameter tensors, 0.84M parameters; ``--model`` for another size). Each part
is compiled alone (``torch.compile(fullgraph=True)``, inductor) in a fresh process with a fresh, empty inductor
cache (``TORCHINDUCTOR_CACHE_DIR`` a new temporary directory, ``TORCHINDUCTOR_FX_GRAPH_CACHE=0``), and its first
call is timed:

* ``optimizer``: the main job's ``chain(clip_by_global_norm(1.0), adamw(warmup_cosine_decay(...),
  weight_decay=0.1, mask=matrices))`` over the model's float32 parameters: ``update`` then ``apply_updates``;
* ``optimizer_flat``: the same optimizer as the compiled step runs it over flat buffers (``funcamp.train._flat``:
  the gradients concatenated into one buffer per group, the masks replayed per buffer, ``update`` then
  ``apply_updates`` on the buffers); with ``--baseline`` a checkout without the flat path has no such part;
* ``check_select``: the step's verdict and commit: the per-leaf finite flags, the global norm (the ``grad_norm``
  metric) and the ``select_tree`` of new and old parameters and AdamW moments;
* ``step``: ``funcamp.make_train_step`` with that optimizer (float32, no loss scale) on a batch of 32 x 128;
* ``torch_optimizer``: the reference, ``torch.nn.utils.clip_grad_norm_(foreach=True)`` and
  ``torch.optim.AdamW(foreach=True)`` compiled together over the same tensors.

Reported per part: the first call's wall seconds, the process's CPU seconds (user + system, its compiler
subprocesses included: steadier than wall time on a shared machine), and the lines of C++ inductor generated.
``--repeats`` rounds, each running every part once (the order rotated each round); ratios against
``torch_optimizer`` are taken within a round, and the median and spread over rounds printed. ``--baseline PATH``
adds each funcamp part run with the funcamp package of another checkout (``part@base``), so an old and a new
implementation are compared in the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("optimizer", "optimizer_flat", "check_select", "step", "torch_optimizer")
REFERENCE = "torch_optimizer"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--parts", default="optimizer,check_select,torch_optimizer", help=f"comma-separated, of {PARTS}")
    p.add_argument("--model", default="small", help="examples/gpt.py size (default: small, the main job's)")
    p.add_argument("--repeats", type=int, default=3, help="rounds (default: 3)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads in each run (default: torch's)")
    p.add_argument(
        "--stack-layers",
        action="store_true",
        help="optimizer parts over the layers' tensors stacked (blocks.N.X -> blocks.X, one leading layer axis):\n"
        "the tensors a scan over stacked layers would hand the optimizer (9 for GPT small, not 27)",
    )
    p.add_argument("--baseline", default=None, metavar="PATH", help="also run the funcamp parts with PATH/funcamp")
    p.add_argument("--json", default=None, help="write the runs and the summary here")
    p.add_argument("--run", default=None, help=argparse.SUPPRESS)  # internal: one part in this process
    args = p.parse_args(argv)
    args.parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    for x in args.parts:
        if x not in PARTS:
            p.error(f"--parts: unknown part {x!r}; choose from {', '.join(PARTS)}")
    if args.repeats < 1:
        p.error("--repeats must be >= 1")
    if args.baseline and not (Path(args.baseline) / "funcamp" / "__init__.py").exists():
        p.error(f"--baseline: {args.baseline} holds no funcamp/__init__.py")
    return args


# --- one part, in this process -------------------------------------------------------------------------------


def _stacked(params: dict) -> dict:
    """``blocks.N.X`` entries stacked into one ``blocks.X`` tensor (layers on a new leading axis)."""
    import torch

    out: dict = {}
    layers: dict[str, list] = {}
    for name, x in params.items():
        parts = name.split(".")
        if parts[0] == "blocks" and parts[1].isdigit():
            layers.setdefault(".".join(["blocks", *parts[2:]]), []).append(x)
        else:
            out[name] = x
    return {**out, **{name: torch.stack(xs) for name, xs in layers.items()}}


def _model_and_grads(size: str, stack_layers: bool = False) -> tuple[Any, dict, dict]:
    import torch

    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import GPT, config_for

    torch.manual_seed(0)
    model = GPT(config_for(size))
    params = {k: v.detach().clone() for k, v in model.named_parameters()}
    if stack_layers:
        params = _stacked(params)
    grads = {k: torch.randn_like(v) * 1e-2 for k, v in params.items()}
    return model, params, grads


def _main_job_optimizer(params: dict) -> Any:
    from funcamp import optim

    schedule = optim.warmup_cosine_decay(3e-3, warmup=40, total=400, end_value=3e-4)  # examples/train_gpt.py's
    mask = {k: not k.split(".")[-2].startswith("ln") for k in params}  # the matrices (no biases in this GPT)
    return optim.chain(
        optim.clip_by_global_norm(1.0), optim.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.1, mask=mask)
    )


def _build(part: str, size: str, stack_layers: bool = False) -> Any:
    """``first()``: the part's first call (compiling it), on the model's tensors."""
    import torch

    if stack_layers and part == "step":
        raise ValueError("--stack-layers: the step part takes the model's own parameters")
    model, params, grads = _model_and_grads(size, stack_layers)
    if part == "torch_optimizer":
        ps = [p.clone().requires_grad_() for p in params.values()]
        opt = torch.optim.AdamW(ps, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)
        for p, g in zip(ps, grads.values()):
            p.grad = g.clone()

        @torch.compile
        def torch_step() -> None:
            torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=True)
            opt.step()

        return torch_step

    import funcamp as fa
    from funcamp import _tree, optim

    if part == "optimizer":
        opt = _main_job_optimizer(params)
        state = opt.init(params)

        def update(params: dict, state: Any, grads: dict) -> Any:
            updates, new_state = opt.update(grads, state, params)
            return optim.apply_updates(params, updates), new_state

        compiled = torch.compile(update, fullgraph=True)
        return lambda: compiled(params, state, grads)
    if part == "optimizer_flat":
        from funcamp.optim import _flat as flat_opt
        from funcamp.train import _flat

        opt = _main_job_optimizer(params)
        layout = _flat.layout_for(params, opt)
        if layout is None:
            raise RuntimeError("optimizer_flat: this checkout's flat layout refuses the main job's optimizer")
        packed = layout.pack(fa.TrainState.create(params, opt))
        if packed is None:
            raise RuntimeError("optimizer_flat: the state does not pack into the layout")
        flat_state = packed[0]

        def flat_update(buffers: dict, state: Any, grads: dict) -> Any:
            flat_grads = layout.flat(grads)
            updates, new_state = flat_opt.replaying(layout.replay, opt.update, flat_grads, state, buffers)
            return optim.apply_updates(buffers, updates), new_state

        compiled = torch.compile(flat_update, fullgraph=True)
        return lambda: compiled(flat_state.params.buffers, flat_state.opt_state, grads)
    if part == "check_select":
        opt = _main_job_optimizer(params)
        state = opt.init(params)
        new_params = {k: v + 1 for k, v in params.items()}
        new_state = _tree.tree_map(lambda x: x + 1, state)

        def check_select(grads: dict, loss: Any, params: dict, new_params: dict, state: Any, new_state: Any) -> Any:
            flags = _tree.finite_flags(grads)
            finite = flags.all() & torch.isfinite(loss)
            kept = _tree.select_tree(finite, new_params, params), _tree.select_tree(finite, new_state, state)
            return kept, flags, _tree.global_norm(grads)

        compiled = torch.compile(check_select, fullgraph=True)
        loss = torch.tensor(1.0)
        return lambda: compiled(grads, loss, params, new_params, state, new_state)
    if part == "step":
        policy = fa.get_policy("params=float32,compute=float32,output=float32")
        apply_fn, fparams = fa.nn.functionalize(model, policy)
        opt = _main_job_optimizer(fparams)
        train_state = fa.TrainState.create(fparams, opt)

        def loss_fn(p: dict, batch: dict) -> Any:
            logits = apply_fn(p, batch["x"])
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())

        step = fa.make_train_step(loss_fn, opt)
        g = torch.Generator().manual_seed(0)
        vocab, block = model.config.vocab_size, model.config.block_size
        batch = {k: torch.randint(0, vocab, (32, block), generator=g) for k in ("x", "y")}
        return lambda: step(train_state, batch)
    raise ValueError(part)


def _cpp_lines(cache_dir: str) -> int:
    return sum(len(f.read_text(errors="replace").splitlines()) for f in Path(cache_dir).rglob("*.cpp"))


def run_one(part: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    first = _build(part, args.model, args.stack_layers)
    start = time.perf_counter()
    first()
    wall = time.perf_counter() - start
    return {"wall_s": wall, "cpp_lines": _cpp_lines(os.environ["TORCHINDUCTOR_CACHE_DIR"])}


# --- the driver ------------------------------------------------------------------------------------------------


def spawn(part: str, args: argparse.Namespace, package_root: Path) -> dict[str, Any]:
    """Run one part in a fresh process on a fresh inductor cache; its result and CPU seconds."""
    with tempfile.TemporaryDirectory(prefix="bench_compile_parts_") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_FX_GRAPH_CACHE="0")
        env["PYTHONPATH"] = os.pathsep.join([str(package_root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--run", part, "--model", args.model]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if args.stack_layers:
            cmd += ["--stack-layers"]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if out.returncode != 0:
        raise RuntimeError(f"{part} failed:\n{out.stderr[-4000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    result["cpu_s"] = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return result


def _median_spread(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.run:
        print(json.dumps(run_one(args.run, args)))
        return
    runs: list[tuple[str, Path]] = [(x, ROOT) for x in args.parts]
    if args.baseline:
        runs += [(f"{x}@base", Path(args.baseline)) for x in args.parts if x not in (REFERENCE, "optimizer_flat")]
    results: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in runs}
    print(f"load average at start: {os.getloadavg()}", flush=True)
    for r in range(args.repeats):
        order = runs[r % len(runs) :] + runs[: r % len(runs)]
        for name, root in order:
            res = spawn(name.split("@")[0], args, root)
            res["round"], res["load"] = r, os.getloadavg()[0]
            results[name].append(res)
            print(f"round {r} {name}: {json.dumps(res)}", flush=True)
    print(f"\n| part | first call wall s | CPU s | C++ lines | CPU / {REFERENCE} | wall / {REFERENCE} |")
    print("|---|---|---|---|---|---|")
    for name, rs in results.items():
        ratios_cpu, ratios_wall = [], []
        if REFERENCE in results and name != REFERENCE:
            for res in rs:
                ref = results[REFERENCE][res["round"]]
                ratios_cpu.append(res["cpu_s"] / ref["cpu_s"])
                ratios_wall.append(res["wall_s"] / ref["wall_s"])
        cells = [
            _median_spread([x["wall_s"] for x in rs]),
            _median_spread([x["cpu_s"] for x in rs]),
            str(int(statistics.median(x["cpp_lines"] for x in rs))),
            _median_spread(ratios_cpu) if ratios_cpu else "-",
            _median_spread(ratios_wall) if ratios_wall else "-",
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"load average at end: {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
