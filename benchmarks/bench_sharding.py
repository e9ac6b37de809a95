"""Benchmark: state bytes per rank and bytes on the wire per step, sharded (funcamp.sharding) vs DDP-style.

    python benchmarks/bench_sharding.py              # shapes: GPT "small" (the main job's) and GPT-2 124M
    python benchmarks/bench_sharding.py --measure    # also measured: GPT "small" under torchrun, 2 and 4 gloo ranks
    python benchmarks/bench_sharding.py --memory --worlds 2,4 --out benchmarks/results/sharding_memory.json
                                                     # what a step adds per rank: FSDP2 vs funcamp (see below)
    python benchmarks/bench_sharding.py --memory --model gpt2 --worlds 2,4   # the same for GPT-2 124M
    python benchmarks/bench_sharding.py --memory --model gpt2 --layers 2     # a quick trial (compiles in minutes)

Computed from shapes (``meta`` tensors, nothing allocated), for N = 2 and 4 ranks, with float32 master
parameters and AdamW (``optim.adamw``: two float32 moments, 0-d counters):

- state bytes per rank: parameters + optimizer state + one set of gradients (shards when sharded),
  padding included (``funcamp.sharding.state_bytes``); DDP-style data parallelism
  (``make_train_step(data_parallel=...)``) holds all of it on every rank. Activations are not counted,
  nor the whole parameters the sharded step gathers for its forward and backward (once per step, in
  the gather dtype: it holds them during the step, as FSDP2 with ``reshard_after_forward=False``).
- bytes each rank sends per step (ring algorithms, ``funcamp.sharding.wire_bytes``): DDP-style, one
  all-reduce of the gradients in the reduce dtype (``2 (N-1)/N`` of their bytes); sharded, an
  all-gather of the parameters in the gather dtype plus a reduce-scatter of the gradients in the
  reduce dtype (``(N-1)/N`` of each). With float32 for both, sharding sends the same bytes as DDP
  (plus padding); gathering in bfloat16 (``shard_layout(gather_dtype=torch.bfloat16)``, exact only
  when the loss casts every parameter to bfloat16) and reducing in bfloat16 halve it.

``--measure`` runs ``torchrun --nproc_per_node=N`` on this script (N = 2, 4; gloo on CPU): each rank
builds the main job's GPT "small" sharded state, reports its measured ``tree_bytes``, and runs one
eager sharded step with the functional collectives wrapped to count the bytes each rank puts into
them; the table prints the measured figures beside the computed ones.

Results on an AMD EPYC (AVX2, ``torch.backends.cpu.get_cpu_capability()`` = ``AVX2``), torch 2.13.0+cpu,
``python benchmarks/bench_sharding.py --measure`` (MB = 1e6 bytes; per rank; wire per step)::

    GPT "small" (the main job's) (0.84M parameters): unsharded state 13.39 MB
     N  state MB  ratio  DDP f32  shard f32  DDP bf16  shard bf16  measured: state MB, wire f32 MB
     2      6.69  0.500     3.35       3.35      1.67        1.67  6.69, 3.35
     4      3.35  0.250     5.02       5.02      2.51        2.51  3.35, 5.02

    GPT-2 124M (124.44M parameters): unsharded state 1991.04 MB
     N  state MB  ratio  DDP f32  shard f32  DDP bf16  shard bf16
     2    995.52  0.500   497.76     497.76    248.88      248.88
     4    497.77  0.250   746.64     746.65    373.32      373.33

The state per rank is 1/N of the unsharded state plus padding (under 0.01 MB here); the measured
state bytes and collective payloads equal the computed ones.

``--memory``: per rank, what one train step adds over the state at rest (as ``bench_memory.py`` measures it:
the profiler's peak of CPU-allocator bytes during a step, after two warm-up steps, the larger of two
measured steps) and the median step time over ``--time-steps`` steps, under ``torchrun`` with N gloo ranks
on one CPU, for 8 x ``Linear(2048, 2048)`` with ReLU, a batch of 8 x 2048 per rank, AdamW, bfloat16 compute,
float32 master parameters, gradients reduced in bfloat16 (FSDP2's default when only ``param_dtype`` is given;
funcamp's ``reduce=bfloat16``), no loss scale:

- ``fsdp2``: ``fully_shard`` on each Linear and the root, ``MixedPrecisionPolicy(param_dtype=bfloat16)``,
  ``torch.optim.AdamW`` (foreach), ``zero_grad(set_to_none=True)``; eager.
- ``funcamp_donate_bucket``, ``funcamp_donate_bucket_fsdp``, ``funcamp_donate_reorder``: ``funcamp_donate``
  with inductor's bucketing of all-gathers and reduce-scatters (``bucket_all_gathers_fx="all"`` or
  ``"only_fsdp"``, ``bucket_reduce_scatters_fx="all"``) or its compute/communication reordering
  (``reorder_for_compute_comm_overlap=True``), see :data:`OVERLAP`.
- ``funcamp`` / ``funcamp_donate``: ``make_train_step(..., shard=shard_layout(params, group,
  gather_dtype=bfloat16))`` compiled with inductor, without / with ``donate=True``, the model through
  ``funcamp.nn.functionalize``: with a funcamp that gathers at use each weight is gathered where it is used
  and its gradient reduce-scattered as it is made; with one that does not (run this script with
  ``PYTHONPATH`` at an older checkout) it gathers up front.

``--model gpt2``: ``GPT(config_for("gpt2-124m", n_layer=--layers))`` from ``examples/gpt.py`` (124.4M parameters
with 12 layers, the LM head tied to the token embedding), ``--batch`` ``2x128`` token windows per rank (the default:
a step takes seconds on one CPU core per rank; the parameters, not the activations, then dominate what a step adds,
which is what sharding is for), float32 cross-entropy of the logits; FSDP2 wraps each ``Block`` and the root,
and ``fsdp2_compiled`` also compiles each block (``Block.compile()`` after ``fully_shard``, torchtitan's way; the
FSDP2 hooks around the blocks stay eager). Per rank the rows also give the state at rest over ``12 * parameters /
N`` (float32 parameters and AdamW's two moments, unsharded, over the ranks: 1.000 plus padding).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_train_step import MLP, _trim, live_tensor_bytes, machine, profiled_step  # noqa: E402
from gpt import GPT, config_for  # noqa: E402

import funcamp as fa  # noqa: E402
from funcamp import optim, parallel, sharding  # noqa: E402

MB = 1e6
WORLDS = (2, 4)


def gpt_params(size: str, device: str = "meta") -> dict[str, torch.Tensor]:
    """The GPT's parameters by name (tied weights once), on ``device`` (meta: shapes only)."""
    with torch.device(device):
        torch.manual_seed(0)
        model = GPT(config_for(size, vocab_size=None if size == "gpt2-124m" else 256))
    return {name: p.detach() for name, p in model.named_parameters()}


def optimizer() -> optim.GradientTransformation:
    return optim.adamw(3e-4, weight_decay=0.1)


def computed(params: dict[str, torch.Tensor]) -> dict[str, Any]:
    out: dict[str, Any] = {"whole": sharding.state_bytes(params, optimizer(), 1)["total"]}
    for n in WORLDS:
        out[n] = {
            "state": sharding.state_bytes(params, optimizer(), n)["total"],
            "f32": sharding.wire_bytes(params, n),
            "bf16": sharding.wire_bytes(params, n, reduce_dtype=torch.bfloat16, gather_dtype=torch.bfloat16),
        }
    return out


def report(name: str, params: dict[str, torch.Tensor], measured: dict[int, dict[str, int]] | None = None) -> None:
    c = computed(params)
    n_params = sum(p.numel() for p in params.values())
    print(f"\n{name} ({n_params / 1e6:.2f}M parameters): unsharded state {c['whole'] / MB:.2f} MB")
    head = f"{'N':>2} {'state MB':>9} {'ratio':>6} {'DDP f32':>8} {'shard f32':>10} {'DDP bf16':>9} {'shard bf16':>11}"
    print(head + ("  measured: state MB, wire f32 MB" if measured else ""))
    for n in WORLDS:
        r = c[n]
        line = (
            f"{n:>2} {r['state'] / MB:>9.2f} {r['state'] / c['whole']:>6.3f} {r['f32']['ddp'] / MB:>8.2f} "
            f"{r['f32']['sharded'] / MB:>10.2f} {r['bf16']['ddp'] / MB:>9.2f} {r['bf16']['sharded'] / MB:>11.2f}"
        )
        if measured and n in measured:
            line += f"  {measured[n]['state'] / MB:.2f}, {measured[n]['wire'] / MB:.2f}"
        print(line)


# --- measured, under torchrun -----------------------------------------------------------------------


def worker(out: str) -> None:
    """One rank: the sharded state of GPT "small" and the bytes it puts into the collectives of one step."""
    from torch.distributed import _functional_collectives as funcol

    torch.set_num_threads(1)
    rank, world, _ = parallel.setup_from_env("gloo")
    params = parallel.broadcast_params(gpt_params("small", "cpu"))
    group = parallel.resolve_group(True)
    layout = sharding.shard_layout(params, group)
    opt = optimizer()
    state = fa.TrainState.create(params, opt, shard=layout)
    state_bytes = 2 * fa.tree_bytes(state.params) + fa.tree_bytes(state.opt_state)
    model = GPT(config_for("small", vocab_size=256))
    apply_fn, _ = fa.nn.functionalize(model, fa.get_policy("f32"))

    def loss_fn(p: Any, batch: Any) -> torch.Tensor:
        logits = apply_fn(p, batch["x"])
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["y"].flatten())

    step = fa.make_train_step(loss_fn, opt, compile=False)  # the layout and its group: the state's
    sent = {"wire": 0}
    originals = {n: getattr(funcol, n) for n in ("all_gather_single", "reduce_scatter_single")}

    def counting(name: str) -> Any:
        def wrapped(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            # ring: (N-1)/N of the gathered (N * input) or scattered (input) bytes
            full = x.numel() * x.element_size() * (world if name == "all_gather_single" else 1)
            sent["wire"] += full * (world - 1) // world
            return originals[name](x, *args, **kwargs)

        return wrapped

    for name in originals:
        setattr(funcol, name, counting(name))
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (2, 128), generator=g)
    step(state, {"x": x, "y": x})
    for name, fn in originals.items():
        setattr(funcol, name, fn)
    everyone: list[Any] = [None] * world
    torch.distributed.all_gather_object(everyone, {"state": state_bytes, "wire": sent["wire"]})
    if rank == 0:
        torch.save(everyone, out)
    parallel.shutdown()


def measure() -> dict[int, dict[str, int]]:
    import tempfile

    results = {}
    for n in WORLDS:
        with tempfile.TemporaryDirectory() as d:
            out = os.path.join(d, "m.pt")
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={n}",
                __file__,
                "--worker",
                out,
            ]
            subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True)
            ranks = torch.load(out, weights_only=True)
        results[n] = {"state": max(r["state"] for r in ranks), "wire": max(r["wire"] for r in ranks)}
    return results


# --- memory and time of one step per rank: FSDP2 vs funcamp -----------------------------------------

WIDTH, DEPTH, BATCH = 2048, 8, 8
MEMORY_VARIANTS = ("fsdp2", "funcamp", "funcamp_donate")
#: what ``--model gpt2`` runs by default: FSDP2 eager and with each block compiled (``fsdp2_compiled``)
GPT2_VARIANTS = ("fsdp2", "fsdp2_compiled", "funcamp", "funcamp_donate")
#: inductor's communication passes, tried on ``funcamp_donate`` (``--variants funcamp_donate_bucket,...``)
OVERLAP = {
    "bucket": {"bucket_all_gathers_fx": "all", "bucket_reduce_scatters_fx": "all"},
    "bucket_fsdp": {"bucket_all_gathers_fx": "only_fsdp", "bucket_reduce_scatters_fx": "all"},
    "reorder": {"reorder_for_compute_comm_overlap": True},
}


def memory_job(model_name: str, layers: int, batch: str, rank: int, n: int) -> tuple[torch.nn.Module, list, list, Any]:
    """``(model, its modules FSDP2 shards before the root, n batches of this rank, loss(output, batch))``.

    ``mlp``: :class:`MLP`, a batch of 8 x 2048 per rank, the loss ``mean(out ** 2)`` in float32. ``gpt2``:
    ``GPT(config_for("gpt2-124m", n_layer=layers))`` (its LM head tied to the token embedding), ``batch``
    ``"BxT"`` token windows per rank, float32 cross-entropy of the logits.
    """
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1 + rank)
    if model_name == "mlp":
        mlp = MLP(WIDTH, DEPTH)
        data = [{"x": torch.randn(BATCH, WIDTH, generator=g)} for _ in range(n)]
        return mlp, list(mlp.layers), data, lambda out, b: out.float().square().mean()
    cfg = config_for("gpt2-124m", n_layer=layers)
    gpt = GPT(cfg)
    b, t = (int(v) for v in batch.split("x"))
    tokens = [torch.randint(0, cfg.vocab_size, (b, t + 1), generator=g) for _ in range(n)]
    data = [{"x": w[:, :-1].contiguous(), "y": w[:, 1:].contiguous()} for w in tokens]

    def loss(out: torch.Tensor, b: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), b["y"].flatten())

    return gpt, list(gpt.blocks), data, loss


def memory_worker(variant: str, out: str, time_steps: int, model_name: str, layers: int, batch: str) -> None:
    import statistics
    import time

    torch.set_num_threads(1)
    rank, world, _ = parallel.setup_from_env("gloo")
    group = parallel.resolve_group(True)
    device = torch.device("cpu")
    _trim()
    before = live_tensor_bytes(device)
    model, blocks, data, loss = memory_job(model_name, layers, batch, rank, 4 + time_steps)
    numel = sum(p.numel() for p in model.parameters())
    if variant.startswith("fsdp2"):
        from torch.distributed.device_mesh import DeviceMesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = DeviceMesh.from_group(group, "cpu")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for m in (*blocks, model):
            fully_shard(m, mesh=mesh, mp_policy=mp)
        if variant == "fsdp2_compiled":  # torchtitan's way: each block compiled, FSDP2's hooks around it eager
            for m in blocks:
                m.compile()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)

        def step(batch: Any) -> None:
            loss(model(batch["x"]), batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    else:
        # reduced in bfloat16, as FSDP2 reduces with only param_dtype given (reduce_dtype defaults to it)
        policy = fa.get_policy("params=float32,compute=bfloat16,output=float32,reduce=bfloat16")
        apply_fn, params = fa.nn.functionalize(model, policy)
        params = parallel.broadcast_params(params)
        del model, blocks

        def loss_fn(p: Any, batch: Any) -> torch.Tensor:
            return loss(apply_fn(p, batch["x"]), batch)

        layout = sharding.shard_layout(params, group, gather_dtype=torch.bfloat16)
        fopt = optim.adamw(1e-3, weight_decay=0.1)
        box = [fa.TrainState.create(params, fopt, shard=layout, policy=policy)]
        del params
        from torch._inductor import config as inductor_config

        overlap = OVERLAP.get(variant.split("_")[-1], {})
        inductor_config.patch(overlap).__enter__()  # this process compiles once, with these passes
        train_step = fa.make_train_step(loss_fn, fopt, donate="donate" in variant)  # the layout: the state's

        def step(batch: Any) -> None:
            box[0], _ = train_step(box[0], batch)

    it = iter(data)
    t0 = time.perf_counter()
    for _ in range(2):
        step(next(it))
    warmup_s = time.perf_counter() - t0
    _trim()
    adds, rests = [], []
    for _ in range(2):
        rest = live_tensor_bytes(device) - before
        adds.append(profiled_step(lambda: step(next(it)))[0])
        rests.append(rest)
    times = []
    for batch in it:
        torch.distributed.barrier()
        t0 = time.perf_counter()
        step(batch)
        times.append(time.perf_counter() - t0)
    everyone: list[Any] = [None] * world
    mine = {
        "adds": max(adds),
        "rest": max(rests),
        "step_s": statistics.median(times),
        "warmup_s": warmup_s,
        # params + AdamW's two moments, float32, unsharded: the state at rest of one process
        "whole_state": 12 * numel,
    }
    torch.distributed.all_gather_object(everyone, mine)
    if rank == 0:
        Path(out).write_text(json.dumps(everyone))
    parallel.shutdown()


def memory(worlds: list[int], variants: list[str], time_steps: int, job: list[str]) -> list[dict[str, Any]]:
    """One ``torchrun`` per (ranks, variant); ``job``: the worker's ``--model``, ``--layers``, ``--batch``."""
    import tempfile

    rows = []
    for n in worlds:
        for variant in variants:
            with tempfile.TemporaryDirectory() as d:
                out = os.path.join(d, "m.json")
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}"]
                cmd += [__file__, "--memory-worker", variant, out, "--time-steps", str(time_steps), *job]
                subprocess.run(cmd, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
                ranks = json.loads(Path(out).read_text())
            row = {
                "world": n,
                "variant": variant,
                "adds_mb": max(r["adds"] for r in ranks) / 2**20,
                "rest_mb": max(r["rest"] for r in ranks) / 2**20,
                "rest_vs_whole_over_n": max(r["rest"] for r in ranks) / (ranks[0]["whole_state"] / n),
                "step_s": max(r["step_s"] for r in ranks),
                "warmup_s": max(r["warmup_s"] for r in ranks),
            }
            print(
                f"N={n} {variant}: adds {row['adds_mb']:.1f} MiB over {row['rest_mb']:.1f} MiB "
                f"({row['rest_vs_whole_over_n']:.3f} x whole/N), {row['step_s']:.3f} s (2 warm-up steps "
                f"{row['warmup_s']:.0f} s)",
                flush=True,
            )
            rows.append(row)
    return rows


def memory_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| ranks | variant | state at rest MiB | rest / (whole / N) | step adds MiB | vs FSDP2 | step s | vs FSDP2 "
        "| vs FSDP2 compiled |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    nan = float("nan")

    def ratio(r: dict[str, Any], ref: str, key: str) -> str:
        base = next((x for x in rows if x["world"] == r["world"] and x["variant"] == ref), None)
        return f"{r[key] / base[key]:.2f}x" if base else "-"

    for r in rows:
        lines.append(
            f"| {r['world']} | {r['variant']} | {r['rest_mb']:.1f} | {r.get('rest_vs_whole_over_n', nan):.3f} "
            f"| {r['adds_mb']:.1f} | {ratio(r, 'fsdp2', 'adds_mb')} | {r['step_s']:.3f} "
            f"| {ratio(r, 'fsdp2', 'step_s')} | {ratio(r, 'fsdp2_compiled', 'step_s')} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--measure", action="store_true", help="also measure GPT small under torchrun (2 and 4 ranks)")
    p.add_argument("--memory", action="store_true", help="what a step adds per rank: FSDP2 vs funcamp")
    p.add_argument("--worlds", default="2", help="with --memory: comma-separated rank counts (default 2)")
    p.add_argument("--model", default="mlp", choices=["mlp", "gpt2"], help="with --memory: the model (default mlp)")
    p.add_argument("--layers", type=int, default=12, help="with --model gpt2: its blocks (default 12, GPT-2 124M)")
    p.add_argument("--batch", default="2x128", help="with --model gpt2: BxT token windows per rank (default 2x128)")
    p.add_argument(
        "--variants",
        default=None,
        help=f"with --memory: of {', '.join(GPT2_VARIANTS)} and funcamp_donate_<{'|'.join(OVERLAP)}> "
        f"(default {','.join(MEMORY_VARIANTS)}; gpt2: {','.join(GPT2_VARIANTS)})",
    )
    p.add_argument("--time-steps", type=int, default=5, help="with --memory: timed steps (default 5)")
    p.add_argument("--label", default="", help="with --memory: a label stored with each row (e.g. before, after)")
    p.add_argument("--out", default=None, help="with --memory: write the rows and the machine as JSON here")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--memory-worker", nargs=2, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker)
        return
    job = ["--model", args.model, "--layers", str(args.layers), "--batch", args.batch]
    if args.memory_worker:
        memory_worker(*args.memory_worker, args.time_steps, args.model, args.layers, args.batch)
        return
    if args.memory:
        import funcamp

        info = {**machine(), "funcamp_path": str(Path(funcamp.__file__).parent), "argv": sys.argv[1:]}
        variants = args.variants or ",".join(GPT2_VARIANTS if args.model == "gpt2" else MEMORY_VARIANTS)
        rows = memory([int(n) for n in args.worlds.split(",")], variants.split(","), args.time_steps, job)
        for r in rows:
            r["label"] = args.label
            r["model"] = args.model if args.model == "mlp" else f"gpt2 {args.layers} layers, {args.batch}"
        print(
            f"`python benchmarks/bench_sharding.py {' '.join(sys.argv[1:])}`; {info['cpu']} "
            f"({info['cpu_capability']}), torch {info['torch']}"
        )
        print(memory_table(rows))
        if args.out:
            old = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {"runs": []}
            old["runs"].append({"machine": info, "rows": rows})
            Path(args.out).write_text(json.dumps(old, indent=1))
        return
    m = machine()
    print(f"machine: {m['cpu']}, torch {m['torch']}, CPU capability {m['cpu_capability']}")
    print("float32 master parameters, AdamW (two float32 moments); per rank; MB = 1e6 bytes; ring collectives")
    print("state: params + optimizer + gradients (shards when sharded); DDP/shard: bytes sent per step (f32 or bf16)")
    report('GPT "small" (the main job\'s)', gpt_params("small"), measure() if args.measure else None)
    report("GPT-2 124M", gpt_params("gpt2-124m"))


if __name__ == "__main__":
    main()
