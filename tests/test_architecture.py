"""The package's shape: imports go downward only (no cycle, imports inside functions and under
``TYPE_CHECKING`` included); nothing below the top imports the top package, and only the top package and
the tools built over the step import the train package.

The import graph is read from the source (``ast``), not from ``sys.modules``, so an import inside a function
counts although it runs late. Each check has a self-test on a small package planted in a temporary
directory, so that a finder that found nothing could not pass for a package without cycles.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "funcamp"

#: The modules outside funcamp.train allowed to import from it, the tools over the step: the top package (the
#: public names), funcamp.debug (reruns the loss with the step's calling convention) and funcamp.capture's check
#: (it traces a built step's body within its plan made compiled).
TRAIN_IMPORTERS = {"funcamp", "funcamp.debug", "funcamp.capture._check"}


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """``{module: {modules of the same package it imports}}`` for the package at ``root``.

    ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module, else of ``pkg``.
    """
    top = root.name
    mods = {}
    for f in sorted(root.rglob("*.py")):
        parts = [top, *f.relative_to(root).with_suffix("").parts]
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f

    def target(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, f in mods.items():
        pkg = m if f.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            for n in names:
                t = target(n) if n.split(".")[0] == top else None
                if t and t != m:
                    edges[m].add(t)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One path ``[m, ..., m]`` per import cycle (each set of modules once)."""
    seen: set[frozenset[str]] = set()
    out = []

    def reach(a: str, b: str, path: list[str]) -> list[str] | None:
        if a == b and path:
            return path
        for w in sorted(edges[a]):
            if w not in path:
                r = reach(w, b, [*path, w])
                if r:
                    return r
        return None

    for m in sorted(edges):
        p = reach(m, m, [])
        if p and frozenset(p) not in seen:
            seen.add(frozenset(p))
            out.append([m, *p])
    return out


def upward(edges: dict[str, set[str]]) -> list[str]:
    """Imports of the top package from inside it, and of the train package from outside it (bar
    :data:`TRAIN_IMPORTERS`)."""
    top, train = "funcamp", "funcamp.train"
    bad = []
    for m, targets in sorted(edges.items()):
        for t in sorted(targets):
            if t == top:
                bad.append(f"{m} imports the top package {top}")
            elif (t == train or t.startswith(train + ".")) and not (m == train or m.startswith(train + ".")):
                if m not in TRAIN_IMPORTERS:
                    bad.append(f"{m} imports {t} (the train package) from below")
    return bad


def _plant(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    root = tmp_path / "funcamp"
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_no_import_cycle() -> None:
    found = cycles(import_graph(ROOT))
    assert not found, "import cycles in funcamp/: " + "; ".join(" -> ".join(c) for c in found)


def test_nothing_imports_upward() -> None:
    bad = upward(import_graph(ROOT))
    assert not bad, "\n".join(bad)


def test_the_finders_find_planted_faults(tmp_path: pathlib.Path) -> None:
    """A cycle through an import inside a function and one under TYPE_CHECKING, an import of the top
    package and one of the train package from below: each is found, and a clean package passes."""
    root = _plant(
        tmp_path,
        {
            "__init__.py": "from funcamp import a, train\n",
            "a.py": "def f():\n    from funcamp.b import g\n",
            "b.py": "from funcamp import a\n",
            "e.py": "from funcamp import __version__\n",
            "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from funcamp.d import X\n",
            "d.py": "from .c import Y\nfrom funcamp.train import Err\n",
            "train/__init__.py": "from funcamp.train._step import step\n",
            "train/_step.py": "from funcamp import a\n",
        },
    )
    edges = import_graph(root)
    assert edges["funcamp.a"] == {"funcamp.b"} and edges["funcamp.d"] == {"funcamp.c", "funcamp.train"}
    assert cycles(edges) == [["funcamp.a", "funcamp.b", "funcamp.a"], ["funcamp.c", "funcamp.d", "funcamp.c"]]
    assert upward(edges) == [
        "funcamp.d imports funcamp.train (the train package) from below",
        "funcamp.e imports the top package funcamp",
    ]
    clean = _plant(tmp_path / "clean", {"__init__.py": "from funcamp import a\n", "a.py": "import torch\n"})
    assert cycles(import_graph(clean)) == [] and upward(import_graph(clean)) == []


def _members(protocol: type) -> set[str]:
    return {n for n in vars(protocol) if not n.startswith("_")} | set(getattr(protocol, "__annotations__", {}))


def _called_on(path: pathlib.Path, name: str) -> set[str]:
    """The attributes read on a variable ``name`` in the file at ``path`` (``layout.stats(...)`` -> ``stats``)."""
    tree = ast.parse(path.read_text())
    return {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == name
    }


def test_layout_interface_is_split_by_caller() -> None:
    """The stages read only :class:`StageLayout`'s members of their layout, ``make_train_step`` only
    ``BuildLayout``'s on the host, the optimizer's transforms only ``StepLayout``'s of the scope's; every layout
    class has all of them. (Planted: a stage reading ``layout.group`` fails the first assertion.)"""
    from funcamp import _scope
    from funcamp.train import _layout

    stage, build, step = _members(_layout.StageLayout), _members(_layout.BuildLayout), _members(_scope.StepLayout)
    train, optim = ROOT / "train", ROOT / "optim"
    assert _called_on(train / "_stages.py", "layout") | _called_on(train / "_probes.py", "layout") <= stage
    assert _called_on(train / "_step.py", "built") | _called_on(train / "_step.py", "layout") <= build
    assert _called_on(optim / "transforms.py", "layout") | _called_on(optim / "low_precision.py", "step") <= step
    for cls in (_layout.SingleProcess, _layout.DataParallel, _layout.Sharded):
        assert all(hasattr(cls, m) for m in stage | build | step), cls
    assert issubclass(_layout.Sharded, _scope.GathersAtUse) and not issubclass(
        _layout.DataParallel, _scope.GathersAtUse
    )


def _layouts() -> dict[str, object]:
    import torch

    from funcamp import sharding
    from funcamp.train import _layout

    class Group:  # what DataParallel asks of a process group when it is built
        def size(self) -> int:
            return 2

    one = sharding.shard_layout({"w": torch.zeros(4, 2)}, None)
    return {
        "SingleProcess": _layout.SingleProcess(),
        "DataParallel": _layout.DataParallel(Group()),
        "Sharded": _layout.Sharded(one, None),
    }


def test_layouts_keep_the_checked_contract() -> None:
    """The layout Protocols are the checked contract: every layout is an instance of the runtime-checkable
    :class:`StageLayout`, :class:`BuildLayout` and :class:`funcamp._scope.StepLayout`; only the sharded one is a
    :class:`funcamp._scope.GathersAtUse` (what ``funcamp.nn``'s parameter uses ask) and lacks whole gradients
    (the capability the telemetry probe asks); a layout missing a member is none of them, and the layout scope
    could not pass for one. (Planted: ``SingleProcess.whole_gradients`` removed, or ``Sharded``'s set True: fails.)"""
    from funcamp import _scope
    from funcamp.train import _layout

    for name, layout in _layouts().items():
        for protocol in (_layout.StageLayout, _layout.BuildLayout, _scope.StepLayout):
            assert isinstance(layout, protocol), (name, protocol)
        assert isinstance(layout, _scope.GathersAtUse) == (name == "Sharded"), name
        assert layout.whole_gradients == (name != "Sharded"), name

    class Partial:  # the stages' members, not the optimizer's
        size, whole_gradients = 1, True

        def gather(self, params: object) -> object:
            return params

    assert not isinstance(Partial(), _layout.StageLayout) and not isinstance(Partial(), _scope.StepLayout)
    assert not isinstance(Partial(), _scope.GathersAtUse)
