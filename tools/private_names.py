"""Count the private names one module of funcamp uses from another: ``from funcamp.x import _name`` and
``x._name`` where ``x`` is a funcamp module the file imported (``_name`` not itself a module, ``x`` not the file).

What another module needs is its public name: inside a private module (``funcamp/tune/_keys.py``) that is a name
without the underscore; across packages, a name of the package's public API. Examples::

    python tools/private_names.py            # the count
    python tools/private_names.py --list     # each name, how often, and who uses it
"""

from __future__ import annotations

import argparse
import ast
import collections
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent / "funcamp"


def _modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    mods = {}
    for f in sorted(root.rglob("*.py")):
        parts = [root.name, *f.relative_to(root).with_suffix("").parts]
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return mods


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def uses(root: pathlib.Path = ROOT) -> list[tuple[str, str]]:
    """``(using module, dotted private name)`` for each use, in file order."""
    mods = _modules(root)
    rows = []
    for m, f in mods.items():
        pkg = m if f.name == "__init__.py" else m.rpartition(".")[0]
        tree = ast.parse(f.read_text())
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                if not base.startswith(root.name):
                    continue
                for a in node.names:
                    full = f"{base}.{a.name}"
                    if full in mods:
                        aliases[a.asname or a.name] = full
                    elif _private(a.name) and base != m:
                        rows.append((m, full))
            elif isinstance(node, ast.Import):
                aliases.update({a.asname or a.name: a.name for a in node.names if a.name in mods})
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                target = aliases[node.value.id]
                if _private(node.attr) and f"{target}.{node.attr}" not in mods and target != m:
                    rows.append((m, f"{target}.{node.attr}"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--list", action="store_true", help="each name, its count and its users")
    found = uses()
    if parser.parse_args().list:
        users = collections.defaultdict(set)
        for m, name in found:
            users[name].add(m)
        for name, n in collections.Counter(name for _, name in found).most_common():
            print(f"{n:3d} {name}  <- {', '.join(sorted(users[name]))}")
    print(len(found))


if __name__ == "__main__":
    main()
