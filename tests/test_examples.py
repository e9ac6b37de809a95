"""The examples run: train_gpt.py for a few steps on tiny settings, amp_basics.py's numbers.

train_gpt.py is imported and its ``main(argv)`` called (it returns the final state and the logged
history); one test runs each script as a user would, from the repository root.
"""

from __future__ import annotations

import contextlib
import io
import math
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import funcamp as fa
from funcamp import checkpoint, optim

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import amp_basics  # noqa: E402
import gan  # noqa: E402
import train_gpt  # noqa: E402

TINY = ["--model", "tiny", "--batch-size", "4", "--quiet", "--sample-bytes", "0", "--eval-batches", "2"]


@pytest.fixture(scope="module", autouse=True)
def auto_policy_cache(tmp_path_factory):
    """--policy auto's decisions go to a directory of this module's (not ~/.cache); the runs share it, as the
    runs of one machine do, so that a run and its --resume take the same dtype."""
    with pytest.MonkeyPatch.context() as mp:
        directory = tmp_path_factory.mktemp("funcamp-cache")
        mp.setenv("FUNCAMP_CACHE_DIR", str(directory))
        yield directory / "tune"


F16 = "params=float32,compute=float16,output=float32"


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _assert_params_finite(state: fa.TrainState) -> None:
    for name, p in state.params.items():
        assert torch.isfinite(p).all(), name


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The default policy (CPU: --policy auto's compute dtype, no loss scale), compiled with aot_eager, 6 steps."""
    torch._dynamo.reset()  # a fresh recompile budget for make_train_step's step, whatever ran before
    logdir = tmp_path_factory.mktemp("default")
    argv = [*TINY, "--steps", "6", "--log-every", "2", "--eval-every", "3", "--save-every", "3"]
    argv += ["--backend", "aot_eager", "--logdir", str(logdir), "--sample-bytes", "20"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        results = train_gpt.main(argv)
    return {**results, "stdout": out.getvalue()}, logdir


def test_end_of_run_lines_name_the_mode_and_the_readme_command(default_run, tmp_path, capsys):
    compiled_out = default_run[0]["stdout"]
    assert "step 0: val loss" in compiled_out and "after compile: " in compiled_out
    # The README's command, the same in both modes.
    assert f"TensorBoard: python3 -m tensorboard.main --logdir {default_run[1]}" in compiled_out
    assert re.search(r"[\d,]+ tokens/s", compiled_out) and "nan" not in compiled_out.lower()
    one_step = train_gpt.main([*TINY, "--steps", "1", "--no-compile", "--logdir", str(tmp_path)])
    eager_out = capsys.readouterr().out
    assert "after compile" not in eager_out and "(eager: " in eager_out
    assert "TensorBoard: python3 -m tensorboard.main --logdir" in eager_out
    # One step: the first is not timed (it compiles), so there is no rate to print; it says so, not "nan".
    assert "nan" not in eager_out.lower() and "tokens/s not measured" in eager_out, eager_out
    assert one_step["tokens_per_second"] is None
    # The allocator line: kept by default on a CPU under glibc (the job's own setting), as it comes when asked.
    kept = "allocator: freed memory kept (mallopt" if sys.platform.startswith("linux") else "allocator: as it comes"
    assert kept in compiled_out, compiled_out
    train_gpt.main([*TINY, "--steps", "1", "--no-compile", "--no-keep-freed-memory", "--logdir", str(tmp_path / "a")])
    assert "allocator: as it comes" in capsys.readouterr().out


def test_default_run_logs_every_tag_once_per_interval(default_run):
    results, logdir = default_run
    # --policy auto: the dtype choose_compute_dtype found (float32 on AVX2-only CPUs at once; measured elsewhere)
    compute = str(results["policy_choice"].dtype).removeprefix("torch.")
    assert results["policy"] == f"params=float32,compute={compute},output=float32"
    assert f"policy auto: {compute} compute on CPU (" in results["stdout"]
    scalars = _scalars(logdir)
    for tag in (
        "amp/loss_scale",
        "amp/grads_finite",
        "amp/skipped_steps",
        "train/loss",
        "train/grad_norm",
        "train/learning_rate",
        "perf/tokens_per_second",
    ):
        assert [step for step, _ in scalars[tag]] == [2, 4, 6], tag
    assert [step for step, _ in scalars["val/loss"]] == [0, 3, 6]  # step 0: the untrained model, as the README quotes
    assert scalars["val/loss"][0][1] == pytest.approx(math.log(256), abs=0.3)
    assert [v for _, v in scalars["amp/loss_scale"]] == [1.0, 1.0, 1.0]  # NoOpLossScale with bf16
    assert all(v == 1.0 for _, v in scalars["amp/grads_finite"])
    lrs = [v for _, v in scalars["train/learning_rate"]]
    assert lrs[0] > 0 and lrs[-1] < lrs[1]  # warmup, then cosine decay
    assert scalars["val/loss"][-1][1] == pytest.approx(results["val_loss"])


def test_default_run_learns_and_samples(default_run):
    results, _ = default_run
    losses = [v for _, v in results["history"]["train_loss"]]
    assert losses[0] == pytest.approx(math.log(256), abs=0.3)  # uniform over bytes at initialisation
    assert losses[-1] < losses[0]
    assert isinstance(results["sample"], str) and results["sample"].startswith(train_gpt.SAMPLE_PROMPT)
    _assert_params_finite(results["state"])


def test_default_run_checkpoint_loads_weights_only(default_run):
    results, _ = default_run
    raw = torch.load(results["checkpoint"], weights_only=True)
    assert raw["format"] == "funcamp.checkpoint"
    saved = checkpoint.load(results["checkpoint"])
    assert int(saved["state"].step) == 6 and saved["config"]["model"] == "tiny"
    for name, p in results["state"].params.items():
        assert torch.equal(saved["state"].params[name], p), name


def test_policy_auto_measures_once_then_reads_the_cache_and_retune_measures_again(tmp_path, monkeypatch, capsys):
    """An AVX-512 CPU with bfloat16 kernels (faked, so that every machine measures): the first run times one
    decoder block's kernels in float32 and bfloat16 (no step is built to measure) and builds the winner's step
    alone; the second reads the decision and builds one step; both train bit for bit alike (timing leaves the
    RNG as it was); --retune times again."""
    from funcamp import hardware

    facts = {"capability": "AVX512", "mkldnn_bf16": True, "mkldnn_fp16": False, "amx": False}
    monkeypatch.setattr(hardware, "_cpu_facts", lambda: dict(facts))
    monkeypatch.setenv("FUNCAMP_CACHE_DIR", str(tmp_path / "cache"))
    built = []
    build_run = train_gpt.build_run

    def counted(args, policy, *a, **k):  # each train step built (the policy now goes to TrainState.create)
        built.append(policy.compute_dtype)
        return build_run(args, policy, *a, **k)

    monkeypatch.setattr(train_gpt, "build_run", counted)
    argv = [*TINY, "--steps", "2", "--log-every", "1", "--no-compile", "--logdir", str(tmp_path / "run")]
    first = train_gpt.main(argv)
    out = capsys.readouterr().out
    choice = first["policy_choice"]
    assert choice.source == "measured" and built == [choice.dtype]  # the winner's step alone
    what = "blocks.0 (Block, one of 2)'s forward+backward kernels"
    assert f"policy auto: timing {what} in each candidate dtype (no compile)\n" in out
    # each half dtype timed with the per-op rules it keeps (named after the block where there are any)
    ruled = r"( \(bfloat16 with [a-z_]+ in float32\))?"
    assert re.search(rf": measured now \(9 interleaved rounds of {re.escape(what)}{ruled}, medians: float32 ", out), out
    assert [t.dtype for t in choice.timings] == [torch.float32, torch.bfloat16]
    assert f"saved to {choice.cache_path} (--retune measures again)" in out
    assert choice.cache_path.parent == tmp_path / "cache" / "tune"
    compute = str(choice.dtype).removeprefix("torch.")
    assert first["policy"] == f"params=float32,compute={compute},output=float32"

    built.clear()
    second = train_gpt.main(argv)
    out = capsys.readouterr().out
    assert second["policy_choice"].source == "cache" and built == [choice.dtype] and "timing the" not in out
    assert f"policy auto: {compute} compute on CPU (AVX512), " in out
    assert f": from the cache file {choice.cache_path} (measured {choice.measured_at}, " in out
    assert second["history"]["train_loss"] == first["history"]["train_loss"]
    for name, p in first["state"].params.items():
        assert torch.equal(second["state"].params[name], p), name

    built.clear()
    third = train_gpt.main([*argv, "--retune"])
    assert third["policy_choice"].source == "measured" and built == [third["policy_choice"].dtype]
    assert f"policy auto: timing {what} in each candidate dtype" in capsys.readouterr().out


def test_policy_auto_runs_attention_in_float32_where_the_block_measures_it_faster(tmp_path, monkeypatch, capsys):
    """Timers planted: attention in float32 0.6x of the bfloat16 block's, and the bfloat16 block 0.7x float32's with
    that rule but 1.1x without it. The rule is measured first and the bfloat16 candidate timed with it, so bfloat16
    wins and the step is built with ``{"scaled_dot_product_attention": float32}``; the header says so; a second run
    reads both decisions from the cache; when the rule no longer pays, bfloat16 (timed without it) loses to float32.
    (Planted: build_run called without op_policies: fails; the bfloat16 candidate timed without its rule: fails.)"""
    import functools

    from funcamp import hardware

    facts = {"capability": "AVX512", "mkldnn_bf16": True, "mkldnn_fp16": False, "amx": False}
    monkeypatch.setattr(hardware, "_cpu_facts", lambda: dict(facts))
    monkeypatch.setenv("FUNCAMP_CACHE_DIR", str(tmp_path / "cache"))

    def dtype_timer(run) -> float:
        if run.dtype == torch.float32:
            return 1.0
        return 0.7 if run.op_policies else 1.1

    rule_time = {"s": 0.6}

    def op_timer(run) -> float:
        return rule_time["s"] if run.op_policies else 1.0

    monkeypatch.setattr(
        fa.tune, "choose_compute_dtype", functools.partial(fa.tune.choose_compute_dtype, timer=dtype_timer)
    )
    monkeypatch.setattr(fa.tune, "choose_op_dtypes", functools.partial(fa.tune.choose_op_dtypes, timer=op_timer))
    built = []
    build_run = train_gpt.build_run

    def recorded(args, policy, *a, **k):
        built.append((policy.compute_dtype, k.get("op_policies")))
        return build_run(args, policy, *a, **k)

    monkeypatch.setattr(train_gpt, "build_run", recorded)
    argv = [*TINY, "--steps", "1", "--no-compile", "--logdir", str(tmp_path / "run")]
    first = train_gpt.main(argv)
    out = capsys.readouterr().out
    rule = {"scaled_dot_product_attention": torch.float32}
    assert built == [(torch.bfloat16, rule)] and dict(first["op_choice"].op_policies) == rule
    assert "policy auto, per op: scaled_dot_product_attention in float32 in a bfloat16 step: measured now" in out
    assert "forward+backward kernels (bfloat16 with scaled_dot_product_attention in float32), medians:" in out
    built.clear()
    second = train_gpt.main(argv)
    out = capsys.readouterr().out
    assert built == [(torch.bfloat16, rule)] and second["op_choice"].source == "cache" and "from the cache file" in out
    built.clear()
    rule_time["s"] = 1.0
    third = train_gpt.main([*argv, "--retune"])
    assert built == [(torch.float32, {})] and dict(third["op_choice"].op_policies) == {}
    assert third["policy_choice"].dtype == torch.float32
    assert "policy auto, per op: no per-op rule: float32 compute" in capsys.readouterr().out


def test_policy_auto_without_half_kernels_is_float32_at_once(tmp_path, monkeypatch, capsys):
    from funcamp import hardware

    facts = {"capability": "AVX2", "mkldnn_bf16": False, "mkldnn_fp16": False, "amx": False}
    monkeypatch.setattr(hardware, "_cpu_facts", lambda: dict(facts))
    results = train_gpt.main([*TINY, "--steps", "1", "--no-compile", "--logdir", str(tmp_path)])
    out = capsys.readouterr().out
    assert results["policy"] == "params=float32,compute=float32,output=float32"
    assert results["policy_choice"].source == "capability" and "timing the" not in out
    assert results["op_choice"] is None and "per op" not in out  # nothing computes in a half dtype: no op timed
    line = "policy auto: float32 compute on CPU (AVX2), "
    assert line in out and "oneDNN has no bfloat16 or float16 kernels for this CPU (AVX2) (torch's report" in out
    assert "--retune" not in out
    with pytest.raises(SystemExit):
        train_gpt.parse_args([*TINY, "--policy", "f32", "--retune"])
    assert (
        "--retune measures --policy auto's choice again; it does nothing with --policy f32" in capsys.readouterr().err
    )


def test_float16_with_dynamic_loss_scale_backs_off_then_grows(tmp_path):
    # 2**24 overflows float16 in the first backward passes; period 2 lets it grow again within the run.
    argv = [*TINY, "--steps", "12", "--log-every", "1", "--eval-every", "12", "--no-compile"]
    argv += ["--policy", F16, "--loss-scale", "dynamic", "--init-scale", str(2.0**24), "--scale-period", "2"]
    argv += ["--logdir", str(tmp_path)]
    results = train_gpt.main(argv)
    scales = [v for _, v in _scalars(tmp_path)["amp/loss_scale"]]
    assert scales[0] == 2.0**24
    first_drop = next(i for i in range(1, len(scales)) if scales[i] < scales[i - 1])
    assert any(scales[i] > scales[i - 1] for i in range(first_drop + 1, len(scales))), scales
    assert int(results["state"].skipped_steps) >= 1
    assert isinstance(results["state"].loss_scale, fa.DynamicLossScale)
    _assert_params_finite(results["state"])


def test_too_many_consecutive_skips_stops_the_run(tmp_path):
    argv = [*TINY, "--steps", "6", "--log-every", "1", "--no-compile", "--policy", F16, "--loss-scale", "dynamic"]
    argv += ["--init-scale", str(2.0**24), "--max-consecutive-skips", "2", "--logdir", str(tmp_path)]
    with pytest.raises(fa.SkippedStepsError, match="2 consecutive steps skipped .* first non-finite gradient") as info:
        train_gpt.main(argv)
    # The message ends with funcamp.debug's replay of the last step (from the state before it, scale 2**23
    # after one backoff from 2**24): the first op whose output overflowed, and the verdict at scale 1.
    report = str(info.value).split("\n", 1)[1]
    assert report.startswith("step NOT finite: loss finite, gradients NOT finite at loss scale 8.38861e+06 (2**23)")
    assert "\nfirst non-finite: backward op aten." in report and "float16 amax inf" in report
    assert "the same step at loss scale 1, are finite" in report


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "aot_eager"])
def test_resume_after_interruption_is_bitwise_identical(tmp_path, compiled):
    common = [*TINY, "--steps", "6", "--log-every", "1", "--eval-every", "6", "--save-every", "2"]
    common += ["--backend", "aot_eager"] if compiled else ["--no-compile"]
    torch._dynamo.reset()
    full = train_gpt.main([*common, "--logdir", str(tmp_path / "full")])
    run = [*common, "--logdir", str(tmp_path / "cut")]
    cut = train_gpt.main([*run, "--stop-after", "5"])  # "killed" after step 5: the checkpoint is step 4's
    assert int(cut["state"].step) == 5
    # TensorBoard reads a directory's event files in name order, and a name holds the second it was made and
    # this process's writer count: in one second the 10th writer sorts before the 9th. A new process always
    # starts in a later second; here, the resumed run waits for the next one.
    time.sleep(1.01 - time.time() % 1)
    resumed = train_gpt.main([*run, "--resume"])
    assert resumed["history"]["train_loss"] == full["history"]["train_loss"][4:]  # steps 5 and 6
    assert resumed["val_loss"] == full["val_loss"]
    for name, p in full["state"].params.items():
        assert torch.equal(resumed["state"].params[name], p), name
    assert torch.equal(
        resumed["state"].opt_state[1][0].nu["wte.weight"], full["state"].opt_state[1][0].nu["wte.weight"]
    )
    # TensorBoard shows one value per step: the resumed run hid step 5 of the interrupted one.
    assert [s for s, _ in _scalars(tmp_path / "cut")["train/loss"]] == [1, 2, 3, 4, 5, 6]


def test_lint_flag_prints_the_report_before_step_0(tmp_path, capsys):
    results = train_gpt.main([*TINY, "--steps", "1", "--no-compile", "--lint", "--logdir", str(tmp_path)])
    out = capsys.readouterr().out
    # float32 compute on this CPU (AVX2), or bfloat16 on AMX: test_debug.py shows the tiny GPT lints clean under both
    assert "funcamp lint: no findings" in out and "(funcamp.debug.lint of the first batch, eager" in out
    assert out.index("funcamp lint") < out.index("step 0: val loss")
    assert int(results["state"].step) == 1
    train_gpt.main([*TINY, "--steps", "1", "--no-compile", "--logdir", str(tmp_path / "off")])
    assert "funcamp lint" not in capsys.readouterr().out  # off by default


def _fp8_history(state: fa.TrainState, name: str = "blocks.0.attn.proj.fp8_amax_history_input") -> torch.Tensor:
    return state.buffers[name]


def test_fp8_delayed_one_graph_and_only_training_steps_advance_the_amax_history(tmp_path, capsys):
    """Compiled with dynamo's eager backend (guards and graph breaks as with inductor, cheaper): one graph
    over the steps, though the step takes and returns the delayed-scaling buffers (the loss_fn does not
    close over them); lint, validation and sampling read the buffers without advancing them."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    argv = [*TINY, "--steps", "3", "--log-every", "1", "--backend", "eager", "--fp8", "delayed", "--lint"]
    results = train_gpt.main([*argv, "--sample-bytes", "5", "--logdir", str(tmp_path)])
    choice = results["policy_choice"]  # --policy auto times a block's kernels, uncompiled: one graph, the winner's
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"], (counters, choice)
    out = capsys.readouterr().out
    assert "| fp8 delayed |" in out and "funcamp lint:" in out  # the lint ran the stateful loss_fn
    state = results["state"]
    assert all(math.isfinite(v) for _, v in results["history"]["train_loss"]) and math.isfinite(results["val_loss"])
    _assert_params_finite(state)
    history = _fp8_history(state)
    # One amax per training step (3), none from the lint, the two validations or the sampled bytes.
    assert history.shape == (16,) and int((history != 0).sum()) == 3 and bool((history[:3] > 0).all())


def test_fp8_delayed_resume_is_bitwise_identical_buffers_included(tmp_path):
    common = [*TINY, "--steps", "4", "--log-every", "1", "--eval-every", "4", "--save-every", "2", "--no-compile"]
    common += ["--fp8", "delayed"]
    full = train_gpt.main([*common, "--logdir", str(tmp_path / "full")])
    run = [*common, "--logdir", str(tmp_path / "cut")]
    train_gpt.main([*run, "--stop-after", "3"])  # the checkpoint is step 2's
    resumed = train_gpt.main([*run, "--resume"])
    assert resumed["history"]["train_loss"] == full["history"]["train_loss"][2:]
    for tree in ("params", "buffers"):
        for name, t in getattr(full["state"], tree).items():
            assert torch.equal(getattr(resumed["state"], tree)[name], t), (tree, name)
    assert checkpoint.load(full["checkpoint"])["config"]["fp8"] == "delayed"


def test_bfloat16_kahan_master_weights(tmp_path, capsys):
    argv = [*TINY, "--steps", "3", "--log-every", "1", "--no-compile", "--master-weights", "bfloat16-kahan"]
    results = train_gpt.main([*argv, "--logdir", str(tmp_path)])
    compute = str(results["policy_choice"].dtype).removeprefix("torch.")  # --policy auto's decision
    header = f"policy params=bfloat16,compute={compute},output=float32,reduce=float32 | master weights bfloat16-kahan"
    assert f"{header}, moments float32 |" in capsys.readouterr().out
    state = results["state"]
    assert all(math.isfinite(v) for _, v in results["history"]["train_loss"]) and math.isfinite(results["val_loss"])
    _assert_params_finite(state)
    assert state.params["wte.weight"].dtype == torch.bfloat16 and state.params["ln_f.weight"].dtype == torch.float32
    assert isinstance(state.opt_state, optim.KahanSummationState)
    comp = state.opt_state.compensation["blocks.0.mlp.fc.weight"]
    assert comp.dtype == torch.bfloat16 and bool((comp != 0).any())  # rounding residue carried to the next step
    adam = state.opt_state.inner_state[1][0]
    assert adam.nu["wte.weight"].dtype == torch.float32  # --moment-dtype float32 (the default)
    saved = checkpoint.load(results["checkpoint"])["config"]
    assert (saved["master_weights"], saved["moment_dtype"]) == ("bfloat16-kahan", "float32")


def test_quantized_moments_run_and_checkpoint(tmp_path):
    moment_dtype = "int8"  # int4 takes the same path (a format of optim.adamw); smoke-run by hand
    argv = [*TINY, "--steps", "2", "--save-every", "2", "--no-compile", "--moment-dtype", moment_dtype]
    results = train_gpt.main([*argv, "--logdir", str(tmp_path)])
    assert all(math.isfinite(v) for _, v in results["history"]["train_loss"]) and math.isfinite(results["val_loss"])
    adam = results["state"].opt_state[1][0]
    big = [k for k, m in adam.mu.items() if isinstance(m, optim.QuantizedMoment)]
    assert "wte.weight" in big and isinstance(adam.nu["ln_f.weight"], torch.Tensor)  # small: float32
    saved = checkpoint.load(results["checkpoint"])
    assert saved["config"]["moment_dtype"] == moment_dtype
    assert torch.equal(saved["state"].opt_state[1][0].nu["wte.weight"].codes, adam.nu["wte.weight"].codes)


def test_bfloat16_stochastic_rounding_moments_and_flag_errors(tmp_path):
    argv = [*TINY, "--steps", "2", "--no-compile", "--master-weights", "bfloat16-sr", "--moment-dtype", "bfloat16"]
    state = train_gpt.main([*argv, "--seed", "7", "--logdir", str(tmp_path)])["state"]
    assert isinstance(state.opt_state, optim.StochasticRoundingState) and int(state.opt_state.seed) == 7
    assert int(state.opt_state.count) == 2
    assert state.opt_state.inner_state[1][0].mu["wte.weight"].dtype == torch.bfloat16
    _assert_params_finite(state)
    # --policy with params=bfloat16 and the default --master-weights float32 disagree: refused, not overridden.
    with pytest.raises(SystemExit, match="--policy stores parameters in bfloat16 but --master-weights is float32"):
        train_gpt.main([*TINY, "--steps", "1", "--no-compile", "--policy", "p=bf16,c=f32,o=f32"])
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--master-weights", "float16"])
    with pytest.raises(SystemExit):  # fp8 layers keep float32 masters: the two flags would half apply
        train_gpt.parse_args(["--master-weights", "bfloat16-kahan", "--fp8", "tensorwise"])


def test_telemetry_flag_writes_numerics_every_n_steps(tmp_path):
    argv = [*TINY, "--steps", "4", "--log-every", "2", "--eval-every", "4", "--no-compile", "--telemetry-every", "2"]
    train_gpt.main([*argv, "--logdir", str(tmp_path)])
    scalars = _scalars(tmp_path)
    assert [step for step, _ in scalars["numerics/all/grad_amax"]] == [2, 4]
    assert {"numerics/blocks.0/float16/underflow_scaled", "numerics/wte/bfloat16/headroom_log2"} <= set(scalars)
    assert all(v > 0 for _, v in scalars["numerics/all/weight_amax"])
    acc = EventAccumulator(str(tmp_path), size_guidance={"histograms": 0})
    acc.Reload()
    assert "numerics/all/grad_log2_hist" in acc.Tags()["histograms"]
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--telemetry-every", "-1"])


def test_custom_data_file_and_errors(tmp_path):
    text = tmp_path / "tiny.txt"
    text.write_text("héllo wörld, mixed precision! " * 200, encoding="utf-8")
    results = train_gpt.main([*TINY, "--steps", "2", "--no-compile", "--data", str(text), "--logdir", str(tmp_path)])
    assert int(results["state"].step) == 2
    with pytest.raises(SystemExit, match="--resume: no checkpoint at"):
        train_gpt.main([*TINY, "--resume", "--logdir", str(tmp_path / "empty")])
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--steps", "0"])
    with pytest.raises(SystemExit):
        train_gpt.parse_args(["--model", "huge"])


def test_batches_are_a_function_of_seed_and_step_and_shard_by_rank():
    data = torch.arange(200, dtype=torch.uint8)
    kw = {"batch_size": 2, "block_size": 8, "seed": 3}
    a, b = train_gpt.get_batch(data, 7, **kw), train_gpt.get_batch(data, 7, **kw)
    assert torch.equal(a["inputs"], b["inputs"]) and torch.equal(a["targets"][:, :-1], a["inputs"][:, 1:])
    assert not torch.equal(a["inputs"], train_gpt.get_batch(data, 8, **kw)["inputs"])
    ranks = [train_gpt.get_batch(data, 7, **{**kw, "batch_size": 1}, rank=r, world_size=2) for r in range(2)]
    assert torch.equal(torch.cat([r["inputs"] for r in ranks]), a["inputs"])  # two ranks split the global batch


def test_amp_basics_numbers():
    out = amp_basics.main([])
    under = out["1. float16 underflow"]
    assert under["f16(2**-25)"] == 0.0 and under["f16(2**-24)"] == 2.0**-24 and under["bf16(2**-25)"] == 2.0**-25
    lost = out["2. lost updates (why master weights stay float32)"]
    assert lost["1 + 1e-4 in float16"] == 1.0 and lost["1 + 1e-4 in bfloat16"] == 1.0
    assert lost["1 + 1e-4 in float32"] != 1.0
    # 0.9400020: float32 result of 100 float32 additions of -6e-4 to 1.0 (the figure; exact here).
    assert f"{lost['100 updates, float32 params']:.7f}" == "0.9400020"
    assert lost["100 updates, bfloat16 params"] == 1.0
    scaling = out["3. loss scaling rescues small float16 gradients"]
    assert scaling["f16 gradient, no loss scale"] == 0.0
    assert scaling["f16 gradient, loss scale 2**15"] == pytest.approx(1e-8, rel=1e-3)
    assert scaling["grads finite with scaling"] is True
    memory = out["4. memory footprint of GPT-2 (124M parameters)"]
    assert memory["parameters"] == 124_439_808  # OpenAI GPT-2 small, tied embeddings
    assert memory["float32 MiB"] == pytest.approx(124_439_808 * 4 / 2**20)
    assert memory["bfloat16 MiB"] == memory["float16 MiB"] == memory["float32 MiB"] / 2


def test_script_runs_from_the_repository_root():
    # As a user runs it: examples/ is put on sys.path by the script itself.
    out = subprocess.run(
        [sys.executable, "examples/amp_basics.py"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "0.9400020" in out.stdout and "funcamp.memory.memory_footprint" in out.stdout
    # The value column holds numbers only: True (not 1) for a flag; the text note sits beside its title.
    rows = [line.rsplit(" ", 1)[-1] for line in out.stdout.splitlines() if line.startswith("  ")]
    assert "True" in rows and "124,439,808" in rows
    for value in rows:
        assert value == "True" or math.isfinite(float(value.replace(",", ""))), value


def test_resume_with_other_settings_names_them(tmp_path):
    """A resume whose flags change the state's layout fails with one line naming the settings that differ
    (it was a bare CheckpointMismatchError traceback), and --shard on an unsharded run says to drop it."""
    run = [*TINY, "--steps", "1", "--eval-every", "1", "--save-every", "1", "--no-compile", "--logdir", str(tmp_path)]
    train_gpt.main([*run, "--policy", "f32"])
    with pytest.raises(SystemExit, match=r"does not fit this run .*'master_weights': \('float32', 'bfloat16'\)"):
        train_gpt.main([*run, "--policy", "f32", "--resume", "--master-weights", "bfloat16"])
    with pytest.raises(SystemExit, match="is an unsharded checkpoint .*drop --shard"):
        train_gpt.main([*run, "--policy", "f32", "--resume", "--shard"])
    with pytest.raises(SystemExit):  # argparse: --stop-after must be >= 1
        train_gpt.main([*run, "--stop-after", "0"])


GAN_TINY = ["--batch-size", "64", "--hidden", "32", "--log-every", "4", "--scale-period", "4"]


def test_gan_two_loss_scales_one_graph_logged(tmp_path):
    """examples/gan.py (issue 23, item 2): the step built from the stages, two models with a loss scale each,
    compiled as one graph over 12 steps while both scales grow, both scales in TensorBoard; the eager run
    (--no-compile) gives the same states bitwise."""
    torch._dynamo.reset()
    compiled = gan.main([*GAN_TINY, "--steps", "12", "--backend", "aot_eager", "--logdir", str(tmp_path / "c")])
    assert compiled["graphs"] == 1
    for model in ("d", "g"):
        state = compiled["states"][model]
        assert float(state.loss_scale.loss_scale) == 2.0 ** (15 + 12 // 4)  # grew every 4 finite steps
        assert int(state.skipped_steps) == 0 and int(state.step) == 12
        logged = _scalars(tmp_path / "c")[f"{model}/amp/loss_scale"]
        assert [s for s, _ in logged] == [0, 4, 8, 11] and logged[-1][1] == 2.0**17  # the scale step 11 used
        assert f"{model}/train/loss" in _scalars(tmp_path / "c")
    eager = gan.main([*GAN_TINY, "--steps", "12", "--no-compile", "--logdir", str(tmp_path / "e")])
    for model in ("d", "g"):
        for name, p in compiled["states"][model].params.items():
            torch.testing.assert_close(p, eager["states"][model].params[name], rtol=2.0**-10, atol=2.0**-12)


def test_gan_scales_are_independent(tmp_path):
    """A loss scale per loss: with a discriminator scale that overflows float16 (2**40 > 65504), only the
    discriminator's steps skip and back off; the generator's scale grows as it would alone."""
    args = gan.parse_args([*GAN_TINY, "--steps", "6", "--no-compile", "--logdir", str(tmp_path)])
    step, states, _ = gan.build(args)
    states["d"] = states["d"].replace(loss_scale=fa.DynamicLossScale(2.0**40, period=4))
    for i in range(6):
        states, metrics = step(states, gan.ring_batch(0, i, 64))
    assert int(states["d"].skipped_steps) > 0 and float(states["d"].loss_scale.loss_scale) < 2.0**40
    assert int(states["g"].skipped_steps) == 0 and float(states["g"].loss_scale.loss_scale) == 2.0 ** (15 + 1)


def test_compile_cache_of_the_main_job(tmp_path, monkeypatch):
    """Where the main job keeps its compiled step (funcamp.compile_cache), when it does not, and what keys it."""
    state, batch, policy = {"w": torch.zeros(2)}, {"inputs": torch.zeros(1, 4, dtype=torch.long)}, fa.get_policy("f32")

    def cache(*argv: str) -> tuple | None:
        return train_gpt.compile_cache_for(train_gpt.parse_args(list(argv)), state, batch, policy, 0, 1)

    file, key = cache("--cache-dir", str(tmp_path))
    assert file.parent == tmp_path / "compile" and key.fields["extra"]["policy"] == str(policy)
    assert cache("--cache-dir", str(tmp_path)) == (file, key)
    assert cache("--cache-dir", str(tmp_path), "--lr", "1e-3")[1].digest != key.digest
    monkeypatch.setenv("FUNCAMP_CACHE_DIR", str(tmp_path / "env"))
    assert cache()[0].parent == tmp_path / "env" / "compile"
    for off in (["--no-compile-cache"], ["--no-compile"], ["--backend", "aot_eager"]):
        assert cache(*off) is None, off
