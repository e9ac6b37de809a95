"""The compiled step's assembly (funcamp._dynamo_autograd.compile): each build compiles once and static, and
Dynamo's traced-autograd setting is on only while a compiled step runs.

Steps built one after another in one process (a notebook cell run again, a remat-budget or learning-rate
sweep) used to run one inner function of ``make_train_step``: the second build was a recompile of the first
one's frame, the third of a sweep crashed (no remat, ``Remat(budget=0)``, ``Remat(budget=0.5)``:
``AsPythonConstantNotImplementedError: SymNodeVariable() is not a constant``, the budget traced as a symbol by
automatic dynamic shapes) and a ninth would fail ``fullgraph=True`` at Dynamo's recompile limit. Here each
build of a sweep is compiled by a counting backend (aot_eager underneath), which records the compile id it
ran under, whether any graph input is symbolic, and Dynamo's setting while it traced.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import funcamp as fa
from funcamp import optim
from funcamp.nn import Remat


class Recorder:
    """A ``torch.compile`` backend: aot_eager, recording each graph's compile id, symbolic inputs and
    ``trace_autograd_ops`` at trace time."""

    def __init__(self) -> None:
        self.compiles: list[dict] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        from torch._dynamo.backends.debugging import aot_eager

        compile_id = torch._guards.CompileContext.current_compile_id()
        symbolic = [
            n.name
            for n in gm.graph.nodes
            if n.op == "placeholder" and _symbolic(n.meta.get("example_value", n.meta.get("val")))
        ]
        self.compiles.append(
            {
                "recompile": compile_id.frame_compile_id,
                "symbolic": symbolic,
                "trace_autograd_ops": torch._dynamo.config.trace_autograd_ops,
            }
        )
        return aot_eager(gm, example_inputs)


def _symbolic(value: object) -> bool:
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    if isinstance(value, torch.Tensor):
        return any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride()))
    return False


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Sequential(nn.Linear(8, 8), nn.Tanh()), nn.Linear(8, 2))


BATCH = (torch.randn(6, 4, generator=torch.Generator().manual_seed(1)), torch.randint(0, 2, (6,)))

#: The sweep, built in this order in one process: (remat budget or None, learning rate). Two builds suffice: on
#: the old code the second was a recompile of the first one's frame with the budget traced as a symbol.
SWEEP = [(0.0, 0.1), (0.5, 0.05)]
#: Dynamo's setting as the process had it before any step was built.
TRACE_AUTOGRAD_OPS = torch._dynamo.config.trace_autograd_ops


def _build(budget: float | None, lr: float, compile: bool, backend: object = None):
    remat = None if budget is None else Remat("1", budget=budget)
    apply_fn, params = fa.nn.functionalize(_model(), "float32", remat=remat)

    def loss_fn(p, batch):
        x, y = batch
        return nn.functional.cross_entropy(apply_fn(p, x), y)

    opt = optim.sgd(lr)
    state = fa.TrainState.create(params, opt)
    if compile:
        return state, fa.make_train_step(loss_fn, opt, backend=backend)
    return state, fa.make_train_step(loss_fn, opt, compile=False)


@pytest.fixture(scope="module")
def sweep():
    """Each build of :data:`SWEEP` (all kept alive, as a notebook keeps them), called twice, with its recorder."""
    torch._dynamo.reset()
    built = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fa.nn.RematBudgetWarning)
        for budget, lr in SWEEP:
            recorder = Recorder()
            state, step = _build(budget, lr, compile=True, backend=recorder)
            first, _ = step(state, BATCH)
            with torch._dynamo.config.patch(error_on_recompile=True):
                second, _ = step(first, BATCH)
            eager_state, eager_step = _build(budget, lr, compile=False)
            expected = eager_step(eager_step(eager_state, BATCH)[0], BATCH)[0]
            built.append((step, recorder, second, expected))
    return built


@pytest.mark.parametrize("i", range(len(SWEEP)), ids=[f"remat={b},lr={lr}" for b, lr in SWEEP])
def test_each_build_of_a_sweep_compiles_once_static_and_equals_its_eager_step(sweep, i):
    """Sweep: builds differing in remat, in the budget and in the learning rate, one process. Each is the first
    compile of a frame of its own (compile id ``[n/0]``: not a recompile of an earlier build), with no
    symbolic graph input, one graph for two calls; its state after two steps equals its eager step's (float32
    round-off: aot_eager). On the old code the second build was a recompile of the first and crashed (the
    budget a symbol)."""
    _, recorder, got, expected = sweep[i]
    assert [c["recompile"] for c in recorder.compiles] == [0], recorder.compiles
    assert recorder.compiles[0]["symbolic"] == []
    for name in expected.params:
        torch.testing.assert_close(got.params[name], expected.params[name], rtol=1e-5, atol=1e-6)
    assert int(got.step) == 2


def test_trace_autograd_ops_is_on_only_while_a_compiled_step_traces(sweep):
    """Dynamo's ``trace_autograd_ops`` (the compiled step's route) was on while each step traced and is back to
    its default after the steps were built and called: another ``torch.compile`` in the process keeps
    Dynamo's default."""
    assert all(c["trace_autograd_ops"] for _, recorder, _, _ in sweep for c in recorder.compiles)
    assert TRACE_AUTOGRAD_OPS is False
    assert torch._dynamo.config.trace_autograd_ops is False


def test_an_inductor_step_probes_the_cpus_instruction_sets_in_a_thread(monkeypatch):
    """The first call of a step built for inductor starts inductor's probe of the CPU's vector instruction sets on
    a thread of its own (8.5 s of the main job's first step on a cold cache, run while Dynamo traces), once per
    process; building it starts nothing (a compile cache may be loaded before the first call), nor does another
    backend, and a probe already answered is not started again. (Planted: the call in ``compile`` removed:
    nothing runs on the thread; the probe started when the step is built: the first assertion fails.)"""
    import functools
    import threading

    from torch._inductor import cpu_vec_isa

    from funcamp import _dynamo_autograd

    ran_on: list[str] = []
    real = cpu_vec_isa.valid_vec_isa_list

    @functools.cache
    def recording_probe() -> list:
        ran_on.append(threading.current_thread().name)
        return real()

    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", recording_probe)
    _dynamo_autograd.probe_cpu_isas.cache_clear()
    try:
        model = nn.Linear(3, 2)
        apply, params = fa.nn.functionalize(model, "params=float32,compute=float32,output=float32")
        state = fa.TrainState.create(params, optim.sgd(0.1))

        def loss_fn(p, batch):
            return apply(p, batch).square().mean()

        step = fa.make_train_step(loss_fn, optim.sgd(0.1))  # inductor
        assert not _dynamo_autograd.probe_cpu_isas.cache_info().currsize and ran_on == []
        with pytest.raises(TypeError):  # a bad batch: raised while tracing, before inductor compiles anything
            step(state, None)
        _dynamo_autograd.wait_for_cpu_isa_probe()
        assert ran_on == ["funcamp-cpu-isa-probe"], ran_on
        with pytest.raises(TypeError):
            step(state, None)
        assert ran_on == ["funcamp-cpu-isa-probe"], ran_on  # once per process
        _dynamo_autograd.probe_cpu_isas.cache_clear()
        with pytest.raises(TypeError):
            fa.make_train_step(loss_fn, optim.sgd(0.1), backend="aot_eager")(state, None)
        assert not _dynamo_autograd.probe_cpu_isas.cache_info().currsize  # another backend: nothing
        assert _dynamo_autograd.probe_cpu_isas() is None  # answered already (cached): nothing started
    finally:
        _dynamo_autograd.probe_cpu_isas.cache_clear()


@pytest.mark.parametrize("fx_cache", ["off", "empty", "holds graphs"])
def test_inductor_generates_code_only_after_the_probe_is_done(monkeypatch, tmp_path, fx_cache):
    """Inductor's instruction-set objects change their compiler flags while they check (bfloat16 support), so
    inductor must not ask them while the probe's thread runs: where its FX graph cache may hold the graph, before
    its inner compile (a hit loads kernels, which asks them), else before the scheduler fuses, after the lowering.
    (Planted: the pre-fusion pass not waiting: with the cache off or empty the kernels are generated first;
    ``_fx_cache_may_hit`` always False: with graphs in the cache the inner compile starts first.)"""
    import functools
    import threading
    import time

    from torch._inductor import compile_fx as inductor_compile_fx
    from torch._inductor import config as inductor_config
    from torch._inductor import cpu_vec_isa
    from torch._inductor.codegen import cpp

    from funcamp import _dynamo_autograd

    order: list[str] = []
    real, real_inner, real_codegen = cpu_vec_isa.valid_vec_isa_list, inductor_compile_fx.compile_fx_inner, None
    real_codegen = cpp.CppScheduling.codegen_node

    @functools.cache
    def slow_probe() -> list:
        if threading.current_thread().name == "funcamp-cpu-isa-probe":
            time.sleep(1.0)
            order.append("probe")
        return real()

    def inner(*args, **kwargs):
        order.append("inner compile")
        return real_inner(*args, **kwargs)

    def codegen(self, node):
        order.append("codegen")
        return real_codegen(self, node)

    monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", slow_probe)
    monkeypatch.setattr(inductor_compile_fx, "compile_fx_inner", inner)
    monkeypatch.setattr(cpp.CppScheduling, "codegen_node", codegen)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(inductor_config, "fx_graph_cache", fx_cache != "off")
    monkeypatch.setattr(inductor_config, "fx_graph_remote_cache", False)
    if fx_cache == "holds graphs":
        (tmp_path / "fxgraph" / "xx").mkdir(parents=True)
    _dynamo_autograd.probe_cpu_isas.cache_clear()
    torch._dynamo.reset()
    try:
        fn = _dynamo_autograd.compile(lambda x: (x * 2).sum(), backend="inductor", fullgraph=True)
        assert float(fn(torch.arange(4.0))) == 12.0
        assert order.index("probe") < order.index("codegen"), order
        if fx_cache == "holds graphs":
            assert order.index("probe") < order.index("inner compile"), order
    finally:
        _dynamo_autograd.probe_cpu_isas.cache_clear()


def test_the_probe_thread_imports_nothing(tmp_path):
    """The probe's thread must import no module (an import on it while Dynamo imports on the main thread broke
    Dynamo's: ``ModuleNotFoundError`` for a module that exists): ``probe_cpu_isas`` imports what the probe needs
    first. In a fresh process on an empty inductor cache (the probe builds every program): no module appears
    while it runs. (Planted: without the imports, setuptools, distutils and torch.utils.cpp_extension appear.)"""
    import os
    import subprocess
    import sys

    code = (
        "import sys, funcamp\n"
        "from funcamp import _dynamo_autograd as d\n"
        "before = set(sys.modules)\n"
        "thread = d.probe_cpu_isas()\n"
        "mid = set(sys.modules)\n"
        "thread.join()\n"
        "print(sorted(set(sys.modules) - mid))\n"
    )
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_a_graph_from_aotautograds_cache_is_loaded_only_after_the_probe_is_done(monkeypatch, tmp_path):
    """A warm start (the graph compiled before in this cache directory, or put there by a compile cache): a hit
    in AOTAutograd's cache loads inductor's compiled graph without its inner compile or its scheduler, so neither
    of the probe's waits runs, and loading the kernels asks the instruction sets on the main thread while the
    probe's thread asks them too. Nothing of inductor may ask them until the probe is done."""
    import functools
    import threading
    import time

    from torch._inductor import config as inductor_config
    from torch._inductor import cpu_vec_isa

    from funcamp import _dynamo_autograd

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(inductor_config, "fx_graph_cache", True)
    monkeypatch.setattr(inductor_config, "fx_graph_remote_cache", False)
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", True)

    def build():
        return _dynamo_autograd.compile(lambda x: (x * 2).sum(), backend="inductor", fullgraph=True)

    torch._dynamo.reset()
    try:
        assert float(build()(torch.arange(4.0))) == 12.0  # fills the caches
        _dynamo_autograd.wait_for_cpu_isa_probe()
        order: list[str] = []
        real, real_pick = cpu_vec_isa.valid_vec_isa_list, cpu_vec_isa.pick_vec_isa

        @functools.cache
        def slow_probe() -> list:  # a process that has not probed yet
            if threading.current_thread().name == "funcamp-cpu-isa-probe":
                time.sleep(1.0)
                order.append("probe")
            return real()

        def asked() -> list:
            if threading.current_thread().name != "funcamp-cpu-isa-probe":
                order.append("asked on the main thread")
            return slow_probe()

        asked.cache_info = slow_probe.cache_info  # probe_cpu_isas reads whether the answer is cached

        def pick(*args, **kwargs):
            if threading.current_thread().name != "funcamp-cpu-isa-probe":
                order.append("asked on the main thread")
            return real_pick(*args, **kwargs)

        monkeypatch.setattr(cpu_vec_isa, "valid_vec_isa_list", asked)
        monkeypatch.setattr(cpu_vec_isa, "pick_vec_isa", pick)
        _dynamo_autograd.probe_cpu_isas.cache_clear()
        torch._dynamo.reset()
        assert float(build()(torch.arange(4.0))) == 12.0
        _dynamo_autograd.wait_for_cpu_isa_probe()
        assert "probe" in order and "asked on the main thread" in order, order  # a cache hit that loads kernels
        assert order.index("probe") < order.index("asked on the main thread"), order
    finally:
        _dynamo_autograd.probe_cpu_isas.cache_clear()
        torch._dynamo.reset()


def test_a_plain_pre_fusion_pass_given_keeps_inductors_cache_away(monkeypatch, tmp_path):
    """A ``_pre_fusion_custom_pass`` given as a plain callable (no ``uuid``): inductor bypasses its FX graph cache
    for it, as torch.compile does; funcamp's wait wrapped around it must not make it cacheable under a key that
    leaves the callable out (a second callable would then be skipped: the graph of the first loaded)."""
    from torch._inductor import config as inductor_config

    from funcamp import _dynamo_autograd

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(inductor_config, "fx_graph_cache", True)
    monkeypatch.setattr(inductor_config, "fx_graph_remote_cache", False)
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", True)
    ran: list[str] = []

    def passes(name):
        def run(nodes):
            ran.append(name)
            return nodes

        return run

    try:
        for name in ("first", "second"):
            torch._dynamo.reset()
            options = {"_pre_fusion_custom_pass": passes(name)}
            fn = _dynamo_autograd.compile(lambda x: (x * 2).sum(), backend="inductor", fullgraph=True, options=options)
            assert float(fn(torch.arange(4.0))) == 12.0
        assert ran == ["first", "second"], ran
    finally:
        _dynamo_autograd.wait_for_cpu_isa_probe()
        torch._dynamo.reset()
