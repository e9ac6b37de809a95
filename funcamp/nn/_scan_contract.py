"""Whether a model's code applies a ``ModuleList`` the way ``scan=`` computes it: read from its source.

A scanned ``ModuleList`` yields, under ``torch.compile``, one object that applies the whole run (see
:mod:`funcamp.nn._scan`). That equals the model only where the model's code does nothing with the list but

    for layer in self.blocks:                     # or self.blocks[<slice>], or self.transformer.h from above
        x = layer(x, <the same further arguments>)

so :func:`violation` reads the code of every module above the run and returns why not, or ``None``. It reads each
module's ``forward`` and, transitively, every function that code hands ``self`` to: methods called on ``self``,
``super()``'s methods, and plain functions called with ``self`` as an argument. In that code:

* each mention of the run must be such a loop (``len()`` of it, or one layer by a constant index or called at
  once, ``self.blocks[i](x)``, is allowed too), and at least one loop must exist; its body is that one assignment,
  its further arguments names, attributes, constants or ``*args``/``**kwargs`` of names (the same for every layer),
  and its loop variable is not read after the loop;
* the way to the run is not taken apart: ``self`` is used only to read attributes, call methods or be handed to
  functions the check then reads; a module between ``self`` and the run (``self.body`` above ``self.body.blocks``)
  only to call it or read another attribute; the run's name appears in no string (``getattr(self, "blocks")``).

Code whose source Python cannot give (a class made by ``exec``, a C extension), a ``forward`` that is not a
``def``, and ``self`` handed to anything else (``type(self).f(self)``, a builtin) cannot be checked and are refused
with where. The check reads code; it runs nothing. It cannot see what code does through objects it is not handed
(a global holding the model): such code is outside what ``scan=`` supports.
"""

from __future__ import annotations

import ast
import builtins
import inspect
import textwrap
from typing import Any

from torch import nn

__all__ = ["violation"]

#: Builtins that may be handed ``self`` without reaching the run through it.
_HARMLESS = frozenset({"isinstance", "issubclass", "type", "id", "hash", "repr", "str", "hasattr", "callable"})


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
        try:
            functions = _functions(owner)
        except _Unreadable as e:
            return f"{e} (checking how the code applies {name!r})"
        for qualname, tree, self_name in functions:
            found, why = _uses(tree, self_name, parts[depth:])
            if why is not None:
                return f"{qualname} {why}"
            loops += found
    if not loops:
        return (
            f"no loop 'for layer in self.{parts[-1]}: x = layer(x, ...)' over {name!r} was found in the forward of "
            "the modules above it (or the functions it hands self to)"
        )
    return None


class _Unreadable(Exception):
    """Code the check must read and cannot."""


def _functions(owner: nn.Module) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef, str]]:
    """``(qualname, parsed function, the name self has in it)`` for ``owner``'s ``forward`` and every function its
    code hands ``self`` to, transitively (see the module); torch's own classes are not read.

    Raises:
      _Unreadable: naming the function whose source cannot be parsed, a non-``def`` forward, or a call that hands
        ``self`` to code the check cannot resolve.
    """
    klass = type(owner)
    found: list[tuple[str, Any, str]] = []
    first = _lookup(klass, "forward")
    todo: list[tuple[Any, int | str]] = [] if first is None else [(first, 0)]  # (function, where self goes in)
    seen: set[Any] = set()
    while todo:
        fn, slot = todo.pop()
        if fn in seen:
            continue
        seen.add(fn)
        tree, self_name = _parse(fn, slot)
        qualname = getattr(fn, "__qualname__", repr(fn))
        found.append((qualname, tree, self_name))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                todo.extend(_handed_self(node, fn, klass, self_name, qualname))
    return found


def _lookup(klass: type, attr: str, after: type | None = None, *, strict: bool = True) -> Any:
    """The function ``klass`` defines or inherits under ``attr`` (searching the MRO past ``after`` if given; a
    property's getter, which is handed ``self``), or None where it comes from torch's own classes or nowhere.

    Raises:
      _Unreadable: if ``strict`` and the attribute is defined outside torch but is not a function to read (with
        ``strict=False`` such an attribute, which is not handed ``self``, gives None).
    """
    mro = klass.__mro__
    if after is not None:
        mro = mro[mro.index(after) + 1 :] if after in mro else ()
    for base in mro:
        if attr in vars(base):
            if base.__module__.split(".")[0] == "torch" or base is object:
                return None
            value = vars(base)[attr]
            fn = value.fget if isinstance(value, property) else getattr(value, "__func__", value)
            if inspect.isfunction(fn):
                return fn
            if strict:
                raise _Unreadable(f"{base.__qualname__}.{attr} is a {type(value).__name__}, not a function to read")
            return None
    return None


def _parse(fn: Any, slot: int | str) -> tuple[ast.FunctionDef | ast.AsyncFunctionDef, str]:
    """``fn``'s definition and the name of its parameter at ``slot`` (a position or a keyword): where ``self`` is."""
    qualname = getattr(fn, "__qualname__", repr(fn))
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError) as e:
        raise _Unreadable(f"the source of {qualname} cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(tree, (ast.FunctionDef, ast.AsyncFunctionDef)):
        raise _Unreadable(f"{qualname} is not a def (a lambda or an assignment), so it cannot be read")
    params = [*tree.args.posonlyargs, *tree.args.args]
    if isinstance(slot, str):
        return tree, slot
    if slot >= len(params):
        raise _Unreadable(f"{qualname} takes self in *args, which the check cannot follow")
    return tree, params[slot].arg


def _handed_self(node: ast.Call, fn: Any, klass: type, self_name: str, qualname: str) -> list[tuple[Any, int | str]]:
    """The functions ``node`` hands ``self`` to, with where ``self`` goes in each.

    Raises:
      _Unreadable: if it hands ``self`` to something the check cannot resolve to a function it reads.
    """
    func = node.func
    out: list[tuple[Any, int | str]] = []
    if isinstance(func, ast.Attribute) and _is_name(func.value, self_name):  # self.method(...)
        method = _lookup(klass, func.attr, strict=False)
        if method is not None:
            out.append((method, 0))
    elif (
        isinstance(func, ast.Attribute)
        and isinstance(func.value, ast.Call)
        and _is_name(func.value.func, "super")
        and not func.value.args
    ):  # super().method(...)
        owner = next((b for b in klass.__mro__ if getattr(vars(b).get(fn.__name__), "__func__", None) is fn), None)
        owner = owner or next((b for b in klass.__mro__ if vars(b).get(fn.__name__) is fn), None)
        method = _lookup(klass, func.attr, after=owner, strict=False) if owner is not None else None
        if method is not None:
            out.append((method, 0))
    handed = [i for i, a in enumerate(node.args) if _is_name(a, self_name)]
    handed_kw = [k.arg for k in node.keywords if _is_name(k.value, self_name)]
    if not handed and not handed_kw:
        return out
    if isinstance(func, ast.Name) and func.id in _HARMLESS and getattr(builtins, func.id, None) is not None:
        return out
    if (
        _is_name(func, "getattr")
        and len(node.args) >= 2
        and isinstance(node.args[1], ast.Constant)
        and isinstance(node.args[1].value, str)
    ):
        return out  # getattr(self, "name"): a name in a string, which _uses refuses where it is the run's
    target = _resolve(func, fn)
    if target is None or any(k is None for k in handed_kw):
        raise _Unreadable(
            f"{qualname} hands self to {ast.unparse(func)}, which the check cannot read (a plain function it can "
            "find by name is read)"
        )
    return out + [(target, i) for i in handed] + [(target, k) for k in handed_kw]


def _resolve(func: ast.expr, fn: Any) -> Any:
    """The plain Python function a called name refers to in ``fn``'s globals or closure, else None."""
    if not isinstance(func, ast.Name):
        return None
    fn = inspect.unwrap(fn)  # the source read is the wrapped function's: so are its names
    scope = dict(fn.__globals__)
    if fn.__closure__:
        scope.update(zip(fn.__code__.co_freevars, (c.cell_contents for c in fn.__closure__), strict=False))
    value = scope.get(func.id)
    return value if inspect.isfunction(value) else None


def _is_name(node: ast.AST, name: str) -> bool:
    return isinstance(node, ast.Name) and node.id == name


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
        if isinstance(node, ast.Name) and node.id == self_name and isinstance(node.ctx, ast.Load):
            why = _self_use(node, parents, chain)
            if why is not None:
                return 0, why
        if not _is_chain(node, self_name, chain):
            continue
        up = parents.get(node)
        text = ".".join([self_name, *chain])
        if isinstance(up, ast.Call) and isinstance(up.func, ast.Name) and up.func.id == "len" and up.args == [node]:
            continue
        if isinstance(up, ast.Subscript) and up.value is node:
            index, outer = up.slice, parents.get(up)
            one = _constant_index(index) or (isinstance(outer, ast.Call) and outer.func is up)
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
        why = _loop_violation(fn, up, text) or _under_autocast(up, parents, text)
        if why is not None:
            return 0, why
        loops += 1
    return loops, None


def _self_use(node: ast.Name, parents: dict[ast.AST, ast.AST], chain: list[str]) -> str | None:
    """Why this read of ``self`` could reach the run other than through the checked chain, or None.

    Allowed: ``self.attr`` where ``attr`` is not the chain's first name; the chain's modules, each read for another
    attribute or called (``self.body(x)``, ``self.body.norm``), or followed down the chain; ``self`` handed to a
    call (the call is read, or refused, by :func:`_handed_self`).
    """
    up = parents.get(node)
    if isinstance(up, ast.Call) and node is not up.func:
        return None  # handed to a function: read through _functions
    if isinstance(up, ast.keyword):
        return None
    if not isinstance(up, ast.Attribute):
        what = ast.unparse(up) if isinstance(up, ast.expr) else type(up).__name__
        return f"uses self as a value ({what}): the run could be reached through it"
    current: ast.AST = up
    for i, attr in enumerate(chain):
        if not isinstance(current, ast.Attribute) or current.attr != attr:
            return None  # another attribute: not on the way to the run
        if i == len(chain) - 1:
            return None  # the run itself: _uses checks it
        above = parents.get(current)
        if isinstance(above, ast.Call) and above.func is current:
            return None  # a module on the way, called: its forward is read at its own level
        if not isinstance(above, ast.Attribute):
            text = ast.unparse(current)
            return (
                f"uses {text} other than by calling it or reading another attribute: the run below it could be reached"
            )
        current = above
    return None


def _under_autocast(loop: ast.For, parents: dict[ast.AST, ast.AST], text: str) -> str | None:
    """Why a loop inside ``with ...autocast(...)`` is refused: its layers may return another dtype than they are
    given, which the scan's carried tensor cannot change (it would fail while compiling, not here)."""
    node: ast.AST | None = parents.get(loop)
    while node is not None:
        if isinstance(node, (ast.With, ast.AsyncWith)) and any("autocast" in ast.unparse(i) for i in node.items):
            return f"loops over {text} under autocast: a layer may change the dtype of what the scan carries"
        node = parents.get(node)
    return None


def _constant_index(index: ast.AST) -> bool:
    """An integer constant, signed or not (``0``, ``-1``)."""
    if isinstance(index, ast.UnaryOp) and isinstance(index.op, (ast.USub, ast.UAdd)):
        index = index.operand
    return isinstance(index, ast.Constant) and isinstance(index.value, int)


def _is_chain(node: ast.AST, self_name: str, chain: list[str]) -> bool:
    """Whether ``node`` is ``self.<chain[0]>.<chain[1]>...``."""
    for attr in reversed(chain):
        if not isinstance(node, ast.Attribute) or node.attr != attr:
            return False
        node = node.value
    return isinstance(node, ast.Name) and node.id == self_name


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
    rebinding = [n for n in ast.walk(fn) if n is not loop and _binds(n, v)]  # other loops over the same name
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Name)
            and node.id == v
            and isinstance(node.ctx, ast.Load)
            and not _inside(node, loop)
            and not any(_inside(node, other) for other in rebinding)
        ):
            return f"{head} and reads the loop variable {v!r} after the loop"
    return None


def _binds(node: ast.AST, name: str) -> bool:
    """A loop or comprehension whose target is ``name`` (its reads of ``name`` are its own)."""
    if isinstance(node, (ast.For, ast.comprehension)):
        return isinstance(node.target, ast.Name) and node.target.id == name
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)):
        return any(_binds(g, name) for g in node.generators)
    return False


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
        return _pure(node.value, banned) and _constant_index(node.slice)
    return False


def _inside(node: ast.AST, region: ast.AST) -> bool:
    return any(n is node for n in ast.walk(region))
