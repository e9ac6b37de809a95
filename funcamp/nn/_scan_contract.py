"""Whether a model's code applies a ``ModuleList`` the way ``scan=`` computes it: read from its source.

A scanned ``ModuleList`` yields, under ``torch.compile``, one object that applies the whole run (see
:mod:`funcamp.nn._scan`). That equals the model only where the model's code does nothing with the list but

    for layer in self.blocks:                     # or self.blocks[<slice>], or self.transformer.h from above
        x = layer(x, <the same further arguments>)

so :func:`violation` reads the code of every module above the run (its classes' ``forward`` and the methods it
calls on ``self``, transitively) and returns why not, or ``None``: each mention of the run must be such a loop
(``len()`` of it is allowed), at least one loop must exist, its body must be that one assignment, the further
arguments names, attributes, constants or ``*args``/``**kwargs`` of names (the same for every layer), and the loop
variable unused outside the loop. Code whose source Python cannot give (a class made by ``exec``, a C extension)
cannot be checked and is reported as such. The check reads code; it runs nothing.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from typing import Any

from torch import nn

__all__ = ["violation"]


def violation(module: nn.Module, name: str) -> str | None:
    """``None`` when every use of the ``ModuleList`` at ``name`` in the code above it is a loop of the contract;
    else one sentence saying where and how the code differs (or that it could not be read)."""
    parts = name.split(".")
    run = module.get_submodule(name)
    paths = [n for n, m in module.named_modules(remove_duplicate=False) if m is run]
    if len(paths) > 1:
        return f"the run is registered under several names ({', '.join(paths)}); the code using the others is not read"
    loops = 0
    for depth in range(len(parts)):
        owner_name = ".".join(parts[:depth])
        owner = module.get_submodule(owner_name) if owner_name else module
        chain = parts[depth:]
        for qualname, tree, self_name in _methods(owner):
            if isinstance(tree, str):
                return f"the source of {qualname} cannot be read to check how it applies {name!r} ({tree})"
            found, why = _uses(tree, self_name, chain)
            if why is not None:
                return f"{qualname} {why}"
            loops += found
    if not loops:
        return (
            f"no loop 'for layer in self.{parts[-1]}: x = layer(x, ...)' over {name!r} was found in the forward of "
            "the modules above it (or the methods it calls on self)"
        )
    return None


def _methods(owner: nn.Module) -> list[tuple[str, Any, str]]:
    """``(qualname, parsed function or why it cannot be read, its first parameter's name)`` for ``forward`` and
    every method of ``owner``'s classes it calls on ``self`` (transitively); torch's own classes are left out."""
    klass = type(owner)
    found: list[tuple[str, Any, str]] = []
    todo, seen = ["forward"], set()
    while todo:
        attr = todo.pop()
        if attr in seen:
            continue
        seen.add(attr)
        fn = _lookup(klass, attr)
        if fn is None:
            continue
        qualname = getattr(fn, "__qualname__", attr)
        try:
            source = textwrap.dedent(inspect.getsource(fn))
            tree = ast.parse(source).body[0]
        except (OSError, TypeError, SyntaxError, IndexError) as e:
            found.append((qualname, f"{type(e).__name__}: {e}", ""))
            continue
        if not isinstance(tree, (ast.FunctionDef, ast.AsyncFunctionDef)) or not tree.args.args:
            continue
        self_name = tree.args.args[0].arg
        found.append((qualname, tree, self_name))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == self_name
            ):
                todo.append(node.func.attr)
    return found


def _lookup(klass: type, attr: str) -> Any:
    """The plain function ``klass`` defines (or inherits, outside torch) under ``attr``, else None."""
    for base in klass.__mro__:
        if attr in vars(base):
            if base.__module__.split(".")[0] == "torch" or base is object:
                return None
            fn = vars(base)[attr]
            fn = getattr(fn, "__func__", fn)  # staticmethod / classmethod
            return fn if inspect.isfunction(fn) else None
    return None


def _is_chain(node: ast.AST, self_name: str, chain: list[str]) -> bool:
    """Whether ``node`` is ``self.<chain[0]>.<chain[1]>...``."""
    for attr in reversed(chain):
        if not isinstance(node, ast.Attribute) or node.attr != attr:
            return False
        node = node.value
    return isinstance(node, ast.Name) and node.id == self_name


def _uses(fn: ast.AST, self_name: str, chain: list[str]) -> tuple[int, str | None]:
    """``(loops of the contract over self.<chain>, None)``, or ``(0, why)`` at the first use that is not one."""
    parents: dict[ast.AST, ast.AST] = {}
    for node in ast.walk(fn):
        for child in ast.iter_child_nodes(node):
            parents[child] = node
    loops = 0
    for node in ast.walk(fn):
        if isinstance(node, ast.Constant) and node.value == chain[-1]:
            return 0, f"names {chain[-1]!r} in a string (getattr, __dict__, _modules?): a use the check cannot follow"
        if not _is_chain(node, self_name, chain):
            continue
        up = parents.get(node)
        text = ".".join([self_name, *chain])
        if isinstance(up, ast.Call) and isinstance(up.func, ast.Name) and up.func.id == "len" and up.args == [node]:
            continue
        if isinstance(up, ast.Subscript) and up.value is node:
            index, outer = up.slice, parents.get(up)
            one = isinstance(index, ast.Constant) or (isinstance(outer, ast.Call) and outer.func is up)
            if one and not isinstance(index, ast.Slice):  # one layer (self.blocks[0], self.blocks[i](x)): as written
                continue
            node, up = up, outer
            text = ast.unparse(node)
        if not (isinstance(up, ast.For) and up.iter is node):
            return 0, (
                f"uses {text} other than as 'for layer in {text}: x = layer(x, ...)' (as "
                f"{ast.unparse(up) if isinstance(up, ast.expr) else type(up).__name__!r}); a scan applies the whole "
                "run in one loop"
            )
        why = _loop_violation(fn, up, text)
        if why is not None:
            return 0, why
        loops += 1
    return loops, None


def _loop_violation(fn: ast.AST, loop: ast.For, text: str) -> str | None:
    """Why ``loop`` is not ``for v in <run>: x = v(x, <pure further arguments>)``, or None."""
    head = f"loops over {text}"
    if not isinstance(loop.target, ast.Name):
        return f"{head} with the target {ast.unparse(loop.target)!r}; a scan needs one name per layer"
    v = loop.target.id
    if loop.orelse:
        return f"{head} with an else: clause"
    if len(loop.body) != 1:
        return f"{head} doing {len(loop.body)} statements per layer; a scan does 'x = layer(x, ...)' and nothing else"
    stmt = loop.body[0]
    shape = f"{head} doing {ast.unparse(stmt)!r}; a scan does 'x = layer(x, ...)' and nothing else"
    if not (
        isinstance(stmt, ast.Assign)
        and len(stmt.targets) == 1
        and isinstance(stmt.targets[0], ast.Name)
        and isinstance(stmt.value, ast.Call)
        and isinstance(stmt.value.func, ast.Name)
        and stmt.value.func.id == v
        and stmt.value.args
        and isinstance(stmt.value.args[0], ast.Name)
        and stmt.value.args[0].id == stmt.targets[0].id
    ):
        return shape
    x = stmt.targets[0].id
    rest = [*stmt.value.args[1:], *(k.value for k in stmt.value.keywords)]
    for arg in rest:
        if not _pure(arg, {x, v}):
            return (
                f"{head} passing {ast.unparse(arg)!r} to each layer; a scan passes every layer the same further "
                "arguments (names, attributes, constants)"
            )
    for node in ast.walk(fn):
        if isinstance(node, ast.Name) and node.id == v and not _inside(node, loop):
            return f"{head} and uses the loop variable {v!r} outside the loop"
    return None


def _pure(node: ast.AST, banned: set[str]) -> bool:
    """Names (not in ``banned``), their attributes, constants, ``*name`` and constant subscripts of those."""
    if isinstance(node, ast.Starred):
        return _pure(node.value, banned)
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, ast.Name):
        return node.id not in banned
    if isinstance(node, ast.Attribute):
        return _pure(node.value, banned)
    if isinstance(node, ast.Subscript):
        return _pure(node.value, banned) and isinstance(node.slice, ast.Constant)
    return False


def _inside(node: ast.AST, loop: ast.For) -> bool:
    return any(n is node for n in ast.walk(loop))
