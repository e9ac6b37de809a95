"""Benchmark: what funcamp's compiled step hands to AOTAutograd and inductor, against torch.compile(model).

    python benchmarks/bench_graph_size.py                               # GPT small, the main job's
    python benchmarks/bench_graph_size.py --models small,gpt2-body      # and GPT-2 124M's body
    python benchmarks/bench_graph_size.py --models gpt2-body --layers 2 # GPT-2's width, 2 layers

Counts, not times: they are the same on a quiet and a loaded machine, so a regression shows in any run. Per
model, each variant compiles in a fresh process with a fresh, empty inductor cache and the FX graph and
AOTAutograd caches off (every graph is compiled, none served), and its first step is run. What each phase was
handed is recorded in that process:

* **Dynamo graph**: the FX graph Dynamo hands the backend (``torch._inductor.compile_fx.compile_fx``'s first
  argument): graphs, and their operator nodes (``call_function`` / ``call_method`` / ``call_module``).
* **AOTAutograd graphs**: what AOTAutograd hands inductor's compiler (``compile_fx``'s ``inner_compile``): a
  forward and a backward graph for a module trained by autograd, one inference graph for a step whose backward
  Dynamo traced into its graph (funcamp's, and torch's optimizer step); operator nodes (``call_function``).
* **post-grad graph**: the graph inductor lowers after its post-grad passes (``GraphLowering``'s module).
* **inductor's output code**: read from the wrapper module of each graph, caught as torch's own tests catch it
  (``GraphLowering.save_output_code``, the hook ``torch._inductor.utils.run_and_get_code`` patches): the
  generated C++ kernels (``async_compile.cpp_pybinding`` functions), their lines of C++, and the calls the
  wrapper makes to kernels inductor did not generate (``extern_kernels.*`` matmuls, ``torch.ops`` fallbacks).

Variants (``--variants``):

* ``torch``: as torch users run it. ``torch.compile(model)`` under ``torch.autocast(bfloat16)``; the loss
  (``F.cross_entropy`` of the float32 logits) outside the compiled model; then the optimizer step compiled as
  torch's recipe compiles it (``torch.compile`` of a function calling ``clip_grad_norm_(foreach=True)`` and
  ``torch.optim.AdamW(foreach=True).step()``), with the main job's hyperparameters (clip 1.0, betas 0.9/0.95,
  weight decay 0.1 on matrices only: two parameter groups). Reported as the model's forward + backward and as
  that plus the optimizer step.
* ``funcamp``: the main job's step (``examples/train_gpt.py``'s ``build_run``: ``functionalize`` with the fixed
  policy ``params=float32,compute=bfloat16,output=float32``, no loss scale, ``clip_by_global_norm(1.0)`` +
  AdamW on a warmup-cosine schedule, ``make_train_step``), as the main job runs it (donating by default).
* ``funcamp_pure``: the same step undonated (``--no-donate``).

Models (``--models``): ``small`` (the main job's GPT and batch: 4 layers, width 128, context 128, batch 32) and
``gpt2-body`` (GPT-2 124M's 12 layers, width 768, 12 heads, vocabulary 256, context 128, batch 4); ``--layers N``
replaces the depth (width unchanged).

Besides the table, the funcamp step's nodes are attributed to where they were made: each node's innermost frame
outside torch in its ``stack_trace`` (the model in ``examples/gpt.py``, the loss in ``examples/train_gpt.py``, a
funcamp file and function), for the Dynamo graph (every node) and the post-grad graph (forward nodes keep their
frame; backward nodes carry the frame of the forward node they differentiate). And the post-grad graph's
operators are counted by target against torch's: what funcamp adds, operator by operator.

The results go to ``benchmarks/results/bench_graph_size_<model>.json`` (``--json-dir``); docs/benchmarks.md
explains the extras by name.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import linecache
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("torch", "funcamp", "funcamp_pure")
#: ``--models``: name -> (examples/train_gpt.py arguments that shape it, what it is).
MODELS: dict[str, tuple[list[str], str]] = {
    "small": (["--model", "small"], "the main job's GPT: 4 layers, width 128, context 128, batch 32"),
    "gpt2-body": (
        ["--model", "gpt2-124m", "--block-size", "128", "--batch-size", "4"],
        "GPT-2 124M's body: 12 layers, width 768, 12 heads; vocabulary 256, context 128, batch 4",
    ),
}
POLICY = "params=float32,compute=bfloat16,output=float32"
#: The phases of the table: (key, label).
ROWS = (
    ("traced_instructions", "bytecode instructions Dynamo traced"),
    ("inlined_calls", "function calls Dynamo inlined"),
    ("dynamo_graphs", "Dynamo graphs"),
    ("dynamo_nodes", "Dynamo FX nodes (operators)"),
    ("aot_forward", "AOTAutograd forward graph nodes"),
    ("aot_backward", "AOTAutograd backward graph nodes"),
    ("aot_inference", "AOTAutograd inference graph nodes"),
    ("aot_nodes", "AOTAutograd graphs, all nodes"),
    ("post_grad_nodes", "post-grad graph nodes (inductor's input)"),
    ("kernels", "inductor C++ kernels"),
    ("cpp_lines", "lines of generated C++"),
    ("extern_calls", "extern / fallback calls"),
    ("wrapper_lines", "wrapper (Python) lines"),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--models", default="small", help=f"comma-separated, of {', '.join(MODELS)} (default: small)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--layers", type=int, default=None, help="the models' depth (default: each model's own)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads in each run (default: torch's)")
    p.add_argument("--json-dir", default=str(ROOT / "benchmarks" / "results"), help="where the JSON goes")
    p.add_argument("--tag", default="", help="suffix of the JSON file names (e.g. _before)")
    p.add_argument("--top", type=int, default=25, help="rows of the attribution tables (default: 25)")
    p.add_argument("--dump", default=None, metavar="DIR", help="also write every graph and output code to DIR")
    p.add_argument("--summarize", default=None, metavar="JSON", help="measure nothing: report a saved result again")
    p.add_argument(
        "--job-args",
        default="",
        help="further examples/train_gpt.py arguments of funcamp's step, e.g. '--scan off' (default: none)",
    )
    p.add_argument("--run", default=None, help=argparse.SUPPRESS)  # internal: one variant in this process
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for m in args.models:
        if m not in MODELS:
            p.error(f"--models: unknown model {m!r}; choose from {', '.join(MODELS)}")
    for v in args.variants:
        if v not in VARIANTS:
            p.error(f"--variants: unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be >= 1")
    return args


# --- what the compiler is handed, recorded in this process -------------------------------------------------


def _operators(gm: Any) -> list[Any]:
    return [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]


def _target(node: Any) -> str:
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "call_module":
        return f"module {node.target}"
    target = node.target
    name = getattr(target, "__name__", None) or str(target)
    module = getattr(target, "__module__", None)
    if hasattr(target, "_schema") or type(target).__name__ in ("OpOverload", "OpOverloadPacket"):
        return str(target)  # aten.mm.default
    if module and module.startswith("_operator"):
        return f"operator.{name}"
    return f"{module}.{name}" if module else name


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def _origin(node: Any) -> str:
    """Where ``node`` was made: the innermost frame of its stack trace outside torch, as ``path:function`` (path
    from the repository root), skipping a frame that only calls through (its line forwards ``*args, **kwargs``:
    funcamp's op-policy mode running an op as it is, a wrapper calling the module); ``(no stack trace)`` where it
    has none, ``torch`` where every frame is torch's."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return "(no stack trace)"
    for path, line, function in reversed(_FRAME.findall(trace)):
        if f"{os.sep}torch{os.sep}" in path and "site-packages" in path:
            continue
        if "(*args, **kwargs)" in linecache.getline(path, int(line)) and "_cast" not in linecache.getline(
            path, int(line)
        ):
            continue
        return f"{_short(path)}:{function}"
    return "torch"


def _short(path: str) -> str:
    """``path`` from the repository root, ``torch/...`` for torch's files, else as it is."""
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        pass
    marker = f"site-packages{os.sep}"
    return path.split(marker, 1)[1] if marker in path else path


def _graph_record(gm: Any, kind: str) -> dict[str, Any]:
    ops = _operators(gm)
    return {
        "kind": kind,
        "nodes": len(ops),
        "inputs": sum(1 for n in gm.graph.nodes if n.op == "placeholder"),
        "targets": dict(collections.Counter(_target(n) for n in ops)),
        "origins": dict(collections.Counter(_origin(n) for n in ops)),
        "origin_targets": dict(collections.Counter(f"{_origin(n)} | {_target(n)}" for n in ops)),
    }


_KERNEL = re.compile(r"^(\w+) = async_compile\.(cpp_pybinding|cpp|triton)\((.*?)'''\)", re.M | re.S)


def _code_record(code: str, kind: str) -> dict[str, Any]:
    kernels = _KERNEL.findall(code)
    cpp_lines = 0
    for _, _, body in kernels:
        source = body.split("r'''", 1)[-1]
        cpp_lines += len([line for line in source.splitlines() if line.strip()])
    call = code.split("\ndef call(", 1)[-1].split("\ndef benchmark_compiled_module", 1)[0]
    extern = re.findall(r"\b(extern_kernels\.\w+|torch\.ops\.\w+\.\w+(?:\.\w+)?)\(", call)
    return {
        "kind": kind,
        "kernels": len(kernels),
        "kernel_names": [name for name, _, _ in kernels],
        "cpp_lines": cpp_lines,
        "extern_calls": len(extern),
        "extern": dict(collections.Counter(extern)),
        "wrapper_lines": len([line for line in code.splitlines() if line.strip()]) - cpp_lines,
    }


class Recorder:
    """Hooks on inductor's entry (the Dynamo graph and the AOTAutograd graphs it is handed) and on its output
    code; :meth:`record` returns what was caught, graph by graph, in order."""

    def __init__(self, dump: str | None = None) -> None:
        self.dump = Path(dump) if dump else None
        self.dynamo: list[dict[str, Any]] = []
        self.aot: list[dict[str, Any]] = []
        self.post_grad: list[dict[str, Any]] = []
        self.code: list[dict[str, Any]] = []
        self._depth = 0
        self.traced: collections.Counter = collections.Counter()  # (part, file): bytecode instructions Dynamo traced
        self.inlined: collections.Counter = collections.Counter()  # part: function calls Dynamo inlined
        self.part = "step"  # the part of the step being compiled (torch: "model", then "optimizer")

    @contextlib.contextmanager
    def recording(self) -> Any:
        """Within: every graph compiled (the FX graph and AOTAutograd caches off: a graph served from a cache is
        neither lowered nor counted) and recorded."""
        from unittest import mock

        import torch
        import torch._inductor.compile_fx as compile_fx_module
        from torch._inductor.graph import GraphLowering

        original = compile_fx_module.compile_fx

        def inner(inner_compile: Any) -> Any:
            def compile_inner(gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
                kind = (
                    "backward"
                    if kwargs.get("is_backward")
                    else "inference"
                    if kwargs.get("is_inference")
                    else "forward"
                )
                self.aot.append({**_graph_record(gm, kind), "part": self.part})
                self._write(f"aot_{kind}", gm)
                return inner_compile(gm, example_inputs, **kwargs)

            return compile_inner

        def compile_fx(gm: Any, example_inputs: Any, *args: Any, **kwargs: Any) -> Any:
            if self._depth == 0:  # compile_fx calls itself (config patches): the outermost call is Dynamo's
                self.dynamo.append({**_graph_record(gm, "dynamo"), "part": self.part})
                self._write("dynamo", gm)
                if not args and "inner_compile" not in kwargs:
                    kwargs["inner_compile"] = inner(compile_fx_module.compile_fx_inner)
            self._depth += 1
            try:
                return original(gm, example_inputs, *args, **kwargs)
            finally:
                self._depth -= 1

        def save_output_code(code: str) -> None:
            from torch._inductor.virtualized import V

            graph = V.graph
            kind = "backward" if graph.is_backward else "inference" if graph.is_inference else "forward"
            self.post_grad.append({**_graph_record(graph.module, kind), "part": self.part})
            self.code.append({**_code_record(code, kind), "part": self.part})
            self._write(f"post_grad_{kind}", graph.module)
            self._write(f"output_code_{kind}", code)

        from torch._dynamo import symbolic_convert

        step = symbolic_convert.InstructionTranslatorBase.step
        inline_call = symbolic_convert.InliningInstructionTranslator.__dict__["inline_call"].__func__

        def counting_step(tracer: Any) -> bool:
            self.traced[(self.part, f"{_short(tracer.f_code.co_filename)}:{tracer.f_code.co_name}")] += 1
            return step(tracer)

        def counting_inline_call(cls: Any, *args: Any, **kwargs: Any) -> Any:
            self.inlined[self.part] += 1
            return inline_call(cls, *args, **kwargs)

        with (
            torch._inductor.config.patch(fx_graph_cache=False),
            torch._functorch.config.patch(enable_autograd_cache=False),
            mock.patch.object(compile_fx_module, "compile_fx", compile_fx),
            mock.patch.object(GraphLowering, "save_output_code", save_output_code),
            mock.patch.object(symbolic_convert.InstructionTranslatorBase, "step", counting_step),
            mock.patch.object(
                symbolic_convert.InliningInstructionTranslator, "inline_call", classmethod(counting_inline_call)
            ),
        ):
            yield self

    def _write(self, what: str, graph: Any) -> None:
        """With ``--dump``: the graph's readable code (stack traces included) or the output code, in a file."""
        if self.dump is None:
            return
        self.dump.mkdir(parents=True, exist_ok=True)
        self._written = getattr(self, "_written", 0) + 1
        text = graph if isinstance(graph, str) else graph.print_readable(print_output=False, include_stride=True)
        (self.dump / f"{self._written:02d}_{self.part}_{what}.py").write_text(text)

    def record(self) -> dict[str, Any]:
        traced: dict[str, dict[str, int]] = {}
        for (part, path), n in self.traced.items():
            traced.setdefault(part, {})[path] = n
        return {
            "dynamo": self.dynamo,
            "aot": self.aot,
            "post_grad": self.post_grad,
            "code": self.code,
            "traced_instructions": traced,
            "inlined_calls": dict(self.inlined),
        }


# --- the variants, each in its own process -------------------------------------------------------------------


def _job_args(model: str, extra: list[str]) -> Any:
    """``(train_gpt, its parsed arguments)`` for ``model`` with the fixed policy and no loss scale."""
    sys.path.insert(0, str(ROOT / "examples"))
    import train_gpt

    argv = [*MODELS[model][0], "--policy", POLICY, "--loss-scale", "none", "--quiet", *extra]
    return train_gpt, train_gpt.parse_args(argv)


def _model(train_gpt: Any, jargs: Any, layers: int | None) -> Any:
    """The GPT of the job's arguments (byte vocabulary), ``layers`` deep if given, seeded as the job seeds it."""
    import torch

    cfg = train_gpt.config_for(jargs.model, vocab_size=256, block_size=jargs.block_size, n_layer=layers)
    jargs.block_size = cfg.block_size
    torch.manual_seed(jargs.seed)
    return train_gpt.GPT(cfg)


def _batch(train_gpt: Any, jargs: Any) -> dict[str, Any]:
    """The job's first training batch."""
    data, _ = train_gpt.load_corpus(None)
    train, _ = train_gpt.split(data, jargs.block_size)
    return train_gpt.get_batch(train, 1, batch_size=jargs.batch_size, block_size=jargs.block_size, seed=jargs.seed)


def _torch_step(jargs: Any, model: Any) -> tuple[Any, Any]:
    """``(model_step(batch), optimizer_step())``: torch.compile(model) under autocast with the loss outside and
    its backward; then the optimizer step, compiled as torch's recipe compiles it."""
    import torch
    import torch.nn.functional as F

    matrices = [p for p in model.parameters() if p.ndim >= 2]
    others = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": matrices, "weight_decay": jargs.weight_decay}, {"params": others, "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=jargs.lr, betas=(0.9, 0.95), foreach=True)
    forward = torch.compile(model)
    params = list(model.parameters())

    def model_step(batch: dict[str, Any]) -> Any:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = forward(batch["inputs"])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["targets"].flatten())
        loss.backward()
        return loss

    @torch.compile
    def optimizer_step() -> None:
        torch.nn.utils.clip_grad_norm_(params, jargs.clip, foreach=True)
        opt.step()

    return model_step, optimizer_step


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """In this fresh process: build ``args.run``, run its first step under the :class:`Recorder`, return the record."""
    import torch

    import funcamp as fa

    if args.threads:
        torch.set_num_threads(args.threads)
    extra = (["--no-donate"] if args.run == "funcamp_pure" else []) + shlex.split(args.job_args)
    train_gpt, jargs = _job_args(args.model, extra)
    model = _model(train_gpt, jargs, args.layers)
    batch = _batch(train_gpt, jargs)
    recorder = Recorder(args.dump)
    plan = None
    with recorder.recording():
        if args.run == "torch":
            model_step, optimizer_step = _torch_step(jargs, model)
            recorder.part = "model"
            model_step(batch)
            recorder.part = "optimizer"
            optimizer_step()
        else:
            recorder.part = "step"
            policy = train_gpt.make_policy(fa.get_policy(POLICY), jargs.master_weights)
            run = train_gpt.build_run(jargs, policy, model, torch.device("cpu"), distributed=False)
            state = run.state
            plan = run.train_step.plan_for(state)
            run.train_step(state, batch)
    out = recorder.record()
    out.update(variant=args.run, model=args.model, layers=args.layers, plan=plan)
    return out


# --- the driver ----------------------------------------------------------------------------------------------


def spawn(variant: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one variant in a fresh process on a fresh inductor cache, the FX graph and AOTAutograd caches off."""
    with tempfile.TemporaryDirectory(prefix="bench_graph_size_") as cache:
        env = dict(
            os.environ,
            TORCHINDUCTOR_CACHE_DIR=cache,
            TORCHINDUCTOR_FX_GRAPH_CACHE="0",
            TORCHINDUCTOR_AUTOGRAD_CACHE="0",
        )
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        out = Path(cache) / "out.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--run", variant, "--model", model, "--out", str(out)]
        if args.layers:
            cmd += ["--layers", str(args.layers)]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if args.job_args:
            cmd += ["--job-args=" + args.job_args]
        if args.dump:
            cmd += ["--dump", str(Path(args.dump).resolve() / f"{model}_{variant}")]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{variant} on {model} failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
        return json.loads(out.read_text())


#: What a node of funcamp's step is for, by where it was made (:func:`_origin`), first match wins: the extras of
#: docs/benchmarks.md. torch's graphs are split by part instead (the model's forward and backward, the optimizer).
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("model: forward, backward, loss", ("examples/", "funcamp/grad.py:run")),
    ("casts of parameter uses, module inputs and outputs", ("funcamp/nn/", "funcamp/ops.py")),
    ("finite check, per leaf", ("funcamp/_tree.py:_finite_flag", "funcamp/_tree.py:_stacked_flags")),
    ("global norm (the grad_norm metric's and the clip's)", ("funcamp/_tree.py",)),
    ("flat storage: parameter views, the gradient buffer", ("funcamp/train/_flat.py",)),
    ("optimizer: clip, AdamW, schedule", ("funcamp/optim/",)),
    ("select of a skipped step, counters, metrics, donation", ("funcamp/train/", "funcamp/loss_scale.py")),
    ("differentiation: inputs detached for torch.autograd.grad", ("funcamp/grad.py",)),
    ("no stack trace (Dynamo: autograd switches; post-grad: funcamp's graph passes)", ("(no stack trace)",)),
)


def categorize(origins: dict[str, int]) -> dict[str, int]:
    """``origins`` (origin -> nodes) summed by :data:`CATEGORIES` (``other`` for the rest)."""
    out: collections.Counter = collections.Counter()
    for origin, n in origins.items():
        label = next((lab for lab, prefixes in CATEGORIES if origin.startswith(prefixes)), "other")
        out[label] += n
    return dict(out)


def totals(run: dict[str, Any], parts: tuple[str, ...] | None = None) -> dict[str, int]:
    """The table's figures of one run, over the graphs of ``parts`` (all when None)."""

    def mine(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [r for r in records if parts is None or r.get("part") in parts]

    dynamo, aot, code, post = mine(run["dynamo"]), mine(run["aot"]), mine(run["code"]), mine(run["post_grad"])
    traced = {part: sum(files.values()) for part, files in run["traced_instructions"].items()}
    out = {
        "traced_instructions": sum(n for part, n in traced.items() if parts is None or part in parts),
        "inlined_calls": sum(n for part, n in run["inlined_calls"].items() if parts is None or part in parts),
        "dynamo_graphs": len(dynamo),
        "dynamo_nodes": sum(r["nodes"] for r in dynamo),
    }
    for kind in ("forward", "backward", "inference"):
        out[f"aot_{kind}"] = sum(r["nodes"] for r in aot if r["kind"] == kind)
    out["aot_nodes"] = sum(r["nodes"] for r in aot)
    out["post_grad_nodes"] = sum(r["nodes"] for r in post)
    for key in ("kernels", "cpp_lines", "extern_calls", "wrapper_lines"):
        out[key] = sum(r[key] for r in code)
    return out


def _counter(records: list[dict[str, Any]], field: str) -> collections.Counter:
    total: collections.Counter = collections.Counter()
    for r in records:
        total.update(r[field])
    return total


def report(model: str, runs: dict[str, dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    """Print the table and the attributions; return the summary written to the JSON."""
    columns: dict[str, dict[str, int]] = {}
    if "torch" in runs:
        columns["torch.compile(model) fwd+bwd"] = totals(runs["torch"], ("model",))
        columns["+ compiled AdamW step"] = totals(runs["torch"])
    for v in ("funcamp", "funcamp_pure"):
        if v in runs:
            columns[f"{v} step"] = totals(runs[v])
    names = list(columns)
    print(f"\n## {model}: {MODELS[model][1]}" + (f", {args.layers} layers" if args.layers else ""))
    for v, run in runs.items():
        if run.get("plan"):
            print(f"{v}: {run['plan']}")
    ratio = "+ compiled AdamW step" in columns and any(n.startswith("funcamp") for n in names)
    header = ["phase", *names] + (
        [f"{n.split()[0]} / torch" for n in names if n.startswith("funcamp")] if ratio else []
    )
    print("\n| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for key, label in ROWS:
        cells = [f"{columns[n][key]:,}" for n in names]
        if ratio:
            ref = columns["+ compiled AdamW step"][key]
            cells += [f"{columns[n][key] / ref:.2f}x" if ref else "-" for n in names if n.startswith("funcamp")]
        print(f"| {label} | " + " | ".join(cells) + " |")
    summary: dict[str, Any] = {"columns": columns}
    funcamps = [v for v in ("funcamp", "funcamp_pure") if v in runs]
    for phase in ("dynamo", "post_grad"):
        table: dict[str, dict[str, int]] = {}
        if "torch" in runs:
            for part, label in (
                ("model", "model: forward, backward, loss"),
                ("optimizer", "optimizer: clip, AdamW, schedule"),
            ):
                table.setdefault(label, {})["torch"] = sum(
                    r["nodes"] for r in runs["torch"][phase] if r["part"] == part
                )
        for v in funcamps:
            for label, n in categorize(_counter(runs[v][phase], "origins")).items():
                table.setdefault(label, {})[v] = n
        cols = (["torch"] if "torch" in runs else []) + funcamps
        print(f"\n{phase.replace('_', '-')} graph nodes by what they are for (funcamp: by origin, torch: by part)")
        print("\n| what | " + " | ".join(cols) + " |")
        print("|---|" + "---:|" * len(cols))
        for label, _ in (*CATEGORIES, ("other", ())):
            if label in table:
                print(f"| {label} | " + " | ".join(f"{table[label].get(c, 0):,}" for c in cols) + " |")
        summary[f"{phase}_by_category"] = table
    for v in ("funcamp", "funcamp_pure"):
        if v not in runs:
            continue
        by_file: collections.Counter = collections.Counter()
        by_function: collections.Counter = collections.Counter()
        for functions in runs[v]["traced_instructions"].values():
            by_function.update(functions)
            for name, n in functions.items():
                by_file[name.rsplit(":", 1)[0]] += n
        print(f"\n{v}: bytecode instructions Dynamo traced, by file, top {args.top}")
        for path, n in by_file.most_common(args.top):
            print(f"  {n:7d}  {path}")
        print(f"\n{v}: bytecode instructions Dynamo traced, by function, top {args.top}")
        for name, n in by_function.most_common(args.top):
            print(f"  {n:7d}  {name}")
        summary[f"{v}_traced_by_file"] = dict(by_file)
        summary[f"{v}_traced_by_function"] = dict(by_function)
        for phase in ("dynamo", "post_grad"):
            origins = _counter(runs[v][phase], "origins")
            where = phase.replace("_", "-")
            print(f"\n{v}: {where} graph nodes by origin (innermost frame outside torch), top {args.top}")
            for origin, n in origins.most_common(args.top):
                print(f"  {n:6d}  {origin}")
            summary[f"{v}_{phase}_origins"] = dict(origins)
        if "torch" in runs:
            ours, theirs = _counter(runs[v]["post_grad"], "targets"), _counter(runs["torch"]["post_grad"], "targets")
            diff = {t: ours[t] - theirs[t] for t in set(ours) | set(theirs) if ours[t] != theirs[t]}
            ranked = sorted(diff.items(), key=lambda kv: -abs(kv[1]))[: args.top]
            print(f"\n{v} minus torch (+ AdamW step): post-grad operators, top {args.top} by difference")
            for target, d in ranked:
                print(f"  {d:+6d}  {target} ({ours[target]} vs {theirs[target]})")
            summary[f"{v}_minus_torch_post_grad_targets"] = diff
    return summary


def machine() -> dict[str, Any]:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform()}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.run:
        result = run_one(args)
        Path(args.out).write_text(json.dumps(result))
        return
    if args.summarize:
        saved = json.loads(Path(args.summarize).read_text())
        runs = saved["runs"]
        first = next(iter(runs.values()))
        args.layers = first.get("layers")
        report(first["model"], runs, args)
        return
    for model in args.models:
        runs = {}
        for v in args.variants:
            t0 = time.perf_counter()
            runs[v] = spawn(v, model, args)
            print(f"{model} {v}: {time.perf_counter() - t0:.0f} s (loaded or not: only the counts matter)", flush=True)
        summary = report(model, runs, args)
        name = model + (f"_{args.layers}L" if args.layers else "") + args.tag
        path = Path(args.json_dir) / f"bench_graph_size_{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(
            json.dumps(
                {
                    "command": "python benchmarks/bench_graph_size.py "
                    + " ".join(argv if argv is not None else sys.argv[1:]),
                    "machine": machine(),
                    "summary": summary,
                    "runs": runs,
                },
                indent=1,
            )
            + "\n"
        )
        print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
