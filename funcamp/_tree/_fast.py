"""The traced fast path of :mod:`funcamp._tree`: a plain-Python flatten that Dynamo traces in a few bytecodes.

Under ``torch.compile``, Dynamo runs optree's functions as a Python re-implementation (the pytree polyfill
of ``torch._dynamo``) that builds a treespec object per node; tracing that cost 2-6 s of the first train
step of the benchmark GPT (15 parameters; AMD EPYC, 2 cores). The walk below covers the containers the
train step holds (dicts of tensors, optimizer states as NamedTuples and tuples, None, and funcamp's own
dataclasses: :func:`funcamp._tree.dataclass`, whose fields it reads from :data:`FIELDS`) with a few
bytecodes per node, and hands anything else back to optree. It is not a flatten for other custom nodes.

:func:`traced` is the one question the tree functions ask before they take it.
"""

from __future__ import annotations

import itertools
import operator
from typing import Any

import optree
import torch

from funcamp import _scope

#: The optree registry namespace of every tree operation in funcamp.
NAMESPACE = "funcamp"


def traced() -> bool:
    """Whether a tree function runs in a compiled step, as it is traced (:func:`funcamp._scope.compiling`): then
    it takes this walk, which Dynamo traces cheaply, instead of optree's polyfill. The leaves, their order and
    the result are optree's either way."""
    return _scope.compiling()


#: Types that are leaves for optree (never registered as nodes): the fast path flattens only these.
LEAF_TYPES = (torch.Tensor, int, float, complex, str, bytes)

#: The class attribute :func:`funcamp._tree.dataclass` sets: ``(cls, children, statics)``, the names of the
#: fields that hold subtrees and of the static ones (in optree's order), ``cls`` itself so that a subclass,
#: which optree's registry does not know, is not taken for it.
FIELDS = "_funcamp_tree_fields"

#: Static field values compared by value (others by identity, and the walk hands a differing pair to optree;
#: see also :func:`_constant`).
_CONSTANTS = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)


@torch._dynamo.assume_constant_result  # a type in, a bool out: Dynamo calls it rather than trace optree's registry
def is_plain_namedtuple(cls: type) -> bool:
    """A NamedTuple class that optree flattens as a NamedTuple (not a custom node registered for it)."""
    if cls.__bases__ != (tuple,) or not isinstance(getattr(cls, "_fields", None), tuple):
        return False
    entry = optree.register_pytree_node.get(cls, namespace=NAMESPACE)
    return entry is not None and entry.kind == optree.PyTreeKind.NAMEDTUPLE


def flatten(tree: Any, rest: tuple[Any, ...], *, strict: bool) -> tuple[list, list[list], Any] | None:
    """``(leaves, rest_leaves, skeleton)`` of ``tree`` and ``rest`` in optree's leaf order, or None.

    None when a node is not a dict with string keys, list, tuple, plain NamedTuple, None or funcamp dataclass
    (:data:`FIELDS`), when a leaf is not one of :data:`LEAF_TYPES`, or when a tree of ``rest`` differs from
    ``tree`` at a node (a dataclass's static fields: not the same object nor equal constants; ``strict``: at a
    leaf too, i.e. the structures must be equal). Dict keys are visited sorted, as
    optree does; :func:`unflatten` rebuilds each dict in its original key order.
    """
    leaves: list[Any] = []
    rest_leaves: list[list[Any]] = [[] for _ in rest]
    skeleton = _walk(tree, list(rest), strict, leaves, rest_leaves)
    return None if skeleton is None else (leaves, rest_leaves, skeleton)


_LEAF, _NONE, _DICT, _SEQ, _DATA = 0, 1, 2, 3, 4
#: The children of a dict whose every value is a leaf (one marker, not a list of ``_LEAF``).
_ALL_LEAVES = -1
#: Types whose values :func:`_walk` takes for leaves without asking each one (a subclass asks ``isinstance``).
_TENSOR_TYPES = frozenset({torch.Tensor, torch.nn.Parameter})
#: :data:`LEAF_TYPES` without subclasses (but ``bool``), for the same question of many values at once.
_PLAIN_LEAF_TYPES = _TENSOR_TYPES | {int, float, complex, str, bytes, bool}


def _walk(node: Any, others: list[Any], strict: bool, leaves: list, rest_leaves: list) -> Any:
    """The skeleton of ``node`` (leaves appended to ``leaves``, ``others``' to ``rest_leaves``), or None."""
    if isinstance(node, LEAF_TYPES):
        leaves.append(node)
        for acc, o in zip(rest_leaves, others):
            if strict and not isinstance(o, LEAF_TYPES):
                return None
            acc.append(o)
        return _LEAF
    if node is None:
        for o in others:
            if o is not None:
                return None
        return _NONE
    cls = type(node)
    if cls is dict:
        for o in others:
            if type(o) is not dict or len(o) != len(node):
                return None
        order = tuple(node)
        if not _all_str(tuple(map(type, order))):
            return None  # optree orders other keys in ways this walk does not copy
        keys = tuple(sorted(order))
        values = list(map(node.__getitem__, keys))  # no bytecodes per key to trace (Dynamo runs ``map`` itself)
        if _plain_tensors(values):  # a dict of plain tensors (parameters, gradients, moments): no walk per key
            subs = _dict_values(others, keys, strict)
            if subs is not None:
                leaves.extend(values)
                for acc, sub in zip(rest_leaves, subs):
                    acc.extend(sub)
                return (_DICT, keys, None if order == keys else order, _ALL_LEAVES)
        children = []
        for k, x in zip(keys, values):
            sub = []
            for o in others:
                if k not in o:
                    return None
                sub.append(o[k])
            if isinstance(x, torch.Tensor):  # the common leaf, inline: each call costs Dynamo a frame
                for acc, y in zip(rest_leaves, sub):
                    if strict and not isinstance(y, LEAF_TYPES):
                        return None
                    acc.append(y)
                leaves.append(x)
                children.append(_LEAF)
                continue
            child = _walk(x, sub, strict, leaves, rest_leaves)
            if child is None:
                return None
            children.append(child)
        return (_DICT, keys, None if order == keys else order, children)
    if cls is list or cls is tuple or (isinstance(node, tuple) and is_plain_namedtuple(cls)):
        for o in others:
            if type(o) is not cls or len(o) != len(node):
                return None
        children = []
        for i, x in enumerate(node):
            sub = []
            for o in others:
                sub.append(o[i])
            if isinstance(x, torch.Tensor):  # the common leaf, inline
                for acc, y in zip(rest_leaves, sub):
                    if strict and not isinstance(y, LEAF_TYPES):
                        return None
                    acc.append(y)
                leaves.append(x)
                children.append(_LEAF)
                continue
            child = _walk(x, sub, strict, leaves, rest_leaves)
            if child is None:
                return None
            children.append(child)
        return (_SEQ, cls, children)
    fields = getattr(cls, FIELDS, None)
    if fields is None or fields[0] is not cls:
        return None
    return _walk_fields(node, others, strict, leaves, rest_leaves, fields)


def _dict_values(others: list[Any], keys: tuple[str, ...], strict: bool) -> list[list[Any]] | None:
    """The values of each dict of ``others`` at ``keys`` (the leaf places of a dict of tensors), or None where one
    lacks a key (the caller's per-key walk then says None) or, ``strict``, holds a value that is not a plain leaf
    (the caller's walk asks ``isinstance`` of each)."""
    subs = []
    for o in others:  # as long as ``keys`` (the caller checked), so the same keys if it holds each of them
        if not (_all_str(tuple(map(type, o))) and _within(tuple(o), keys)):
            return None
        sub = list(map(o.__getitem__, keys))
        if strict and not _plain_leaf_types(tuple(map(type, sub))):
            return None
        subs.append(sub)
    return subs


def _plain_tensors(values: list[Any]) -> bool:
    """Whether every value is a ``torch.Tensor`` or an ``nn.Parameter`` (not a subclass, which the walk asks
    ``isinstance`` of): asked of the values' types, a tuple Dynamo makes without tracing an instruction a value."""
    return _tensor_types(tuple(map(type, values)))


def select_tensors(pred: torch.Tensor, a: list[Any], b: list[Any]) -> list[torch.Tensor] | None:
    """``[x if x is y else torch.where(pred, x, y) for x, y in zip(a, b)]`` for lists of plain tensors paired in
    dtype and shape, as Dynamo traces it in a few instructions whatever the length: every per-pair question is a
    ``map`` of a builtin or a tensor method (which Dynamo runs itself), the plan a constant. None when a value is
    not a plain tensor or a pair differs in dtype or shape (the caller's per-pair path raises for the latter)."""
    if _paired(a, b) is None:
        return None
    differing, positions = _select_plan(tuple(map(operator.is_, a, b)))
    picked = list(
        map(torch.where, itertools.repeat(pred), map(a.__getitem__, differing), map(b.__getitem__, differing))
    )
    return list(map((a + picked).__getitem__, positions))


def dtypes(values: list[Any]) -> tuple[torch.dtype, ...] | None:
    """The dtype of each value, for a list of plain tensors (else None), in a few traced instructions."""
    return tuple(map(torch.Tensor.dtype.__get__, values)) if _plain_tensors(values) else None


def _paired(a: list[Any], b: list[Any]) -> tuple[torch.dtype, ...] | None:
    """The dtypes of ``a`` where ``a`` and ``b`` are lists of plain tensors paired in dtype and size, else None."""
    kinds = dtypes(a)
    if kinds is None or kinds != dtypes(b) or tuple(map(torch.Tensor.size, a)) != tuple(map(torch.Tensor.size, b)):
        return None
    return kinds


def add_alike(a: list[Any], b: list[Any]) -> list[torch.Tensor] | None:
    """``[x + y for x, y in zip(a, b)]`` for plain float32 or float64 tensors paired in dtype and shape (the sum
    each pair's compute dtype gives, no cast), in a few traced instructions; None otherwise."""
    kinds = _paired(a, b)
    if kinds is None or not _wide_floats(kinds):
        return None
    return list(map(torch.add, a, b))


# The questions below take only constants (types, string keys), so Dynamo calls them as they are and keeps the
# answer (``assume_constant_result``: guarded like any constant, they read nothing else) instead of tracing their
# loops, an instruction or more per value: 5 for its ``all``, 6 for a key's ``in`` test, each time a tree of the
# step is walked (GPT-2 124M's step: 148 parameters, 62 flat buffers, some 40 walks). Eager calls run them as written.


@torch._dynamo.assume_constant_result
def _all_str(types: tuple[type, ...]) -> bool:
    """Whether every type of ``types`` (a dict's keys' types) is ``str``."""
    return all(t is str for t in types)


@torch._dynamo.assume_constant_result
def _within(keys: tuple[str, ...], within: tuple[str, ...]) -> bool:
    """Whether every key of ``keys`` is one of ``within``."""
    return set(keys) <= set(within)


@torch._dynamo.assume_constant_result
def _tensor_types(types: tuple[type, ...]) -> bool:
    """Whether every type of ``types`` is one of :data:`_TENSOR_TYPES`."""
    return all(t in _TENSOR_TYPES for t in types)


@torch._dynamo.assume_constant_result
def _select_plan(same: tuple[bool, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """For pairs that are the same tensor or not (``same``): the indices of the differing pairs, and where each
    result comes from in ``a + picked`` (``a``'s own where the pair is one tensor, else its ``where``)."""
    differing = tuple(i for i, s in enumerate(same) if not s)
    rank = {i: len(same) + n for n, i in enumerate(differing)}
    return differing, tuple(rank.get(i, i) for i in range(len(same)))


@torch._dynamo.assume_constant_result
def all_floating(kinds: tuple[torch.dtype, ...], *, wide: bool) -> bool:
    """Whether every dtype is floating (``wide``: and at least as wide as float32)."""
    return all(d.is_floating_point and not (wide and d.itemsize < 4) for d in kinds)


@torch._dynamo.assume_constant_result
def _wide_floats(kinds: tuple[torch.dtype, ...]) -> bool:
    """Whether every dtype is float32 or float64 (its own compute dtype)."""
    return all(d in (torch.float32, torch.float64) for d in kinds)


@torch._dynamo.assume_constant_result
def _plain_leaf_types(types: tuple[type, ...]) -> bool:
    """Whether every type of ``types`` is one of :data:`_PLAIN_LEAF_TYPES`."""
    return all(t in _PLAIN_LEAF_TYPES for t in types)


def _constant(v: Any) -> bool:
    """Whether a static field's value is compared by value: one of :data:`_CONSTANTS`, or of a class that marks
    its ``==`` as a comparison of host-made constants (``_funcamp_static_eq``: the flat storage's layouts)."""
    return isinstance(v, _CONSTANTS) or getattr(type(v), "_funcamp_static_eq", False)


def _walk_fields(node: Any, others: list[Any], strict: bool, leaves: list, rest_leaves: list, fields: Any) -> Any:
    """:func:`_walk` of a dataclass of :func:`funcamp._tree.dataclass`: its static fields equal in ``others``
    (the same object, or equal constants), its children walked in field order."""
    cls, names, statics = fields
    for o in others:
        if type(o) is not cls:
            return None
    aux = []
    for name in statics:
        v = getattr(node, name)
        for o in others:
            w = getattr(o, name)
            if w is not v and not (type(w) is type(v) and _constant(v) and w == v):
                return None
        aux.append(v)
    children = []
    for name in names:
        sub = []
        for o in others:
            sub.append(getattr(o, name))
        child = _walk(getattr(node, name), sub, strict, leaves, rest_leaves)
        if child is None:
            return None
        children.append(child)
    return (_DATA, cls, tuple(zip(statics, aux)), names, children)


def unflatten(skeleton: Any, leaves: list[Any]) -> Any:
    """The tree of ``skeleton`` (from :func:`flatten`) with ``leaves`` in leaf order."""
    it = iter(leaves)
    out = _build(skeleton, it)
    if next(it, it) is not it:
        raise ValueError("funcamp._tree: more leaves than the structure holds")
    return out


def _build(skeleton: Any, it: Any) -> Any:
    if skeleton == _LEAF:
        return next(it)
    if skeleton == _NONE:
        return None
    if skeleton[0] == _DICT:
        _, keys, order, children = skeleton
        built = {}
        if children == _ALL_LEAVES:  # zip takes a key first: it takes exactly len(keys) leaves
            built = {k: x for k, x in zip(keys, it)}  # 8 traced instructions a key, where a loop took 10
        else:
            for k, child in zip(keys, children):
                built[k] = next(it) if child == _LEAF else _build(child, it)
        if order is None:
            return built
        ordered = {}
        for k in order:
            ordered[k] = built[k]
        return ordered
    if skeleton[0] == _DATA:
        _, cls, aux, names, children = skeleton
        kwargs = {}
        for name, child in zip(names, children):
            kwargs[name] = next(it) if child == _LEAF else _build(child, it)
        for name, v in aux:
            kwargs[name] = v
        return cls(**kwargs)
    _, cls, children = skeleton
    items = []
    for child in children:
        items.append(next(it) if child == _LEAF else _build(child, it))
    return cls(items) if cls is list or cls is tuple else cls(*items)


def torch_leaves(skeleton: Any) -> bool:
    """Whether ``torch.utils._pytree`` flattens the tree of ``skeleton`` (from :func:`flatten`) into the same leaves
    (in its own order: dict keys as inserted): no ``None`` (a leaf there, skipped here) and no funcamp dataclass
    (a leaf there: it is registered with optree only). A plain dict of tensors is one step."""
    if skeleton == _LEAF:
        return True
    if skeleton == _NONE or skeleton[0] == _DATA:
        return False
    children = skeleton[3] if skeleton[0] == _DICT else skeleton[2]
    if children == _ALL_LEAVES:
        return True
    for child in children:
        if child != _LEAF and not torch_leaves(child):
            return False
    return True


def skeleton_paths(skeleton: Any, prefix: tuple[str, ...], out: list[str]) -> None:
    """Append the dotted path of every leaf of ``skeleton`` (from :func:`flatten`) to ``out``."""
    if skeleton == _LEAF:
        out.append(".".join(prefix))
        return
    if skeleton == _NONE:
        return
    if skeleton[0] == _DICT:
        _, keys, _, children = skeleton
        named = zip(keys, [_LEAF] * len(keys) if children == _ALL_LEAVES else children)
    elif skeleton[0] == _DATA:
        named = zip(skeleton[3], skeleton[4])
    else:
        named = ((str(i), child) for i, child in enumerate(skeleton[2]))
    for name, child in named:
        skeleton_paths(child, (*prefix, name), out)
