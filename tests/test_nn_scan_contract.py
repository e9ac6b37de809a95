"""``scan=`` over a ``ModuleList`` checks, from the model's source, that the model applies the list as the scan does.

Each refused forward below is one that a scan would compute otherwise than the module (before the check, the
compiled step silently ran it as one plain pass over the layers); each accepted one is a loop the scan equals.
"""

from __future__ import annotations

import textwrap

import pytest
import torch
from torch import nn

import funcamp as fa
from funcamp.nn._scan_contract import violation

POLICY = "params=float32,compute=bfloat16,output=float32"


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, *args, **kwargs):
        return x + self.fc(x)


def _model(forward_source: str, *, outer: str | None = None) -> nn.Module:
    """A module with ``self.blocks`` (three identical layers) whose forward is ``forward_source``."""
    namespace = {"torch": torch, "nn": nn}
    exec(textwrap.dedent(forward_source), namespace)  # noqa: S102
    methods = {k: v for k, v in namespace.items() if callable(v) and k not in ("torch", "nn")}
    cls = type("Net", (nn.Module,), methods)
    net = cls.__new__(cls)
    nn.Module.__init__(net)
    net.blocks = nn.ModuleList(_Layer() for _ in range(3))
    net.n = 2
    return net


# Classes written in this file (their source is readable), one per forward.


class _Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Layer() for _ in range(3))

    def forward(self, x, mask=None, **kwargs):
        assert len(self.blocks) == 3
        first = self.blocks[0].fc.weight.shape
        for block in self.blocks:
            x = block(x, mask, self.blocks[0].fc.in_features, scale=2.0, **kwargs)
        return x.sum() + first[0]


class _Helper(_Plain):
    def forward(self, x):
        return self.body(x).sum()

    def body(self, x):
        for block in self.blocks[: len(self.blocks)]:
            x = block(x)
        return x


class _Outer(nn.Module):
    """minGPT's layout: the list under a ModuleDict, looped over from the module above it."""

    def __init__(self):
        super().__init__()
        self.transformer = nn.ModuleDict({"h": nn.ModuleList(_Layer() for _ in range(3))})

    def forward(self, x):
        for block in self.transformer.h:
            x = block(x)
        return x


class _Residual(_Plain):
    def forward(self, x):
        for block in self.blocks:
            x = block(x) + x
        return x


class _Collect(_Plain):
    def forward(self, x):
        hidden = []
        for block in self.blocks:
            x = block(x)
            hidden.append(x)
        return x, hidden


class _Enumerate(_Plain):
    def forward(self, x):
        for i, block in enumerate(self.blocks):
            x = block(x, i)
        return x


class _PerLayerArgument(_Plain):
    def forward(self, x, masks):
        for block in self.blocks:
            x = block(x, masks[block.fc.in_features])
        return x


class _OtherInput(_Plain):
    def forward(self, x, h):
        for block in self.blocks:
            x = block(h)
        return x


class _LoopVariableAfter(_Plain):
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return block.fc(x)


class _Comprehension(_Plain):
    def forward(self, x):
        return sum(block(x) for block in self.blocks)


class _Indexed(_Plain):
    def forward(self, x):
        for i in range(len(self.blocks)):
            x = self.blocks[i](x)
        return x


class _HelperResidual(_Plain):
    def forward(self, x):
        return self.body(x)

    def body(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


@pytest.mark.parametrize(
    "cls, name",
    [(_Plain, "blocks"), (_Helper, "blocks"), (_Outer, "transformer.h")],
    ids=["plain-with-further-arguments", "helper-method-and-slice", "minGPT-ModuleDict"],
)
def test_loops_of_the_contract_are_accepted(cls, name):
    assert violation(cls(), name) is None


@pytest.mark.parametrize(
    "cls, message",
    [
        (_Residual, r"doing 'x = block\(x\) \+ x'"),
        (_Collect, "doing 2 statements per layer"),
        (_Enumerate, "with the target '\\(i, block\\)'|enumerate"),
        (_PerLayerArgument, "passing 'masks\\[block.fc.in_features\\]'"),
        (_OtherInput, r"doing 'x = block\(h\)'"),
        (_LoopVariableAfter, "reads the loop variable 'block' after the loop"),
        (_Comprehension, "other than as 'for layer in self.blocks"),
        (_Indexed, "no loop 'for layer in self.blocks"),
        (_HelperResidual, r"_HelperResidual.body loops over self.blocks doing 'x = x \+ block\(x\)'"),
    ],
    ids=["residual", "collect", "enumerate", "per-layer-arg", "other-input", "after", "genexpr", "indexed", "helper"],
)
def test_other_uses_are_refused_with_where_and_why(cls, message):
    why = violation(cls(), "blocks")
    assert why is not None and __import__("re").search(message, why), why
    with pytest.raises(ValueError, match="scan='blocks' cannot stack this run: "):
        fa.nn.functionalize(cls(), POLICY, scan="blocks")


def test_unreadable_source_is_refused_not_assumed():
    net = _model(
        """
        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x
        """
    )
    assert "cannot be read" in violation(net, "blocks")


def test_the_refused_residual_would_compute_otherwise(monkeypatch):
    """Planted: with the check off, ``scan="blocks"`` on the residual loop compiles a step whose loss is not the
    model's (the scan applies the three layers and adds ``x`` once): what the refusal prevents."""
    torch.manual_seed(0)
    net, x = _Residual(), torch.randn(2, 8)
    monkeypatch.setattr("funcamp.nn._scan_contract.violation", lambda module, name: None)
    apply_fn, params = fa.nn.functionalize(net, "float32", scan="blocks")
    opt = fa.optim.sgd(0.0)

    def loss_fn(p, batch):
        return apply_fn(p, batch).square().mean()

    losses = []
    for compile in (False, True):
        step = fa.make_train_step(loss_fn, opt, compile=compile, backend="aot_eager")
        _, metrics = step(fa.TrainState.create(params, opt), x)
        losses.append(metrics["loss"])
    assert not torch.allclose(losses[0], losses[1])


# scan="auto": the checked runs deep enough are stacked; every other candidate says why not.


class _Deep(nn.Module):
    def __init__(self, depth, residual=False):
        super().__init__()
        self.head = nn.Sequential(nn.Linear(8, 8), nn.ReLU())  # two classes: not a candidate
        self.blocks = nn.ModuleList(_Layer() for _ in range(depth))
        self.residual = residual

    def forward(self, x):
        x = self.head(x)
        for block in self.blocks:
            x = block(x)
        return x


class _DeepResidual(_Deep):
    def forward(self, x):
        for block in self.blocks:
            x = x + block(x)
        return x


def _differing():
    model = _Deep(8)
    model.blocks[3].fc = nn.Linear(8, 8, bias=False)
    return model


def _elsewhere():
    """A CPU model, as if the rule had measured only other devices (no second device to move it to here)."""
    import funcamp.nn._scan as scan

    scan._AUTO_DEVICES = ("cuda",)  # the test's monkeypatch restores it
    return _Deep(8)


def _holds_scan(apply_fn, params):
    seen = []

    def backend(gm, example_inputs):
        seen.append(any("scan" in str(n.target) for n in gm.graph.nodes if n.op == "call_function"))
        return gm.forward

    torch.compile(apply_fn, fullgraph=True, backend=backend)(params, torch.randn(2, 8))
    return seen == [True]


def test_auto_scans_a_deep_checked_run_and_says_so(caplog):
    from funcamp.nn._scan import AUTO_MIN_LAYERS

    with caplog.at_level("INFO", logger="funcamp.nn"):
        apply_fn, params = fa.nn.functionalize(_Deep(AUTO_MIN_LAYERS), POLICY, scan="auto")
    assert apply_fn.scan == ("blocks",)
    assert dict(apply_fn.scan_report) == {"blocks": f"scanned: {AUTO_MIN_LAYERS} layers >= 8 (scan='auto')"}
    assert "functionalize(scan='auto'): blocks scanned" in caplog.text
    assert _holds_scan(apply_fn, params)


@pytest.mark.parametrize(
    "model, why",
    [
        (lambda: _Deep(3), "unrolled: 3 layers < 8"),
        (lambda: _DeepResidual(8), r"unrolled: _DeepResidual.forward loops over self.blocks doing 'x = x \+ block"),
        (_differing, r"unrolled: cannot stack this run: blocks.3 differs from blocks.0|blocks.3 differs"),
        (_elsewhere, r"parameters on \['cpu'\]; scan='auto' has been measured on CPUs only"),
    ],
    ids=["shallow", "residual", "differing-layer", "unmeasured-device"],
)
def test_auto_leaves_other_runs_unrolled_with_the_reason(model, why, monkeypatch):
    import funcamp.nn._scan as scan

    monkeypatch.setattr(scan, "_AUTO_DEVICES", scan._AUTO_DEVICES)  # restored after _elsewhere changes it
    apply_fn, params = fa.nn.functionalize(model(), POLICY, scan="auto")
    assert apply_fn.scan == ()
    assert list(apply_fn.scan_report) == ["blocks"]
    assert __import__("re").search(why, apply_fn.scan_report["blocks"]), apply_fn.scan_report
    assert not _holds_scan(apply_fn, params)


def test_without_scan_nothing_is_reported():
    apply_fn, _ = fa.nn.functionalize(_Deep(8), POLICY)
    assert apply_fn.scan == () and dict(apply_fn.scan_report) == {}


class _ByName(_Plain):
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        for other in getattr(self, "blocks"):  # noqa: B009 - the point: a use by name
            x = other(x) + x
        return x


class _Shared(nn.Module):
    """The run registered twice: under ``blocks`` and inside a child that loops over it its own way."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Layer() for _ in range(3))
        self.child = nn.Module()
        self.child.layers = self.blocks

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_uses_the_check_cannot_follow_are_refused():
    assert "names 'blocks' in a string" in violation(_ByName(), "blocks")
    assert "registered under several names (blocks, child.layers)" in violation(_Shared(), "blocks")


# Found by trying to break the check (each was accepted, and computed otherwise, before the check read these paths).


class _ThroughSuper(_Residual):
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return super().forward(x)


def _residual_helper(model, x):
    for block in model.blocks:
        x = x + block(x)
    return x


class _ThroughFunction(_Plain):
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return _residual_helper(self, x)


class _ThroughAlias(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = _Helper()

    def forward(self, x):
        x = self.body(x)
        body = self.body
        for block in body.blocks:
            x = x + block(x)
        return x


class _ThroughType(_Plain):
    def tail(self, x):
        for block in self.blocks:
            x = x * block(x)
        return x

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return type(self).tail(self, x)


class _LambdaForward(_Plain):
    forward = lambda self, x: x  # noqa: E731 - the point: not a def


class _ReusedName(_Plain):
    def forward(self, x):
        for block in self.blocks[:1]:
            x = block(x)
        x = x * 2
        for block in self.blocks[1:]:
            x = block(x, self.blocks[-1].fc.in_features)
        return x


@pytest.mark.parametrize(
    "cls, message",
    [
        (_ThroughSuper, r"_Residual.forward loops over self.blocks doing 'x = block\(x\) \+ x'"),
        (_ThroughFunction, r"_residual_helper loops over model.blocks doing 'x = x \+ block\(x\)'"),
        (_ThroughAlias, "uses self.body other than by calling it or reading another attribute"),
        (_ThroughType, r"hands self to type\(self\).tail, which the check cannot read"),
        (_LambdaForward, "is not a def"),
    ],
    ids=["super", "function", "alias", "type", "lambda"],
)
def test_code_reached_other_ways_is_read_or_refused(cls, message):
    name = "body.blocks" if cls is _ThroughAlias else "blocks"
    why = violation(cls(), name)
    assert why is not None and __import__("re").search(message, why), why


def test_a_name_reused_by_two_loops_and_a_negative_index_are_accepted():
    assert violation(_ReusedName(), "blocks") is None


def test_a_differing_layer_is_named_in_a_few_words():
    model = _Plain()
    model.blocks[2].fc.extra = 7
    with pytest.raises(ValueError, match=r"blocks\.2 differs from blocks\.0 in module fc's attribute extra: 7 vs None"):
        fa.nn.functionalize(model, POLICY, scan="blocks")


class _UnderAutocast(_Plain):
    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            for block in self.blocks:
                x = block(x)
        return x


def test_a_loop_under_autocast_is_refused_before_it_fails_to_compile():
    assert "under autocast" in violation(_UnderAutocast(), "blocks")
