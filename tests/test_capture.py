"""funcamp.capture: what CUDA-graph capture forbids is found on the CPU; the wrapper falls back in one message.

The check traces steps with make_fx over fake tensors (nothing computed, nothing compiled). Each planted fault
(a ``.item()`` in the loss, a CPU counter in a device state, ``torch.nonzero``, a host-side RNG call, an explicit
generator, a Python branch on a value, a CPU constant, telemetry's ``torch.cond``) must be reported with its kind
and its source line; the main job's GPT step (bf16 compute, DynamicLossScale, clip + AdamW on a warmup-cosine
schedule, dropout) must pass, and so must a NoOpLossScale step (its constant 1.0 used to be made on the CPU).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import funcamp as fa
from funcamp import _scope, capture, optim

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the differential tester's configurations

from gpt import GPT, config_for  # noqa: E402

OPT = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(optim.warmup_cosine_decay(1e-3, warmup=2, total=10)))
PARAMS = {"w": torch.randn(4, 3), "b": torch.zeros(3)}
BATCH = {"x": torch.randn(8, 4), "y": torch.randn(8, 3)}
THIS = Path(__file__).name


def mse(p, b):
    return ((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2).mean()


def state(loss_scale=None):
    return fa.TrainState.create(PARAMS, OPT, loss_scale=loss_scale or fa.DynamicLossScale(2.0**15))


def report_for(loss_fn, **kwargs):
    step = fa.make_train_step(loss_fn, OPT, compile=False, **kwargs)
    return capture.check(step, state(), BATCH)


def test_main_job_gpt_step_is_capturable():
    """The main job's step, traced for a device: nothing capture forbids; dropout's draws are counted."""
    model = GPT(config_for("tiny", dropout=0.1))
    apply_fn, params = fa.nn.functionalize(model, "params=float32,compute=bfloat16,output=float32")

    def loss_fn(p, b):
        return F.cross_entropy(apply_fn(p, b["inputs"]).flatten(0, 1), b["targets"].flatten())

    opt = optim.chain(
        optim.clip_by_global_norm(1.0), optim.adamw(optim.warmup_cosine_decay(3e-4, 10, 100), weight_decay=0.1)
    )
    st = fa.TrainState.create(params, opt, loss_scale=fa.DynamicLossScale(2.0**15))
    tokens = torch.randint(0, 256, (4, 33))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    report = capture.check(fa.make_train_step(loss_fn, opt, compile=False), st, batch)
    assert report.ok, str(report)
    assert report.random_ops > 0  # dropout was traced (from the default generator: graph-safe)
    assert str(report).startswith("capturable")


def test_noop_loss_scale_and_stateless_rate_are_made_on_the_device():
    """NoOpLossScale's 1.0 and a stateless optimizer's NaN rate: made on the step's device, not copied in."""
    assert capture.check(fa.make_train_step(mse, OPT, compile=False), state(fa.NoOpLossScale()), BATCH).ok
    sgd = optim.scale(-0.1)  # no learning-rate state: the NaN rate
    st = fa.TrainState.create(PARAMS, sgd)
    assert capture.check(fa.make_train_step(mse, sgd, compile=False), st, BATCH).ok


@pytest.mark.parametrize("wrap", ["stochastic_rounding", "kahan_summation"])
def test_bf16_master_steps_are_capturable(wrap):
    """Stochastic rounding draws from a counter-based hash (no generator, no RNG state): nothing to object to."""
    params = {k: v.bfloat16() for k, v in PARAMS.items()}
    opt = getattr(optim, wrap)(optim.adamw(1e-3), **({"seed": 0} if wrap == "stochastic_rounding" else {}))

    def loss_fn(p, b):
        return ((b["x"].bfloat16() @ p["w"] + p["b"] - b["y"].bfloat16()) ** 2).float().mean()

    report = capture.check(fa.make_train_step(loss_fn, opt, compile=False), fa.TrainState.create(params, opt), BATCH)
    assert report.ok and report.random_ops == 0, str(report)


PLANTED = {
    "host sync": lambda p, b: mse(p, b) * (1 + 0 * mse(p, b).detach().item()),
    "data-dependent shape": lambda p, b: mse(p, b) + 0.0 * torch.nonzero(b["x"] > 0).float().sum(),
    "rng state": lambda p, b: (torch.manual_seed(0), mse(p, b))[1],
    "generator": lambda p, b: mse(p, b) + 0 * torch.rand(3, generator=torch.Generator(), device=b["x"].device).sum(),
    "host branch": lambda p, b: mse(p, b) if mse(p, b) > 0 else -mse(p, b),
    "cpu tensor": lambda p, b: mse(p, b) * torch.tensor(2.0),
}


@pytest.mark.parametrize("kind", sorted(PLANTED))
def test_planted_violation_is_found_with_its_line(kind):
    report = report_for(PLANTED[kind])
    assert not report.ok
    assert kind in report.kinds(), str(report)
    assert any(v.kind == kind and THIS in v.where for v in report.violations), str(report)


def test_cuda_rng_state_read_is_found():
    report = report_for(lambda p, b: (torch.cuda.get_rng_state(), mse(p, b))[1])
    assert any(v.kind == "rng state" and v.op == "torch.cuda.get_rng_state" for v in report.violations), str(report)


def test_cpu_counter_in_a_device_state_is_found_by_path():
    st = state()
    report = capture.check(fa.make_train_step(mse, OPT, compile=False), st, BATCH, keep_on_host=[st.step])
    assert capture.Violation("cpu tensor", "input", "args[0].step") in report.violations, str(report)


def test_check_leaves_torch_as_it_was():
    """The check swaps torch's default generator (for torch.random's functions) only while it traces, and never
    sets torch's compiling flag: after it, the generator is torch's own and Dynamo still folds is_compiling() in
    a compiled function."""
    assert "rng state" in report_for(PLANTED["rng state"]).kinds()
    assert torch.random.default_generator is torch.default_generator and not torch.compiler.is_compiling()
    fn = torch.compile(lambda x: x + 1 if torch.compiler.is_compiling() else x, fullgraph=True, backend="eager")
    assert float(fn(torch.zeros(()))) == 1.0


def _seen_by(seen):
    def loss_fn(p, b):
        seen.append((torch.compiler.is_compiling(), _scope.compiling(), _scope.step_plan()))
        return mse(p, b)

    return loss_fn


@pytest.mark.parametrize("compile", [False, True], ids=["eager-built", "compile-built"])
def test_check_traces_the_body_under_its_plan_made_compiled(compile):
    """A step is traced as it is built compiled: its body within its plan with ``compiled=True`` (funcamp's
    question, ``_scope.compiling()``, answers True), torch's own flag untouched, the step's own plan unchanged;
    its host-side checks run on the given arguments (swapped ones are refused as a call refuses them). Planted:
    tracing within ``step.plan`` as it is (eager) fails the first assertion for the eager-built step."""
    seen = []
    step = fa.make_train_step(_seen_by(seen), OPT, compile=compile)
    assert capture.check(step, state(), BATCH).ok
    assert seen and all(not flag and ours and plan.compiled for flag, ours, plan in seen), seen
    assert step.plan.compiled is compile
    with pytest.raises(TypeError, match="arguments are swapped"):
        capture.check(step, BATCH, state())
    with pytest.raises(TypeError, match="checked as check\\(step, state, batch\\)"):
        capture.check(step, state())


def test_check_traces_another_callable_as_a_compiled_body():
    """A callable that is not a ``Step`` is traced as the body of a compiled step: the funcamp code it calls (here
    an eager-built step's body and the step itself) takes the compiled branches."""
    seen = []
    step = fa.make_train_step(_seen_by(seen), OPT, compile=False)
    assert capture.check(lambda s, b: step.body(s, b), state(), BATCH).ok
    assert capture.check(lambda s, b: step(s, b), state(), BATCH).ok
    assert len(seen) == 2 and all(not flag and ours for flag, ours, _ in seen), seen


def test_telemetry_cond_is_found():
    """Telemetry's every-N-steps ``torch.cond``: inductor reads its predicate on the host."""
    report = report_for(mse, telemetry=2)
    assert report.kinds() == {"cond"}, str(report)


# --- no false positive on the steps capture is for; planted violations at the user's line (issue 40, item 3) ----

#: The differential tester's features, several per configuration (each traced once): every optimizer form and
#: wrapper, loss scales, micro-batches, LossSum totals in half precision, aux aliasing the state, BatchNorm
#: buffers, frozen and int8 storage, fp8 recipes, remat budgets, donation, the skip limit.
DIFFERENTIAL = {
    "bf16 masters, groups, int8, remat 0.5, donated": dict(
        compute="bfloat16", params="bfloat16", loss_scale=("dynamic", 15, 2),
        opt=("sr", ("multi", ("adam", ("cosine", 1e-2)), ("sgd", 0.1, 0.9, True), True)), k=2, loss="sum_half",
        aux="nested", frozen=True, int8=True, remat=0.5, donate=True, skips=2,
    ),
    "f16, clip + masked lion, batchnorm, fp8 delayed, remat 0, donated": dict(
        compute="float16", loss_scale=("static", 8), opt=("clip", 1.0, ("masked", ("lion", 1e-3))),
        batchnorm=True, aux="buffer", fp8="delayed", remat=0.0, donate=True,
    ),
    "f32, set_to_zero group, fp8 tensorwise, LossSum, remat 1": dict(
        opt=("zero_frozen", ("adamw", ("warmup", 1e-2), 0.1)), loss="sum", fp8="tensorwise", remat=1.0,
    ),
    "bf16 masters, kahan over a chain, fp8 rowwise, a view in aux": dict(
        compute="bfloat16", params="bfloat16", opt=("kahan", ("chain", ("sgd", 0.0, None, False), ("adam", 1e-2))),
        fp8="rowwise", aux="view",
    ),
}  # fmt: skip


def _differential_report(fields: dict) -> capture.CaptureReport:
    import _differential as diff

    cfg = diff.Config(**fields)
    diff.validate(cfg)
    built = diff.build(cfg)
    step = fa.make_train_step(
        built.loss_fn, diff.build_optimizer(cfg.opt, built.params), has_aux=cfg.aux is not None,
        accumulation_steps=cfg.k, max_consecutive_skips=cfg.skips, compile=False, donate=cfg.donate,
    )  # fmt: skip
    return capture.check(step, diff.fresh_state(cfg, built), built.batches[0])


@pytest.mark.parametrize("name", list(DIFFERENTIAL))
def test_no_false_positive_on_the_differential_testers_configurations(name):
    """Sweep: the differential tester's steps are capturable (before: fp8 asked autocast about the stand-in device,
    ``donate=True`` saw every stand-in share storage, frozen and int8 weights were not fake tensors, an unused
    group's counter made by the first call's host-side check was a CPU tensor in the step)."""
    report = _differential_report(DIFFERENTIAL[name])
    assert report.ok, str(report)


GPT_STEPS = {
    "bf16 compute, softmax, scan, donated": dict(policy="params=float32,compute=bfloat16,output=float32",
                                                 scan="blocks", donate=True),
    "autocast": dict(policy="params=float32,compute=bfloat16,output=float32", autocast=True),
}  # fmt: skip


@pytest.mark.parametrize("name", list(GPT_STEPS))
def test_no_false_positive_on_scanned_donated_and_autocast_gpt_steps(name):
    """The main job's GPT (its attention's softmax under the bfloat16 op policy), scanned and donated (the step
    capture.cuda_graph requires), and under autocast. Before: "unknown device type for autocast", "share
    storage", and under scan= "Unsupported functorch tracing attempt" (the check's compiling flag made the layers
    scan while the step differentiated with torch.func; it differentiates as the compiled step does now)."""
    kwargs = dict(GPT_STEPS[name])
    policy, donate = kwargs.pop("policy"), kwargs.pop("donate", False)
    apply_fn, params = fa.nn.functionalize(GPT(config_for("tiny", dropout=0.1)), policy, **kwargs)

    def loss_fn(p, b):
        return F.cross_entropy(apply_fn(p, b["inputs"]).flatten(0, 1), b["targets"].flatten())

    opt = optim.adamw(1e-3)
    st = fa.TrainState.create(params, opt, loss_scale=fa.DynamicLossScale(2.0**15))
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(0))
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    report = capture.check(fa.make_train_step(loss_fn, opt, compile=False, donate=donate), st, batch)
    assert report.ok, str(report)
    if "scan" in kwargs:
        assert any("scan" in str(n.target) for n in report.graph.graph.nodes)


#: A violation planted in a module's forward, each on a line of its own: (kind, h -> h).
IN_FORWARD = {
    "item": ("host sync", lambda h: h * (1 + 0 * h.sum().item())),
    "tolist": ("host sync", lambda h: h + 0 * sum(h[0].tolist())),
    "numpy": ("host sync", lambda h: h + 0 * float(h.sum().detach().numpy())),
    "nonzero": ("data-dependent shape", lambda h: h + 0.0 * torch.nonzero(h > 0).float().sum()),
    "manual_seed": ("rng state", lambda h: (torch.manual_seed(0), h)[1]),
    "generator": ("generator", lambda h: h + 0 * torch.rand(h.shape, generator=torch.Generator(), device=h.device)),
    "branch": ("host branch", lambda h: h if h.sum() > 0 else -h),
    "constant": ("cpu tensor", lambda h: h * torch.tensor(2.0)),
    "arange": ("cpu tensor", lambda h: h + torch.arange(h.shape[-1])),
}


class Planted(torch.nn.Module):
    def __init__(self, plant):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.plant = torch.nn.Linear(4, 3), plant

    def forward(self, x):
        return torch.softmax(self.plant(self.lin(x)), dim=-1)


@pytest.mark.parametrize("policy", ["float32", "params=float32,compute=bfloat16,output=float32"], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", list(IN_FORWARD))
def test_planted_violation_in_a_module_is_found_at_its_line(name, policy):
    """Sweep: each violation planted in a module's forward is found with its kind at the planted line, in float32
    and under a half compute policy (whose op-policy mode is a frame of every op: before, the violation was placed
    at funcamp/ops.py's __torch_function__). Before, ``.tolist()``, ``.numpy()`` and ``torch.arange`` without a
    device raised instead of being reported."""
    kind, plant = IN_FORWARD[name]
    apply_fn, params = fa.nn.functionalize(Planted(plant), policy)
    opt = optim.sgd(0.1)

    def loss_fn(p, b):
        return ((apply_fn(p, b["x"]) - b["y"]) ** 2).mean()

    report = capture.check(fa.make_train_step(loss_fn, opt, compile=False), fa.TrainState.create(params, opt), BATCH)
    line = f"{THIS}:{plant.__code__.co_firstlineno} in <lambda>"
    assert any(v.kind == kind and v.where == line for v in report.violations), str(report)


def test_check_refuses_a_non_callable():
    with pytest.raises(TypeError, match="fn must be callable"):
        capture.check(None, state(), BATCH)


# --- the wrapper, where no CUDA device is: one message, the step runs uncaptured -----------------------------


def test_cuda_graph_without_cuda_warns_once_and_runs_the_step():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA; tests/test_cuda.py covers the captured step")
    step = fa.make_train_step(mse, OPT, compile=False, donate=True)
    plain = fa.make_train_step(mse, OPT, compile=False)
    wrapped = capture.cuda_graph(step)
    ref = fa.TrainState.create({k: v.clone() for k, v in PARAMS.items()}, OPT, loss_scale=fa.DynamicLossScale(2.0**15))
    st = fa.TrainState.create({k: v.clone() for k, v in PARAMS.items()}, OPT, loss_scale=fa.DynamicLossScale(2.0**15))
    with pytest.warns(capture.CaptureWarning, match="CUDA is not available") as record:
        for _ in range(3):
            st, metrics = wrapped(st, BATCH)
            ref, ref_metrics = plain(ref, BATCH)
    assert len(record) == 1
    assert wrapped.reason is not None and not wrapped.captured and wrapped.replays == 0
    for k in PARAMS:
        torch.testing.assert_close(st.params[k], ref.params[k], rtol=0, atol=0)
    assert metrics["loss"].item() == ref_metrics["loss"].item()


def test_cuda_graph_refuses_bad_arguments():
    with pytest.raises(TypeError, match="step must be callable"):
        capture.cuda_graph(None)
    with pytest.raises(ValueError, match="warmup must be an int >= 1"):
        capture.cuda_graph(lambda s, b: (s, {}), warmup=0)
