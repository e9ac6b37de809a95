"""funcamp.tensorboard: one host read per interval, tags and values read back from the event file."""

from __future__ import annotations

import math
import time

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import funcamp.tensorboard as tb
from funcamp.tensorboard import TensorBoardLogger


def _scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _metrics(i: int) -> dict[str, torch.Tensor]:
    """Metrics shaped like make_train_step's, with values that depend on the step."""
    return {
        "loss": torch.tensor(float(i)),
        "loss_scale": torch.tensor(2.0**i),
        "grads_finite": torch.tensor(i % 4 != 0),
        "grad_norm": torch.tensor(10.0 * i),
        "learning_rate": torch.tensor(1e-3 * i),
        "skipped_steps": torch.tensor(i // 4, dtype=torch.int32),
        "consecutive_skips": torch.tensor(0, dtype=torch.int32),
        "nonfinite_leaf": torch.tensor(-1, dtype=torch.int32),
        "aux": {"not": torch.ones(3)},
    }


def test_one_value_per_interval_with_means_and_last_values(tmp_path):
    with TensorBoardLogger(tmp_path, log_every=4, tokens_per_step=100) as logger:
        returned = [logger.log(_metrics(i), step=i) for i in range(1, 13)]
    assert [r is not None for r in returned] == [i % 4 == 0 for i in range(1, 13)]
    s = _scalars(tmp_path)
    expected_tags = {
        "train/loss",
        "train/grad_norm",
        "train/learning_rate",
        "amp/loss_scale",
        "amp/grads_finite",
        "amp/skipped_steps",
        "amp/consecutive_skips",
        "perf/tokens_per_second",
    }
    assert set(s) == expected_tags
    for tag in expected_tags:
        assert [step for step, _ in s[tag]] == [4, 8, 12], tag
    assert [v for _, v in s["train/loss"]] == [2.5, 6.5, 10.5]  # mean of steps 1-4, 5-8, 9-12
    assert [v for _, v in s["amp/loss_scale"]] == [16.0, 256.0, 4096.0]  # last value: 2**4, 2**8, 2**12
    assert [v for _, v in s["amp/grads_finite"]] == [0.75, 0.75, 0.75]  # one step in four overflowed
    assert [v for _, v in s["amp/skipped_steps"]] == [1.0, 2.0, 3.0]
    assert all(v > 0 for _, v in s["perf/tokens_per_second"])
    assert returned[3]["amp/loss_scale"] == 16.0


def test_reads_the_device_once_per_interval(tmp_path, monkeypatch):
    calls = []
    real = tb._to_host
    monkeypatch.setattr(tb, "_to_host", lambda tensors: calls.append(len(tensors)) or real(tensors))
    with TensorBoardLogger(tmp_path, log_every=5) as logger:
        for i in range(1, 11):
            logger.log(_metrics(i), step=i)
            assert len(calls) == i // 5
    assert calls == [5 * 7, 5 * 7]  # 7 written metrics (nonfinite_leaf and aux are not) of 5 steps, one read


def test_tensor_step_and_no_step_count_calls(tmp_path):
    with TensorBoardLogger(tmp_path / "t", log_every=2) as logger:
        for i in range(1, 5):
            logger.log({"loss": torch.tensor(1.0)}, step=torch.tensor(100 + i, dtype=torch.int32))
    assert [step for step, _ in _scalars(tmp_path / "t")["train/loss"]] == [102, 104]
    with TensorBoardLogger(tmp_path / "n", log_every=3) as logger:
        for _ in range(7):
            logger.log({"loss": 1.5})
    # steps 3 and 6 end intervals; close() writes the pending 7th
    assert _scalars(tmp_path / "n")["train/loss"] == [(3, 1.5), (6, 1.5), (7, 1.5)]


def test_log_scalars_custom_tags_and_unknown_metrics(tmp_path):
    with TensorBoardLogger(tmp_path, log_every=1, tags={"loss": "loss", "grad_norm": None}) as logger:
        logger.log({"loss": torch.tensor(2.0), "grad_norm": torch.tensor(1.0), "my_metric": 7}, step=1)
        logger.log_scalars({"val/loss": torch.tensor(1.25)}, step=1)
        logger.log_text("sample", "hello", step=1)
    s = _scalars(tmp_path)
    assert s == {"loss": [(1, 2.0)], "train/my_metric": [(1, 7.0)], "val/loss": [(1, 1.25)]}


def test_disabled_logger_writes_nothing(tmp_path):
    logger = TensorBoardLogger(tmp_path / "off", enabled=False, log_every=1)
    assert logger.log(_metrics(1), step=1) is None
    logger.log_scalars({"val/loss": 1.0}, step=1)
    logger.close()
    assert not (tmp_path / "off").exists()


def test_purge_step_hides_events_after_the_checkpoint(tmp_path):
    with TensorBoardLogger(tmp_path, log_every=1) as logger:
        for i in range(1, 6):
            logger.log({"loss": float(i)}, step=i)
    # TensorBoard orders a run's event files by name: the second's time, then a counter of the process, whose
    # "10" sorts before "9" (a long test process makes many writers): a second between the two files orders them.
    time.sleep(1.1)
    with TensorBoardLogger(tmp_path, log_every=1, purge_step=4) as logger:  # resumed from step 3
        for i in range(4, 7):
            logger.log({"loss": 10.0 * i}, step=i)
    loss = sorted(_scalars(tmp_path)["train/loss"])
    assert loss == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="log_every must be an int >= 1"):
        TensorBoardLogger(tmp_path, log_every=0)
    with pytest.raises(ValueError, match="tokens_per_step must be None or a number > 0"):
        TensorBoardLogger(tmp_path, tokens_per_step=-1)
    with pytest.raises(TypeError, match="logdir must be a str or path"):
        TensorBoardLogger(3)
    with pytest.raises(TypeError, match="tags must map metric names"):
        TensorBoardLogger(tmp_path, tags={"loss": 3})
    with TensorBoardLogger(tmp_path) as logger:
        with pytest.raises(TypeError, match="metrics must be a mapping"):
            logger.log([1.0])
        with pytest.raises(TypeError, match="step must be an int, a 0-d tensor or None"):
            logger.log({}, step=1.5)
        with pytest.raises(TypeError, match="step must be an int"):
            logger.log_scalars({"val/loss": 1.0}, step=None)
        with pytest.raises(TypeError, match="'val/loss' must be a real scalar"):
            logger.log_scalars({"val/loss": torch.ones(2)}, step=1)


def _histograms(logdir) -> dict[str, list]:
    acc = EventAccumulator(str(logdir), size_guidance={"histograms": 0})
    acc.Reload()
    return {tag: acc.Histograms(tag) for tag in acc.Tags()["histograms"]}


def test_numerics_from_the_last_active_step_as_scalars_and_log2_histograms(tmp_path, monkeypatch):
    from funcamp.numerics import HISTOGRAM_LOW, Telemetry, telemetry_metrics

    # A gradient of known binades: 1.0 (bin of 2**0) three times, 2**-20 once, one zero.
    params = {"block.w": torch.ones(5)}
    config = Telemetry(group_depth=1, formats=("float16",))

    def step_metrics(i: int) -> dict:
        g = {"block.w": torch.tensor([1.0, 1.0, 1.0, 2.0**-20, 0.0]) * 2.0**i}
        numerics = telemetry_metrics(g, params, torch.tensor(2.0**10), config, active=torch.tensor(i % 3 == 0))
        return {**_metrics(i), **numerics}

    calls = []
    real = tb._to_host
    monkeypatch.setattr(tb, "_to_host", lambda tensors: calls.append(len(tensors)) or real(tensors))
    with TensorBoardLogger(tmp_path, log_every=4) as logger:
        returned = [logger.log(step_metrics(i), step=i) for i in range(1, 9)]
    assert len(calls) == 2  # still one read per interval, histograms included
    s, h = _scalars(tmp_path), _histograms(tmp_path)
    # Active at steps 3 and 6 (i % 3 == 0): each interval (1-4, 5-8) writes its active step's values there.
    assert s["numerics/block/grad_amax"] == [(3, 8.0), (6, 64.0)]
    assert s["numerics/all/grad_zeros"] == [(3, pytest.approx(0.2)), (6, pytest.approx(0.2))]  # float32 1/5
    assert [v for _, v in s["numerics/block/float16/headroom_log2"]] == pytest.approx(
        [math.log2(65504) - 10 - 3, math.log2(65504) - 10 - 6], abs=1e-6
    )  # float32 arithmetic
    assert "numerics/active" not in s and returned[3]["numerics/block/grad_amax"] == 8.0
    hist = h["numerics/block/grad_log2_hist"]
    assert [e.step for e in hist] == [3, 6]
    first = hist[0].histogram_value
    assert first.num == 4  # the zero is left out
    counts = dict(zip(first.bucket_limit, first.bucket))
    assert counts[3 + 1.0] == 3 and counts[3 - 20 + 1.0] == 1  # right edges: 2**3 in [3, 4), 2**-17 in [-17, -16)
    assert first.min == -17.0 and first.max == 4.0 and HISTOGRAM_LOW < first.min


def test_interval_without_an_active_step_writes_no_numerics(tmp_path):
    from funcamp.numerics import Telemetry, telemetry_metrics

    w, scale = {"w": torch.ones(2)}, torch.tensor(1.0)
    off = telemetry_metrics(w, w, scale, Telemetry(), active=torch.tensor(False))
    with TensorBoardLogger(tmp_path, log_every=2) as logger:
        for i in (1, 2):
            logger.log({"loss": torch.tensor(1.0), **off}, step=i)
    assert set(_scalars(tmp_path)) == {"train/loss"} and not _histograms(tmp_path)


def test_non_finite_telemetry_is_written_as_a_gap(tmp_path):
    """TensorBoard draws no line for a chart holding one +-inf point: such telemetry is written as NaN (a gap),
    while the returned values keep the infinities."""
    from funcamp.numerics import Telemetry, telemetry_metrics

    w, scale = {"w": torch.ones(2)}, torch.tensor(1.0)
    on = telemetry_metrics({"w": torch.tensor([math.inf, 1.0])}, w, scale, Telemetry(), active=torch.tensor(True))
    with TensorBoardLogger(tmp_path, log_every=1) as logger:
        returned = logger.log({"loss": torch.tensor(1.0), **on}, step=1)
    amax = [k for k in returned if k.endswith("grad_amax")][0]
    headroom = [k for k in returned if k.endswith("float16/headroom_log2")][0]
    assert returned[amax] == math.inf and returned[headroom] == -math.inf
    s = _scalars(tmp_path)
    assert math.isnan(s[amax][0][1]) and math.isnan(s[headroom][0][1])
    assert all(math.isfinite(v) or math.isnan(v) for series in s.values() for _, v in series)
