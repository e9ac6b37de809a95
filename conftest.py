"""Run every Python block of README.md and docs/*.md as a test (sybil).

Each page is one namespace: its blocks run in order, sharing names, and hidden
``<!-- invisible-code-block: python -->`` blocks make the tiny models they need. A block that cannot
run here says why in front of it (``<!-- skip: next "reason" -->``). Each page runs in a fresh
temporary directory, so blocks that write ``runs/`` or ``ckpt.pt`` leave nothing behind.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from pathlib import Path

import torch
from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

ROOT = Path(__file__).resolve().parent


def _setup(namespace: dict) -> None:
    tmp = tempfile.TemporaryDirectory(prefix="funcamp-docs-")
    namespace["_docs_tmp"] = tmp
    namespace["_docs_cwd"] = os.getcwd()
    namespace["_docs_env"] = os.environ.get("FUNCAMP_CACHE_DIR")
    os.chdir(tmp.name)
    os.environ["FUNCAMP_CACHE_DIR"] = str(Path(tmp.name, "cache"))  # tune_policy's cache, not ~/.cache
    namespace["ROOT"] = ROOT  # the repository, for blocks that import examples/
    namespace["HAS_TRANSFORMERS"] = importlib.util.find_spec("transformers") is not None
    torch.manual_seed(0)


def _teardown(namespace: dict) -> None:
    os.chdir(namespace["_docs_cwd"])
    if namespace["_docs_env"] is None:
        os.environ.pop("FUNCAMP_CACHE_DIR", None)
    else:
        os.environ["FUNCAMP_CACHE_DIR"] = namespace["_docs_env"]
    namespace["_docs_tmp"].cleanup()
    torch._dynamo.reset()  # pages that compile leave no cache entries behind for the next test


pytest_collect_file = Sybil(
    parsers=[PythonCodeBlockParser(), SkipParser()],
    patterns=["README.md", "docs/*.md", "docs/**/*.md"],
    setup=_setup,
    teardown=_teardown,
).pytest()
