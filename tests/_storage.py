"""The storage layout a test's states are made in: flat buffers (funcamp's default) or leaf by leaf.

``with storage_kind(flat) as kind:`` makes :meth:`funcamp.TrainState.create` lay its states out flat
(``flat=True``) or leaf by leaf (``FUNCAMP_FLAT=off``) inside the block, and gives the name the states must
report (``state.storage.kind``): the flat-then-per-leaf comparisons of ``tests/test_flat.py``,
``tests/test_flat_sharing.py`` and ``tests/test_optim_lowbit.py`` share it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def storage_kind(flat: bool) -> Iterator[str]:
    """Within: states made flat (``flat``) or leaf by leaf (``FUNCAMP_FLAT=off``); yields ``"flat"`` or
    ``"per leaf"``, what ``state.storage.kind`` must say."""
    with pytest.MonkeyPatch.context() as m:
        if not flat:
            m.setenv("FUNCAMP_FLAT", "off")
        yield "flat" if flat else "per leaf"
