"""funcamp on a CUDA device: the checks that the CPU suite cannot make (skipped without CUDA).

Run on a GPU machine with ``python3 -m pytest -q tests/test_cuda.py``. Each test compares with a
reference made in the same test: ``torch.amp.GradScaler`` + ``torch.autocast`` for the float16 step,
an exact fp8 emulation (:func:`funcamp.formats.quantize_to`, float64 products) for ``torch._scaled_mm``,
and the state before a checkpoint for the state after it.
"""

from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend

import funcamp as fa
from funcamp import fp8, optim
from funcamp.formats import get_format, quantize_to

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from gpt import GPT, GPTConfig  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (CI has none)")

CUDA = torch.device("cuda")
# Widths that are multiples of 16, as torch._scaled_mm needs.
CONFIG = GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64)
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _batch(step: int, size: int = 8, t: int = 64, vocab: int = 256) -> dict[str, torch.Tensor]:
    """Sequences counting up from a random start (mod ``vocab``): learnable within a few steps."""
    gen = torch.Generator().manual_seed(step)
    x = (torch.randint(0, vocab, (size, 1), generator=gen) + torch.arange(t + 1)) % vocab
    return {"x": x[:, :-1].to(CUDA), "y": x[:, 1:].to(CUDA)}


def _loss_fn(apply_fn):
    def loss_fn(params, batch):
        logits = apply_fn(params, batch["x"])
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["y"].flatten())

    return loss_fn


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return GPT(CONFIG).to(CUDA)


def test_half_dtype_and_probe_on_cuda() -> None:
    major, _ = torch.cuda.get_device_capability()
    expected = torch.bfloat16 if major >= 8 else torch.float16 if major >= 7 else torch.float32
    assert fa.half_dtype("cuda") == expected
    assert fa.hardware.probe("cuda").half_dtype == expected


def test_compiled_float16_step_one_graph_no_host_sync_and_skips() -> None:
    """Inductor, float16 compute, a dynamic scale that starts far too high: the first steps overflow and
    are skipped while the scale backs off, with one graph and no device-to-host sync in any step."""
    apply_fn, params = fa.nn.functionalize(_model(), "p=f32,c=f16,o=f32")
    opt = optim.adamw(1e-3)
    state = fa.TrainState.create(params, opt, loss_scale=fa.DynamicLossScale(2.0**40))
    counter = CompileCounterWithBackend("inductor")
    step = fa.make_train_step(_loss_fn(apply_fn), opt, backend=counter)
    state, _ = step(state, _batch(0))  # compile outside the sync check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for s in range(1, 30):
            state, metrics = step(state, _batch(s))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert counter.frame_count == 1
    assert 0 < int(state.skipped_steps) < 30
    assert float(state.loss_scale.loss_scale) < 2.0**40
    assert all(bool(torch.isfinite(p).all()) for p in state.params.values())
    assert all(p.is_cuda for p in state.params.values())


def test_donated_compiled_step_bitwise_no_sync_and_lower_peak() -> None:
    """make_train_step(donate=True) with inductor on CUDA: the same state as the pure step bitwise over 5 bf16
    steps, one graph, no device-to-host sync, the state's tensors written in place, and a lower peak."""
    states, peaks = [], []
    for donate in (False, True):
        torch._dynamo.reset()
        apply_fn, params = fa.nn.functionalize(_model(), "p=f32,c=bf16,o=f32")
        params = {k: v.detach().clone() for k, v in params.items()}
        opt = optim.adamw(1e-3)
        state = fa.TrainState.create(params, opt)
        step = fa.make_train_step(_loss_fn(apply_fn), opt, donate=donate)
        state, _ = step(state, _batch(0))
        kept = dict(state.params)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for s in range(1, 5):
                state, _ = step(state, _batch(s))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        peaks.append(torch.cuda.max_memory_allocated() - base)
        if donate:
            assert all(state.params[k] is kept[k] for k in kept)
        states.append(state)
    for k in states[0].params:
        assert torch.equal(states[0].params[k], states[1].params[k]), k
    assert peaks[1] < peaks[0], peaks


def test_float16_step_matches_gradscaler() -> None:
    """funcamp's float16 step against torch.autocast(float16) + GradScaler + torch.optim.AdamW on the same
    model and batches: after 20 steps the losses agree to float16 round-off (2%) and both trained."""
    model = _model()
    ref_model = copy.deepcopy(model)
    apply_fn, params = fa.nn.functionalize(model, "p=f32,c=f16,o=f32")
    opt = optim.adamw(1e-3, weight_decay=0.0)
    state = fa.TrainState.create(params, opt, loss_scale=fa.DynamicLossScale(2.0**16))
    step = fa.make_train_step(_loss_fn(apply_fn), opt, compile=False)

    torch_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-3, weight_decay=0.0)
    scaler = torch.amp.GradScaler("cuda", init_scale=2.0**16)
    losses, ref_losses = [], []
    for s in range(20):
        b = _batch(s)
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
        with torch.autocast("cuda", dtype=torch.float16):
            logits = ref_model(b["x"])
        loss = F.cross_entropy(logits.flatten(0, 1).float(), b["y"].flatten())
        torch_opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(torch_opt)
        scaler.update()
        ref_losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 0.1 and ref_losses[-1] < ref_losses[0] - 0.1
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) <= 0.02 * abs(b), (losses, ref_losses)


def _emulated(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Tensorwise: (values rounded exactly to fp8 as float64, inverse scale), torchao's scale rule."""
    t = t.double().cpu()
    scale = (get_format(dtype).max / t.abs().amax().clamp(min=1e-12)).float()
    return quantize_to(t.float() * scale, dtype, saturate=True).double(), scale.reciprocal().double()


def _check(got: torch.Tensor, a, ia, b, ib, fast_accum: bool = False) -> None:
    """``got`` (bfloat16) equals ``(a @ b) * ia * ib`` within the accumulation error plus one bf16 rounding.

    The accumulation unit is float32's 2**-24, or with ``fast_accum`` (the forward, as torchao runs it)
    2**-13: Hopper's fast fp8 accumulation keeps about 14 bits (DeepSeek-V3 technical report, 3.3.2).
    Both are far below fp8's own rounding (2**-4 relative), so a missing or wrong quantization fails.
    """
    ref = (a @ b) * ia * ib
    unit = 2.0**-13 if fast_accum else 2.0**-24
    acc = (a.shape[1] + 2) * unit * (a.abs() @ b.abs()) * (ia * ib).abs()
    bound = acc + 2.0**-8 * (ref.abs() + acc)
    err = (got.double().cpu() - ref).abs()
    assert (err <= bound).all(), f"max error {err.max().item():.3g}"


def test_fp8_linear_tensorwise_three_matmuls_equal_emulation_on_cuda() -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 96, generator=gen) * 3).to(CUDA, torch.bfloat16).requires_grad_()
    w = (torch.randn(48, 96, generator=gen) * 0.05).to(CUDA, torch.bfloat16).requires_grad_()
    g = (torch.randn(64, 48, generator=gen) * 1e-3).to(CUDA, torch.bfloat16)
    y = fp8.fp8_linear(x, w, recipe="tensorwise")
    gx, gw = torch.autograd.grad(y, (x, w), g)
    assert y.dtype == gx.dtype == gw.dtype == torch.bfloat16
    qx, ix = _emulated(x.detach(), E4M3)
    qw, iw = _emulated(w.detach(), E4M3)
    qg, ig = _emulated(g, E5M2)
    _check(y, qx, ix, qw.t(), iw, fast_accum=True)
    _check(gx, qg, ig, qw, iw)
    _check(gw, qg.t(), ig, qx, ix)
    plain = x.detach().double().cpu() @ w.detach().double().cpu().t()  # fp8 is visible at all
    assert ((plain - y.detach().double().cpu()).abs() > 1e-3 * plain.abs().amax()).any()


def _run_fp8(fp8_recipe: str | None) -> tuple[float, int]:
    """30 compiled (inductor) AdamW steps of the GPT, fp8 Linear layers with ``fp8_recipe`` (None: bf16
    throughout); returns the validation loss and the number of graphs compiled."""
    model = _model()
    if fp8_recipe:
        model = fp8.convert(model, fp8_recipe)
    out = fa.nn.functionalize(model, "p=f32,c=bf16,o=f32", module_policies=fp8.MODULE_POLICIES)
    if fp8_recipe == "delayed":  # the recipe state lives in buffers
        apply_fn, params, buffers = out

        def loss_fn(params, buffers, b):
            logits, new = apply_fn(params, buffers, b["x"])
            return F.cross_entropy(logits.flatten(0, 1).float(), b["y"].flatten()), new
    else:
        (apply_fn, params), buffers = out, None
        loss_fn = _loss_fn(apply_fn)

    opt = optim.adamw(3e-3, weight_decay=0.0)
    state = fa.TrainState.create(params, opt, loss_scale=fa.NoOpLossScale(), buffers=buffers)
    counter = CompileCounterWithBackend("inductor")
    step = fa.make_train_step(loss_fn, opt, backend=counter)
    for s in range(30):
        state, metrics = step(state, _batch(s))
    val_batch = _batch(10**6, size=32)
    val = (
        loss_fn(state.params, state.buffers, val_batch)[0] if buffers is not None else loss_fn(state.params, val_batch)
    )
    return float(val), counter.frame_count


@pytest.fixture(scope="module")
def bf16_val_loss() -> float:
    return _run_fp8(None)[0]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "delayed"])
def test_fp8_compiled_step_trains_like_bf16_on_cuda(recipe, bf16_val_loss) -> None:
    """The GPT with fp8 Linear layers, whole step compiled by inductor: one graph; after 30 steps the
    validation loss is within 3% of the same run without fp8."""
    val, graphs = _run_fp8(recipe)
    base = bf16_val_loss
    assert graphs == 1
    assert abs(val - base) <= 0.03 * base, (val, base)


def test_checkpoint_round_trip_keeps_cuda_state_bitwise(tmp_path) -> None:
    apply_fn, params = fa.nn.functionalize(_model(), "p=f32,c=bf16,o=f32")
    opt = optim.adamw(1e-3)
    state = fa.TrainState.create(params, opt, loss_scale=fa.DynamicLossScale(2.0**15))
    step = fa.make_train_step(_loss_fn(apply_fn), opt, compile=False)
    for s in range(3):
        state, _ = step(state, _batch(s))
    fa.checkpoint.save(tmp_path / "ckpt.pt", state)
    fresh = fa.TrainState.create(params, opt, loss_scale=fa.DynamicLossScale(2.0**15))
    loaded = fa.checkpoint.load(tmp_path / "ckpt.pt", like=fresh)
    for a, b in zip(fa._tree.tree_leaves(state), fa._tree.tree_leaves(loaded)):
        assert b.device == a.device and torch.equal(a, b)
    a_state, a_metrics = step(state, _batch(3))
    b_state, b_metrics = step(loaded, _batch(3))
    assert torch.equal(a_metrics["loss"], b_metrics["loss"])


# --- funcamp.capture.cuda_graph: the donating step replayed as one CUDA graph ----------------------------------


@functools.cache
def _donating_step(dtype: str, dropout: float = 0.0, backend: str = "inductor"):
    """One compiled donating step per setting, shared by the tests (each compiles once), and a state factory."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=64, n_layer=2, n_head=2, n_embd=64, dropout=dropout)).to(CUDA)
    apply_fn, params = fa.nn.functionalize(model, f"p=f32,c={dtype},o=f32")
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adamw(optim.warmup_cosine_decay(1e-3, 2, 20)))
    step = fa.make_train_step(_loss_fn(apply_fn), opt, donate=True, backend=backend)

    def new_state(init_scale: float) -> fa.TrainState:
        own = {k: v.detach().clone() for k, v in params.items()}
        return fa.TrainState.create(own, opt, loss_scale=fa.DynamicLossScale(init_scale))

    return step, new_state


def _captured_and_plain(dtype: str, init_scale: float, dropout: float = 0.0, backend: str = "inductor"):
    """The shared donating step wrapped by cuda_graph and as it is, each with its own state (the same start)."""
    step, new_state = _donating_step(dtype, dropout, backend)
    return (fa.capture.cuda_graph(step), new_state(init_scale)), (step, new_state(init_scale))


@pytest.mark.parametrize("dtype", ["bf16", "f16"])
def test_cuda_graph_step_bitwise_the_uncaptured_steps_with_skips(dtype) -> None:
    """24 steps, all but the warm-up replayed from one graph, equal the uncaptured donating step's bitwise, the loss
    scale's backoffs included (f16 from 2**32: the first steps overflow and are skipped, inside the graph too)."""
    n = 24
    (captured, st_c), (plain, st_p) = _captured_and_plain(dtype, 2.0**32 if dtype == "f16" else 2.0**15)
    kept, start = dict(st_c.params), {k: v.clone() for k, v in st_c.params.items()}
    for s in range(n):
        st_c, m_c = captured(st_c, _batch(s))
        st_p, m_p = plain(st_p, _batch(s))
    assert captured.reason is None and captured.replays == n - captured.warmup
    assert all(st_c.params[k] is kept[k] for k in kept)  # the recorded addresses
    for k in st_p.params:
        assert torch.equal(st_c.params[k], st_p.params[k]), k
    skipped = int(st_c.skipped_steps)
    assert skipped == int(st_p.skipped_steps)
    if dtype == "f16":
        assert captured.warmup < skipped < n, skipped  # skips replayed, and updates after them
    else:
        assert skipped == 0
    assert any(not torch.equal(st_c.params[k], start[k]) for k in start)
    assert torch.equal(st_c.loss_scale.loss_scale, st_p.loss_scale.loss_scale)
    assert torch.equal(m_c["loss"], m_p["loss"])


def test_cuda_graph_metrics_survive_replays_and_no_host_sync() -> None:
    (captured, state), _ = _captured_and_plain("bf16", 2.0**15)
    for s in range(3):
        state, _ = captured(state, _batch(s))
    torch.cuda.synchronize()
    kept = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for s in range(3, 8):
            state, metrics = captured(state, _batch(s))
            kept.append(metrics["loss"])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    losses = [float(x) for x in kept]
    assert len(set(losses)) == len(losses), losses  # each step's own loss, not the last replay's


def test_cuda_graph_dropout_draws_anew_at_each_replay() -> None:
    """Dropout inside the graph: replay advances the default generator, so one batch gives other losses."""
    (captured, state), _ = _captured_and_plain("bf16", 2.0**15, dropout=0.5)
    batch = _batch(0)
    losses = []
    for _ in range(6):
        state, metrics = captured(state, batch)
        losses.append(float(metrics["loss"]))
    assert captured.replays == 6 - captured.warmup
    assert len(set(losses[captured.warmup :])) == len(losses) - captured.warmup, losses


def test_cuda_graph_falls_back_with_one_message() -> None:
    """A step that does not donate: one CaptureWarning naming donate=True, then it trains uncaptured; a batch of
    another shape: that call runs uncaptured with its own message."""
    apply_fn, params = fa.nn.functionalize(_model(), "p=f32,c=bf16,o=f32")
    opt = optim.adamw(1e-3)
    state = fa.TrainState.create(params, opt)
    pure = fa.capture.cuda_graph(fa.make_train_step(_loss_fn(apply_fn), opt, backend="aot_eager"))
    with pytest.warns(fa.capture.CaptureWarning, match="donate=True") as record:
        for s in range(5):
            state, _ = pure(state, _batch(s))
    assert len(record) == 1 and pure.replays == 0
    (captured, st), _ = _captured_and_plain("bf16", 2.0**15, backend="aot_eager")  # a new shape recompiles
    for s in range(4):
        st, _ = captured(st, _batch(s))
    with pytest.warns(fa.capture.CaptureWarning, match="shape|recorded graph"):
        st, metrics = captured(st, _batch(4, size=4))
    assert captured.reason is None and bool(torch.isfinite(metrics["loss"]))
    st, _ = captured(st, _batch(5))
    assert captured.replays == 4 - captured.warmup + 1
