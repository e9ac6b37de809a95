"""Bad-input catalogue: wrong calls across the public API, each refused with a specific exception type
and a message that names the argument and says what is accepted.

Every case runs against shared objects (a train state, a loss scale, parameters, trees); after each
refused call they must be exactly as before (same leaf objects, same values): a refused call leaves
nothing half-updated.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import funcamp as fa
from funcamp import _tree, checkpoint, optim

PARAMS = {"b": torch.zeros(3), "w": torch.ones(4, 3)}
OPT = optim.adamw(1e-2)
STATE = fa.TrainState.create(PARAMS, OPT, loss_scale=fa.DynamicLossScale(2.0**4, period=1))
LS = fa.DynamicLossScale(2.0**10, period=3, hysteresis=2)
BATCH = {"x": torch.ones(4, 4)}
TREE_A = {"a": torch.ones(2), "b": [torch.zeros(3, dtype=torch.float16), 1]}
TREE_B = {"a": torch.zeros(2), "b": [torch.ones(3, dtype=torch.float16), 1]}
TRUE = torch.tensor(True)
WATCHED = (PARAMS, STATE, LS, BATCH, TREE_A, TREE_B)


def good_loss(p: dict, batch: dict) -> torch.Tensor:
    return ((batch["x"] @ p["w"] + p["b"]) ** 2).mean()


def vector_loss(p: dict, batch: dict) -> torch.Tensor:
    return (batch["x"] @ p["w"]).sum(-1)  # forgot to reduce


def int_loss(p: dict, batch: dict) -> torch.Tensor:
    return (batch["x"] @ p["w"]).sum().long()


def python_loss(p: dict, batch: dict) -> float:
    return 1.0


def float_labels_loss(p: dict, batch: dict) -> torch.Tensor:
    labels = torch.zeros(batch["x"].shape[0])  # float class indices: cross_entropy wants int64
    return torch.nn.functional.cross_entropy(batch["x"] @ p["w"], labels)


def wrong_features_loss(p: dict, batch: dict) -> torch.Tensor:
    return (batch["x"][:, :3] @ p["w"]).sum()  # 3 features into a (4, 3) weight


def _step(loss_fn: Callable, state: fa.TrainState = STATE, batch: Any = BATCH, **kwargs: Any) -> Callable:
    def call() -> Any:
        return fa.make_train_step(loss_fn, OPT, **kwargs)(state, batch)

    return call


def _compiled(loss_fn: Callable, **kwargs: Any) -> Callable:
    return _step(loss_fn, backend="aot_eager", **kwargs)


def _eager(loss_fn: Callable, **kwargs: Any) -> Callable:
    return _step(loss_fn, compile=False, **kwargs)


def _gav(fun: Callable, *args: Any, loss_scale: Any = LS, **kwargs: Any) -> Callable:
    return lambda: fa.grad_and_value(fun, loss_scale, **kwargs)(*args)


def case(name: str, call: Callable[[], Any], exc: type[Exception], match: str) -> Any:
    return pytest.param(call, exc, match, id=name)


F32 = torch.float32
CASES = [
    # --- policies -------------------------------------------------------------------------------------
    case("policy-unknown-dtype", lambda: fa.get_policy("params=float32,compute=float8"), ValueError,
         r"unknown dtype 'float8' in part 'compute=float8'.*accepted dtype names: .*bfloat16"),
    case("policy-unknown-key", lambda: fa.get_policy("params=float32,comput=bf16"), ValueError,
         r"unknown key 'comput'.*accepted keys: p/params/c/compute/o/output/r/reduce"),
    case("policy-empty", lambda: fa.get_policy("  "), ValueError,
         r"empty policy string; expected e.g. 'params=float32,compute=bfloat16,output=float32'"),
    case("policy-empty-part", lambda: fa.get_policy("p=f32,,c=bf16"), ValueError,
         r"an empty part in 'p=f32,,c=bf16'; each comma-separated part must be key=dtype"),
    case("policy-double-equals", lambda: fa.get_policy("c==bf16"), ValueError,
         r"part 'c==bf16'.*must be key=dtype with key one of"),
    case("policy-key-twice", lambda: fa.get_policy("p=f32,params=bf16"), ValueError,
         r"param_dtype given twice.*at most once"),
    case("policy-not-a-string", lambda: fa.get_policy(torch.float16), TypeError,
         r"get_policy: expected a policy string or a Policy, got dtype"),
    case("policy-int-dtype", lambda: fa.Policy(F32, torch.int8, F32), ValueError,
         r"compute_dtype must be a real floating-point dtype \(torch.float16.*got torch.int8"),
    case("policy-complex-dtype", lambda: fa.Policy(F32, F32, torch.complex64), ValueError,
         r"output_dtype must be a real floating-point dtype"),
    case("policy-string-dtype", lambda: fa.Policy("float32", F32, F32), TypeError,
         r"param_dtype must be a torch.dtype .*got 'float32'; use funcamp.get_policy"),
    case("policy-state-dict-missing", lambda: fa.Policy.from_state_dict({"param_dtype": "float32"}), ValueError,
         r"from_state_dict: bad keys \['param_dtype'\].*missing .*'compute_dtype'"),
    # --- loss scales ----------------------------------------------------------------------------------
    case("static-zero", lambda: fa.StaticLossScale(0.0), ValueError,
         r"loss_scale must be positive and finite in float32 \(between 2\*\*-126 and"),
    case("static-overflows-float32", lambda: fa.StaticLossScale(1e39), ValueError,
         r"loss_scale must be positive and finite in float32"),
    case("static-f16-tensor", lambda: fa.StaticLossScale(torch.tensor(2.0, dtype=torch.float16)), TypeError,
         r"loss_scale must be a torch.float32 tensor or a Python number, got a torch.float16 tensor"),
    case("static-vector", lambda: fa.StaticLossScale(torch.ones(2)), ValueError,
         r"loss_scale must be a 0-d tensor, got shape \(2,\)"),
    case("dynamic-period-zero", lambda: fa.DynamicLossScale(period=0), ValueError,
         r"period must be an int >= 1, got 0"),
    case("dynamic-period-float", lambda: fa.DynamicLossScale(period=2.5), TypeError, r"period must be an int >= 1"),
    case("dynamic-hysteresis-zero", lambda: fa.DynamicLossScale(hysteresis=0), ValueError,
         r"hysteresis must be an int >= 1"),
    case("dynamic-growth-one", lambda: fa.DynamicLossScale(growth_factor=1.0), ValueError,
         r"growth_factor must be a finite float > 1, got 1.0"),
    case("dynamic-growth-negative", lambda: fa.DynamicLossScale(growth_factor=-2.0), ValueError,
         r"growth_factor must be a finite float > 1"),
    case("dynamic-growth-string", lambda: fa.DynamicLossScale(growth_factor="2"), TypeError,
         r"growth_factor must be a Python float, got '2'"),
    case("dynamic-backoff-zero", lambda: fa.DynamicLossScale(backoff_factor=0.0), ValueError,
         r"backoff_factor must be a float in \(0, 1\) or None"),
    case("dynamic-backoff-negative", lambda: fa.DynamicLossScale(backoff_factor=-0.5), ValueError,
         r"backoff_factor must be a float in \(0, 1\)"),
    case("dynamic-backoff-one", lambda: fa.DynamicLossScale(backoff_factor=1.0), ValueError,
         r"backoff_factor must be a float in \(0, 1\)"),
    case("dynamic-floor-zero", lambda: fa.DynamicLossScale(min_loss_scale=0.0), ValueError,
         r"min_loss_scale must be a float between 2\*\*-126 \(the smallest normal float32\)"),
    case("dynamic-floor-negative", lambda: fa.DynamicLossScale(min_loss_scale=-1.0), ValueError,
         r"min_loss_scale must be a float between 2\*\*-126"),
    case("dynamic-floor-underflows", lambda: fa.DynamicLossScale(1.0, min_loss_scale=1e-50), ValueError,
         r"min_loss_scale must be a float between 2\*\*-126"),
    case("dynamic-cap-below-floor", lambda: fa.DynamicLossScale(max_loss_scale=0.5), ValueError,
         r"max_loss_scale must be None, inf, or a float >= min_loss_scale=1.0"),
    case("dynamic-cap-overflows", lambda: fa.DynamicLossScale(max_loss_scale=1e39), ValueError,
         r"max_loss_scale must be None, inf, or a float .* <= 3.4028234663852886e\+38"),
    case("dynamic-scale-below-floor", lambda: fa.DynamicLossScale(0.5), ValueError,
         r"loss_scale must be >= min_loss_scale=1.0"),
    case("dynamic-scale-inf", lambda: fa.DynamicLossScale(math.inf), ValueError,
         r"loss_scale must be >= min_loss_scale=1.0 and finite in float32"),
    case("dynamic-scale-above-cap", lambda: fa.DynamicLossScale(2.0**20, period=1, max_loss_scale=2.0**10),
         ValueError, r"loss_scale must be >= min_loss_scale=1.0 and <= max_loss_scale=1024.0, got 1048576.0"),
    case("dynamic-scale-overflows", lambda: fa.DynamicLossScale(1e39), ValueError,
         r"loss_scale must be .* finite in float32"),
    case("dynamic-float-counter", lambda: fa.DynamicLossScale(counter=torch.tensor(0.0)), TypeError,
         r"counter must be a torch.int32 tensor or a Python number"),
    # --- positional arguments in a counterpart's order (jmp, optax, torch): the same meaning, or refused ------
    case("dynamic-sixth-positional", lambda: fa.DynamicLossScale(2.0**15, 0, 2000, 2.0, 1.0, 2), TypeError,
         r"takes from 1 to 6 positional arguments but 7 were given"),
    case("dynamic-gradscaler-order", lambda: fa.DynamicLossScale(2.0**16, 2.0, 0.5, 2000), TypeError,
         r"period must be an int >= 1, got 0.5"),
    case("dynamic-counter-is-period", lambda: fa.DynamicLossScale(2.0**16, 2000), ValueError,
         r"counter must be an int in \[0, period - 1=1999\], got 2000; the positional order is jmp's"),
    case("dynamic-float-counter-number", lambda: fa.DynamicLossScale(2.0**16, 2.0), TypeError,
         r"counter must be a torch.int32 0-d tensor or a Python int, got 2.0"),
    case("dynamic-hysteresis-left-above", lambda: fa.DynamicLossScale(hysteresis_left=3, hysteresis=2), ValueError,
         r"hysteresis_left must be an int in \[0, hysteresis=2\], got 3"),
    case("dynamic-hysteresis-left-tensor-above",
         lambda: fa.DynamicLossScale(hysteresis_left=torch.tensor(2, dtype=torch.int32)), ValueError,
         r"hysteresis_left must be an int in \[0, hysteresis=1\], got 2"),
    # below the range (T14): a negative count, as a Python int and as a CPU int32 tensor
    case("dynamic-counter-negative", lambda: fa.DynamicLossScale(counter=-1), ValueError,
         r"counter must be an int in \[0, period - 1=1999\], got -1$"),
    case("dynamic-counter-tensor-negative",
         lambda: fa.DynamicLossScale(counter=torch.tensor(-3, dtype=torch.int32)), ValueError,
         r"counter must be an int in \[0, period - 1=1999\], got -3$"),
    case("dynamic-hysteresis-left-negative", lambda: fa.DynamicLossScale(hysteresis_left=-1, hysteresis=2), ValueError,
         r"hysteresis_left must be an int in \[0, hysteresis=2\], got -1"),
    case("dynamic-hysteresis-left-tensor-negative",
         lambda: fa.DynamicLossScale(hysteresis_left=torch.tensor(-1, dtype=torch.int32)), ValueError,
         r"hysteresis_left must be an int in \[0, hysteresis=1\], got -1"),
    case("adamw-optax-mu-dtype", lambda: optim.adamw(1e-3, 0.9, 0.999, 1e-8, 0.0, None), TypeError,
         r"adamw\(\) takes from 1 to 5 positional arguments but 6 were given"),
    case("adam-optax-mu-dtype", lambda: optim.adam(1e-3, 0.9, 0.999, 1e-8, 0.0, None), TypeError,
         r"adam\(\) takes from 1 to 5 positional arguments but 6 were given"),
    case("lion-optax-mu-dtype", lambda: optim.lion(1e-4, 0.9, 0.99, None), TypeError,
         r"lion\(\) takes from 1 to 3 positional arguments but 4 were given"),
    case("sgd-optax-accumulator-dtype", lambda: optim.sgd(0.1, 0.9, False, torch.float32), TypeError,
         r"sgd\(\) takes from 1 to 3 positional arguments but 4 were given"),
    case("sgd-torch-dampening", lambda: optim.sgd(0.1, 0.9, 0.1), TypeError,
         r"sgd: nesterov must be a bool \(True or False\), got 0.1"),
    case("trace-number-nesterov", lambda: optim.trace(0.9, 0.5), TypeError,
         r"trace: nesterov must be a bool \(True or False\), got 0.5"),
    case("warmup-cosine-optax-order", lambda: optim.warmup_cosine_decay(0, 1, 100, 5000), TypeError,
         r"warmup_cosine_decay\(\) takes 3 positional arguments but 4 were given"),
    case("adjust-python-bool", lambda: LS.adjust(True), TypeError,
         r"grads_finite must be a 0-d torch.bool tensor \(e.g. funcamp.all_finite\(grads\)\), got bool"),
    case("adjust-vector", lambda: LS.adjust(torch.tensor([True, False])), ValueError,
         r"grads_finite must be 0-d, got shape \(2,\)"),
    case("adjust-float-tensor", lambda: LS.adjust(torch.tensor(1.0)), TypeError,
         r"grads_finite must be a 0-d torch.bool tensor.*got torch.float32"),
    case("adjust-int-tensor", lambda: LS.adjust(torch.tensor(1)), TypeError,
         r"grads_finite must be a 0-d torch.bool tensor.*got torch.int64"),
    case("static-adjust-vector", lambda: fa.StaticLossScale(8.0).adjust(torch.ones(1, dtype=torch.bool)), ValueError,
         r"grads_finite must be 0-d"),
    case("noop-adjust-int", lambda: fa.NoOpLossScale().adjust(1), TypeError,
         r"grads_finite must be a 0-d torch.bool tensor"),
    case("state-dict-unknown-type", lambda: fa.loss_scale_from_state_dict({"type": "GradScaler"}), ValueError,
         r"unknown type 'GradScaler'; expected one of \['DynamicLossScale', 'NoOpLossScale', 'StaticLossScale'\]"),
    case("state-dict-unknown-field", lambda: fa.loss_scale_from_state_dict({"type": "DynamicLossScale", "bogus": 1}),
         ValueError, r"bad fields for DynamicLossScale.*'bogus'"),
    # --- trees ----------------------------------------------------------------------------------------
    case("select-python-pred", lambda: fa.select_tree(True, TREE_A, TREE_B), TypeError,
         r"pred must be a 0-d torch.bool tensor, got bool"),
    case("select-int-pred", lambda: fa.select_tree(torch.tensor(1), TREE_A, TREE_B), TypeError,
         r"pred must be a 0-d torch.bool tensor, got dtype torch.int64"),
    case("select-vector-pred", lambda: fa.select_tree(torch.tensor([True]), TREE_A, TREE_B), ValueError,
         r"pred must be 0-d \(a scalar\), got shape \(1,\)"),
    case("select-structure", lambda: fa.select_tree(TRUE, TREE_A, {"a": TREE_B["a"]}), ValueError,
         r"a and b must have the same structure"),
    case("select-dtype", lambda: fa.select_tree(TRUE, {"a": torch.ones(2)}, {"a": torch.ones(2).half()}), ValueError,
         r"paired leaves differ in dtype: torch.float32 and torch.float16"),
    case("select-shape", lambda: fa.select_tree(TRUE, {"a": torch.ones(1)}, {"a": torch.ones(3)}), ValueError,
         r"paired leaves must have the same shape, got \(1,\) and \(3,\)"),
    case("select-python-leaves", lambda: fa.select_tree(TRUE, {"a": 1}, {"a": 2}), ValueError,
         r"non-tensor leaves must be equal in a and b, got 1 and 2"),
    # --- grad_and_value -------------------------------------------------------------------------------
    case("gav-vector-loss", _gav(vector_loss, PARAMS, BATCH), ValueError,
         r"the loss must be 0-d \(reduce it, e.g. with .mean\(\)\), got shape \(4,\)"),
    case("gav-int-loss", _gav(int_loss, PARAMS, BATCH), TypeError,
         r"the loss must be a floating tensor, got dtype torch.int64"),
    case("gav-python-loss", _gav(python_loss, PARAMS, BATCH), TypeError,
         r"fun must return a 0-d floating tensor \(or \(loss, aux\) with has_aux=True\), got float"),
    case("gav-aux-missing", _gav(good_loss, PARAMS, BATCH, has_aux=True), TypeError,
         r"with has_aux=True, fun must return a \(loss, aux\) tuple"),
    case("gav-int-param", _gav(good_loss, {**PARAMS, "steps": torch.tensor(3)}, BATCH), TypeError,
         r"argument 0 is differentiated, so every leaf must be a floating tensor; leaf 'steps' is torch.int64"),
    # None: an absent entry for funcamp's trees, a leaf torch.func cannot differentiate (a bare AttributeError before)
    case("gav-none-param", _gav(good_loss, {**PARAMS, "frozen": None}, BATCH), TypeError,
         r"argument 0 is differentiated, and its entry \"\['frozen'\]\" is None, which torch.func cannot"),
    case("gav-number-loss-scale", _gav(good_loss, PARAMS, BATCH, loss_scale=2.0**15), TypeError,
         r"loss_scale must be a funcamp loss scale \(NoOpLossScale, StaticLossScale, DynamicLossScale\), got float"),
    case("gav-not-callable", lambda: fa.grad_and_value("good_loss", LS), TypeError,
         r"fun must be callable, got str"),
    case("gav-argnums-missing", _gav(good_loss, PARAMS, BATCH, argnums=2), ValueError,
         r"argnums=2 but only 2 positional arguments given"),
    case("gav-argnums-string", lambda: fa.grad_and_value(good_loss, LS, argnums="0"), TypeError,
         r"argnums must be an int or a non-empty tuple of ints, got '0'"),
    # --- optimizers -----------------------------------------------------------------------------------
    case("apply-structure", lambda: optim.apply_updates(PARAMS, {"w": PARAMS["w"]}), ValueError,
         r"params and updates must have the same tree structure"),
    case("apply-int-param", lambda: optim.apply_updates({"n": torch.tensor(1)}, {"n": torch.tensor(1.0)}), TypeError,
         r"every param leaf must be a floating-point tensor, got torch.int64"),
    case("apply-shape", lambda: optim.apply_updates(PARAMS, {"b": torch.zeros(1), "w": PARAMS["w"]}), ValueError,
         r"each update must have its parameter's shape \(no broadcasting\), got param \(3,\) and update \(1,\)"),
    case("sgd-negative-lr", lambda: optim.sgd(-0.1), ValueError, r"learning_rate must be >= 0, got -0.1"),
    case("sgd-string-lr", lambda: optim.sgd("0.1"), TypeError,
         r"learning_rate must be a float >= 0 or a schedule .* got str"),
    case("adam-b1-one", lambda: optim.adam(1e-3, b1=1.0), ValueError, r"b1 must be in \[0, 1\), got 1.0"),
    case("clip-zero", lambda: optim.clip_by_global_norm(0.0), ValueError, r"max_norm must be > 0, got 0.0"),
    case("chain-not-transform", lambda: optim.chain(optim.sgd(0.1), "adam"), TypeError,
         r"chain: argument 1 must be a GradientTransformation, got str"),
    # --- train state and step -------------------------------------------------------------------------
    case("state-int-param", lambda: fa.TrainState.create({**PARAMS, "n": torch.tensor(1)}, OPT), TypeError,
         r"every parameter must be a floating tensor; 'n' is torch.int64. Keep integer state in buffers"),
    case("state-not-optimizer", lambda: fa.TrainState.create(PARAMS, "adam"), TypeError,
         r"optimizer must be a funcamp.optim.GradientTransformation, got str"),
    case("state-number-loss-scale", lambda: fa.TrainState.create(PARAMS, OPT, loss_scale=2.0**15), TypeError,
         r"loss_scale must be a funcamp loss scale \(NoOpLossScale, StaticLossScale, DynamicLossScale\), got float"),
    case("step-not-callable", lambda: fa.make_train_step("good_loss", OPT), TypeError,
         r"loss_fn must be callable, got str"),
    case("step-accumulation-zero", lambda: fa.make_train_step(good_loss, OPT, accumulation_steps=0), ValueError,
         r"accumulation_steps must be an int >= 1, got 0"),
    case("step-skips-zero", lambda: fa.make_train_step(good_loss, OPT, max_consecutive_skips=0), ValueError,
         r"max_consecutive_skips must be None or an int >= 1, got 0"),
    case("step-bad-policy", lambda: fa.TrainState.create({"w": torch.zeros(2)}, OPT, policy="compute=float8"),
         ValueError,
         r"unknown dtype 'float8'.*accepted dtype names"),
    case("step-vector-loss", _eager(vector_loss), ValueError, r"the loss must be 0-d .* got shape \(4,\)"),
    case("step-vector-loss-compiled", _compiled(vector_loss), ValueError, r"the loss must be 0-d .* got shape \(4,\)"),
    case("step-int-loss-compiled", _compiled(int_loss), TypeError, r"the loss must be a floating tensor"),
    case("step-int-param", _eager(good_loss, state=STATE.replace(params={**PARAMS, "n": torch.tensor(1)})), TypeError,
         r"every leaf must be a floating tensor; leaf 'n' is torch.int64"),
    case("step-none-param", _eager(good_loss, state=fa.TrainState.create({**PARAMS, "n": None}, OPT)), TypeError,
         r"its entry .* is None, which torch.func cannot differentiate; leave the entry out"),
    case("step-batch-does-not-split", _compiled(good_loss, accumulation_steps=3), ValueError,
         r"accumulation_steps=3, every batch leaf must be a tensor whose first dimension is divisible by 3; "
         r"leaf 'x' is \(4, 4\)"),
    # A mistake in the user's loss_fn surfaces from the compiled step as torch raises it eagerly.
    case("step-float-labels-compiled", _compiled(float_labels_loss), RuntimeError,
         r"^(expected target dtype to be Long or Byte, but got Float|expected scalar type Long but found Float)"
         r"\nfuncamp: raised while torch.compile traced"),
    case("step-wrong-features-compiled", _compiled(wrong_features_loss), RuntimeError,
         r"^mat1 and mat2 shapes cannot be multiplied \(4x3 and 4x3\)\nfuncamp: raised while torch.compile"),
    case("step-swapped-arguments", lambda: fa.make_train_step(good_loss, OPT, compile=False)(BATCH, STATE), TypeError,
         r"the arguments are swapped: got \(batch, state\), with a dict first; call train_step\(state, batch\)"),
    case("step-swapped-arguments-compiled", lambda: fa.make_train_step(good_loss, OPT)(BATCH, STATE), TypeError,
         r"the arguments are swapped: got \(batch, state\), with a dict first; call train_step\(state, batch\)"),
    case("step-params-not-a-state", lambda: fa.make_train_step(good_loss, OPT, compile=False)(PARAMS, BATCH),
         TypeError, r"the first argument must be a funcamp.TrainState, got dict; build it with "
         r"funcamp.TrainState.create\(params, optimizer\)"),
    case("state-from-parameters-iterator", lambda: fa.TrainState.create(torch.nn.Linear(4, 3).parameters(), OPT),
         TypeError, r"got a generator \(model.parameters\(\)\?\), which has no names .* "
         r"funcamp.nn.functionalize\(model, policy\)"),
    case("check-skips-without-option", lambda: fa.check_skips({"loss": torch.tensor(1.0)}), KeyError,
         r"metrics has no 'too_many_skips'; build the step with max_consecutive_skips=N"),
    case("nonfinite-leaf-out-of-range", lambda: fa.nonfinite_leaf_name(PARAMS, 5), IndexError,
         r"index 5 out of range for 2 floating parameters"),
]  # fmt: skip


# --- checkpoints: each case gets the paths of the files made by the ``files`` fixture --------------------
OTHER_STATE = fa.TrainState.create({"w": torch.ones(4, 3)}, OPT)  # no "b"
WIDER_STATE = fa.TrainState.create({"b": torch.zeros(5), "w": torch.ones(4, 5)}, OPT)
HALF_STATE = fa.TrainState.create({k: v.half() for k, v in PARAMS.items()}, OPT)
MismatchError, CorruptError = checkpoint.CheckpointMismatchError, checkpoint.CorruptCheckpointError
CHECKPOINT_CASES = [
    case("load-other-structure", lambda f: checkpoint.load(f["good"], like={"state": OTHER_STATE}), MismatchError,
         r"ckpt.pt: state.params has other keys than like: missing \[\], unexpected \['b'\]"),
    case("load-other-shape", lambda f: checkpoint.load(f["good"], like={"state": WIDER_STATE}), MismatchError,
         r"state.params.b has shape \(3,\) in the checkpoint, \(5,\) in like"),
    case("load-other-dtype", lambda f: checkpoint.load(f["good"], like={"state": HALF_STATE}), MismatchError,
         r"state.params.b has dtype torch.float32 in the checkpoint, torch.float16 in like"),
    case("load-other-kind", lambda f: checkpoint.load(f["good"], like={"state": PARAMS}), MismatchError,
         r"state is a dataclass funcamp.train.TrainState in the checkpoint but a dict in like"),
    case("load-truncated", lambda f: checkpoint.load(f["truncated"]), CorruptError,
         r"truncated.pt: not a readable funcamp checkpoint \(truncated or corrupt\?\)"),
    case("load-plain-torch-file", lambda f: checkpoint.load(f["plain"]), CorruptError,
         r"plain.pt: not a funcamp checkpoint \(no format='funcamp.checkpoint' header\)"),
    case("load-missing", lambda f: checkpoint.load(f["missing"]), FileNotFoundError,
         r"no checkpoint at '.*missing.pt'"),
    case("load-path-not-a-path", lambda f: checkpoint.load(3), TypeError, r"path must be a str or path, got int"),
    case("save-missing-directory", lambda f: checkpoint.save(f["missing_dir"], {"state": STATE}), FileNotFoundError,
         r"directory '.*no-such-dir' of '.*' does not exist"),
    case("save-unsupported-leaf", lambda f: checkpoint.save(f["good"], {"state": STATE, "fn": good_loss}), TypeError,
         r"cannot save fn of type function; a checkpoint holds tensors, None"),
    case("save-path-not-a-path", lambda f: checkpoint.save(None, {"state": STATE}), TypeError,
         r"path must be a str or path, got NoneType"),
    case("save-torch-order", lambda f: checkpoint.save({"state": STATE}, f["good"]), TypeError,
         r"path must be a str or path, got dict; the arguments are swapped: save\(path, tree\), the path first"),
    case("load-device-as-like", lambda f: checkpoint.load(f["good"], "cpu"), TypeError,
         r"like must be None or a tree shaped like the saved one, got 'cpu'; .* map_location='cpu'"),
    case("load-torch-device-as-like", lambda f: checkpoint.load(f["good"], torch.device("cpu")), TypeError,
         r"like must be None or a tree .* got device\(type='cpu'\)"),
]  # fmt: skip


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("ckpt")
    checkpoint.save(d / "ckpt.pt", {"state": STATE})
    data = (d / "ckpt.pt").read_bytes()
    (d / "truncated.pt").write_bytes(data[: len(data) // 2])
    torch.save({"params": PARAMS}, d / "plain.pt")
    return {
        "good": d / "ckpt.pt",
        "truncated": d / "truncated.pt",
        "plain": d / "plain.pt",
        "missing": d / "missing.pt",
        "missing_dir": d / "no-such-dir" / "ckpt.pt",
    }


@pytest.mark.parametrize("call, exc, match", CHECKPOINT_CASES)
def test_bad_checkpoint_call_is_refused(files, call, exc, match):
    directory = files["good"].parent
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    watched = [_snapshot(t) for t in WATCHED]
    with pytest.raises(exc, match=match) as info:
        call(files)
    assert type(info.value) is exc
    # The files on disk (the good checkpoint included) are byte for byte as before; no temporary file.
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    assert all(_unchanged(t, s) for t, s in zip(WATCHED, watched))
    reloaded = checkpoint.load(files["good"], like={"state": STATE})["state"]
    assert all(torch.equal(x, y) for x, y in zip(_tree.tree_leaves(reloaded), _tree.tree_leaves(STATE)))


def _snapshot(tree: Any) -> list[tuple[Any, Any]]:
    return [(x, x.clone() if isinstance(x, torch.Tensor) else x) for x in _tree.tree_leaves(tree)]


def _unchanged(tree: Any, snapshot: list[tuple[Any, Any]]) -> bool:
    leaves = _tree.tree_leaves(tree)
    return len(leaves) == len(snapshot) and all(
        x is obj and (torch.equal(x, copy) if isinstance(x, torch.Tensor) else x == copy)
        for x, (obj, copy) in zip(leaves, snapshot)
    )


@pytest.mark.parametrize("call, exc, match", CASES)
def test_bad_input_is_refused(call, exc, match):
    before = [_snapshot(t) for t in WATCHED]
    with pytest.raises(exc, match=match) as info:
        call()
    assert type(info.value) is exc  # the specific type, not a subclass such as dynamo's errors
    assert all(_unchanged(t, s) for t, s in zip(WATCHED, before)), "a refused call changed a shared object"


def _fields(x: Any) -> dict[str, Any]:
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in x.state_dict().items()}


def test_positional_arguments_mean_what_they_mean_in_jmp_optax_torch():
    """Calls written in the counterpart's positional order build what the same call builds there (the refused
    orders are in CASES): jmp's tests write DynamicLossScale(loss_scale, counter, period, factor)."""
    scale, counter = torch.tensor(2.0**15), torch.tensor(5, dtype=torch.int32)
    jmp_like = fa.DynamicLossScale(scale, counter, 2000, 2, 0.5)  # jmp: loss_scale, counter, period, factor, min
    assert _fields(jmp_like) == _fields(
        fa.DynamicLossScale(loss_scale=scale, counter=counter, period=2000, growth_factor=2, min_loss_scale=0.5)
    )
    assert int(jmp_like.hysteresis_left) == 1 and jmp_like.hysteresis == 1
    grown = jmp_like
    for _ in range(1995):  # jmp's rule: the counter wraps at period, then the scale doubles
        grown = grown.adjust(TRUE)
    assert float(grown.loss_scale) == 2.0**16 and int(grown.counter) == 0
    assert fa.Policy(torch.float32, torch.bfloat16, torch.float16) == fa.get_policy("p=f32,c=bf16,o=f16")  # jmp
    assert float(fa.StaticLossScale(4.0).loss_scale) == 4.0
    # optax's positional orders (the leading arguments funcamp shares with it), torch.nn.Linear's for fp8.
    params = {"w": torch.tensor([1.0, -2.0, 3.0])}
    grads = [{"w": torch.tensor([0.5, 0.25, -1.0])}, {"w": torch.tensor([-0.5, 1.0, 2.0])}]
    same = {
        "sgd": (optim.sgd(0.1, 0.9, True), optim.sgd(learning_rate=0.1, momentum=0.9, nesterov=True)),
        "sgd-none": (optim.sgd(0.1, None), optim.sgd(learning_rate=0.1, momentum=0.0)),
        "adam": (optim.adam(0.1, 0.8, 0.9, 1e-3), optim.adam(learning_rate=0.1, b1=0.8, b2=0.9, eps=1e-3)),
        "adamw": (optim.adamw(0.1, 0.8, 0.9, 1e-3), optim.adamw(learning_rate=0.1, b1=0.8, b2=0.9, eps=1e-3)),
        "adam-eps-root": (optim.adam(0.1, 0.8, 0.9, 1e-3, 1e-2), optim.adam(0.1, 0.8, 0.9, 1e-3, eps_root=1e-2)),
        "adamw-eps-root": (optim.adamw(0.1, 0.8, 0.9, 1e-3, 1e-2), optim.adamw(0.1, 0.8, 0.9, 1e-3, eps_root=1e-2)),
        "lion": (optim.lion(0.1, 0.8, 0.9), optim.lion(learning_rate=0.1, b1=0.8, b2=0.9)),
        "scale_by_adam": (optim.scale_by_adam(0.8, 0.9, 1e-3, 1e-4), optim.scale_by_adam(b1=0.8, b2=0.9, eps=1e-3,
                                                                                         eps_root=1e-4)),
        "trace": (optim.trace(0.9, True), optim.trace(decay=0.9, nesterov=True)),
        "add_decayed_weights": (optim.add_decayed_weights(0.1, {"w": True}),
                                optim.add_decayed_weights(weight_decay=0.1, mask={"w": True})),
    }  # fmt: skip
    for name, (positional, keywords) in same.items():
        a, b = params, params
        sa, sb = positional.init(params), keywords.init(params)
        for g in grads:
            ua, sa = positional.update(g, sa, a)
            ub, sb = keywords.update(g, sb, b)
            a, b = optim.apply_updates(a, ua), optim.apply_updates(b, ub)
        assert torch.equal(a["w"], b["w"]) and not torch.equal(a["w"], params["w"]), name
    schedules = {
        "cosine_decay": (optim.cosine_decay(1.0, 10, 0.1),
                         optim.cosine_decay(init_value=1.0, decay_steps=10, alpha=0.1)),
        "cosine_decay-exponent": (optim.cosine_decay(1.0, 10, 0.1, 2.0),
                                  optim.cosine_decay(init_value=1.0, decay_steps=10, alpha=0.1, exponent=2.0)),
        "linear_schedule": (optim.linear_schedule(1.0, 0.5, 10),
                            optim.linear_schedule(init_value=1.0, end_value=0.5, transition_steps=10)),
    }  # fmt: skip
    for name, (positional, keywords) in schedules.items():
        assert all(torch.equal(positional(t), keywords(t)) for t in range(12)), name
    from funcamp import fp8

    layer = fp8.Float8Linear(32, 16, False)  # torch.nn.Linear(in_features, out_features, bias)
    assert layer.in_features == 32 and layer.out_features == 16 and layer.bias is None


def test_catalogue_size():
    # The README's closing note quotes this count.
    assert len(CASES) + len(CHECKPOINT_CASES) >= 30
    assert len({p.id for p in CASES + CHECKPOINT_CASES}) == len(CASES) + len(CHECKPOINT_CASES)


def test_shared_objects_still_work():
    # The refused calls above did not break the objects they were given: a good step still runs.
    state, metrics = fa.make_train_step(good_loss, OPT, compile=False)(STATE, BATCH)
    assert bool(metrics["grads_finite"]) and int(state.step) == 1
    assert float(LS.adjust(TRUE).loss_scale) == 2.0**10


@pytest.mark.parametrize("loss_fn", [float_labels_loss, wrong_features_loss], ids=["float-labels", "wrong-features"])
def test_loss_fn_error_from_compiled_step_is_short_and_says_where(loss_fn, capfd):
    # Dynamo raises TorchRuntimeError (about 45 lines, fake tensors) after logging a ~20-line traceback; the
    # user sees torch's own eager error, with one note, and none of the fake-tensor log lines.
    with pytest.raises(RuntimeError) as info:
        _compiled(loss_fn)()
    assert not isinstance(info.value, torch._dynamo.exc.TorchDynamoException)
    assert info.value.__notes__ == [fa.train.EAGER_RERUN_NOTE]
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert "FakeTensor" not in str(info.value) and "\n" not in str(info.value)
    assert "fake_tensor" not in capfd.readouterr().err
    # The traceback ends in the user's function, where eager mode would point.
    assert info.traceback[-2].name == loss_fn.__name__ or info.traceback[-1].name == loss_fn.__name__
