"""Compiled or eager, decided once: the step's plan answers ``funcamp._scope.compiling()``; torch's flag only
outside a compiled plan. And the map of docs/internals.md holds: at most 7 calls of torch's ``is_compiling()`` /
``is_dynamo_compiling()`` in funcamp/, at most 6 ambient scopes."""

from __future__ import annotations

import ast
import pathlib

import torch

from funcamp import _scope
from funcamp.train import StepPlan

ROOT = pathlib.Path(__file__).resolve().parent.parent / "funcamp"
EAGER, COMPILED = StepPlan(False, None, False), StepPlan(True, "inductor", False)


def _traced(fn):
    return torch.compile(fn, fullgraph=True, backend="eager")


def _answer(x):
    return x + 1 if _scope.compiling() else x


def test_outside_every_step_torchs_flag_answers():
    """A model under the user's own torch.compile takes its compiled branches, eagerly its eager ones."""
    assert not _scope.compiling()
    assert float(_answer(torch.zeros(()))) == 0.0
    assert float(_traced(_answer)(torch.zeros(()))) == 1.0


def test_a_compiled_plan_answers_at_any_depth_an_eager_one_defers_to_torch():
    """A compiled plan says compiled without any tracer (as capture.check traces), also around an eager step's
    body; an eager plan says eager, unless the user's own torch.compile traces a region inside it. Planted: the
    plan alone deciding (an eager plan answering False under Dynamo) fails the last assertion."""
    assert _scope.in_step(COMPILED, _scope.compiling)
    assert _scope.in_step(COMPILED, _scope.in_step, EAGER, _scope.compiling)
    assert not _scope.in_step(EAGER, _scope.compiling)
    assert float(_scope.in_step(EAGER, _traced(_answer), torch.zeros(()))) == 1.0


def _calls(names: tuple[str, ...]) -> list[str]:
    found = []
    for f in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) in names:
                found.append(f"{f.relative_to(ROOT)}:{node.lineno}")
    return found


def test_at_most_seven_compiled_or_eager_forks_of_torchs_own():
    """docs/internals.md, "Compiled and eager": every other fork asks the plan (``_scope.compiling()``)."""
    forks = _calls(("is_compiling", "is_dynamo_compiling"))
    assert len(forks) <= 7, forks


def test_at_most_six_ambient_scopes():
    """docs/internals.md, "Ambient state": ``Scope()`` instances and ``ContextVar``s together."""
    scopes = _calls(("Scope", "ContextVar"))
    assert len(scopes) <= 6, scopes
