"""funcamp.compile_cache: the step key, the checked file, and a warm start in a second process.

The format tests stand torch's mega-cache in with fakes (no compilation); the subprocess test compiles a small
step with inductor in a fresh process and loads it in another one with an empty inductor cache. Speed is not
timed here (benchmarks/bench_first_step.py does): the second process must report the loaded artifacts, hit
torch's caches, build no C++ library, and end in bitwise the first one's state.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import funcamp as fa
from funcamp import compile_cache, optim

ROOT = Path(__file__).resolve().parents[1]


def _state(shape=(3, 2), dtype=torch.float32):
    params = {"w": torch.zeros(shape, dtype=dtype), "b": torch.zeros(shape[-1], dtype=dtype)}
    return fa.TrainState.create(params, optim.adamw(1e-3), loss_scale=fa.DynamicLossScale(2.0**15))


def _batch(n=4):
    return {"x": torch.zeros(n, 3), "y": torch.zeros(n, dtype=torch.long)}


# --- the key ---------------------------------------------------------------------------------------------


def test_step_key_is_stable_and_names_what_it_covers():
    a, b = compile_cache.step_key(_state(), _batch()), compile_cache.step_key(_state(), _batch())
    assert a == b and len(a.digest) == 64
    assert set(a.fields) == {"trees", "devices", "torch", "python", "funcamp", "extra"}
    assert a.fields["torch"] == torch.__version__
    assert a.fields["devices"] == [f"cpu {os.uname().machine} {torch.backends.cpu.get_cpu_capability()}"]
    assert "DynamicLossScale" in a.fields["trees"][0]["structure"]  # with its static configuration
    assert compile_cache.path("d", a) == Path("d") / f"step-{a.digest[:24]}.bin"


@pytest.mark.parametrize(
    "other",
    [
        lambda: (_state(shape=(4, 2)), _batch()),  # a shape
        lambda: (_state(dtype=torch.bfloat16), _batch()),  # a dtype
        lambda: (_state(), _batch(n=8)),  # the batch's shape
        lambda: (_state(), {**_batch(), "extra": torch.zeros(1)}),  # the batch's structure
        lambda: (_state(), {"x": torch.zeros(3, 4).t(), "y": torch.zeros(4, dtype=torch.long)}),  # strides
        lambda: (_state(), {**_batch(), "k": 3}),  # a Python constant (Dynamo specializes on it)
        lambda: (
            fa.TrainState.create(
                _state().params, optim.adamw(1e-3), loss_scale=fa.DynamicLossScale(2.0**15, period=10)
            ),
            _batch(),
        ),  # a loss scale's static configuration
        lambda: (_state(), {**_batch(), "x": torch.zeros(4, 3).requires_grad_()}),  # a leaf's requires_grad
    ],
    ids=["shape", "dtype", "batch-shape", "batch-structure", "strides", "constant", "static-field", "requires-grad"],
)
def test_step_key_changes_with_what_the_graph_depends_on(other):
    base = compile_cache.step_key(_state(), _batch(), extra={"k": 3})
    assert compile_cache.step_key(*other(), extra={"k": 3}).digest != base.digest


def test_step_key_extra():
    base = compile_cache.step_key(_state())
    assert compile_cache.step_key(_state(), extra={"backend": "inductor"}).digest != base.digest
    assert compile_cache.step_key(_state(), extra={}).digest == base.digest
    with pytest.raises(TypeError, match="extra must be JSON-able"):
        compile_cache.step_key(_state(), extra={"f": object()})
    with pytest.raises(TypeError, match="extra must be a mapping"):
        compile_cache.step_key(_state(), extra=["inductor"])


def test_default_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("FUNCAMP_CACHE_DIR", str(tmp_path))
    assert compile_cache.default_dir() == tmp_path / "compile"
    monkeypatch.delenv("FUNCAMP_CACHE_DIR")
    assert compile_cache.default_dir() == Path.home() / ".cache" / "funcamp" / "compile"


# --- the file, with torch's mega-cache stood in --------------------------------------------------------------

TORCH_BYTES = b"torch's serialized artifacts \x00\x01\x02" * 10
KERNEL = b"\x7fELF a kernel library" * 20
KERNEL_NAME = "ab/cabcdefghijklmnopqrstuvwxyz0123456789.main.so"


@pytest.fixture
def fake_torch(monkeypatch, tmp_path):
    """torch.compiler's save/load stood in; one kernel library in a fake inductor cache (TORCHINDUCTOR_CACHE_DIR)."""
    inductor = tmp_path / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor))
    info = SimpleNamespace(artifacts={"inductor": ["i1"], "aot_autograd": ["a1"]})
    loads: list[bytes] = []

    def load_artifacts(payload):
        loads.append(payload)
        return info if payload == TORCH_BYTES else None

    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (TORCH_BYTES, info))
    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", load_artifacts)
    lib = inductor / KERNEL_NAME
    lib.parent.mkdir(parents=True)
    lib.write_bytes(KERNEL)
    monkeypatch.setattr(compile_cache, "_kernel_files", lambda: [(KERNEL_NAME, lib)])
    key = compile_cache.step_key(_state(), _batch())
    return SimpleNamespace(key=key, file=tmp_path / "cache" / "step.bin", loads=loads, lib=lib)


def test_save_then_load(fake_torch):
    saved = compile_cache.save(fake_torch.file, fake_torch.key)
    assert (saved.action, saved.artifacts) == ("saved", 3)
    assert str(saved) == f"compile cache: saved 3 artifacts to {fake_torch.file}"
    fake_torch.lib.unlink()  # a fresh inductor cache: the library comes from the file
    loaded = compile_cache.load(fake_torch.file, fake_torch.key)
    assert (loaded.action, loaded.artifacts) == ("loaded", 3)
    assert str(loaded) == f"compile cache: loaded 3 artifacts from {fake_torch.file}"
    assert fake_torch.loads == [TORCH_BYTES]
    assert fake_torch.lib.read_bytes() == KERNEL
    again = compile_cache.save(fake_torch.file, fake_torch.key)
    assert again.action == "unchanged", again


def test_load_missing(fake_torch):
    result = compile_cache.load(fake_torch.file, fake_torch.key)
    assert result.action == "missing" and "none yet" in str(result) and fake_torch.loads == []


def _corrupt(kind: str, data: bytes) -> bytes:
    magic, header, payload = data.split(b"\n", 2)
    if kind == "empty":
        return b""
    if kind == "garbage":
        return os.urandom(len(data))
    if kind == "magic":
        return b"funcamp compile cache 9\n" + header + b"\n" + payload
    if kind == "header-json":
        return magic + b"\n" + header[:-7] + b"\n" + payload
    if kind == "truncated":
        return data[:-5]
    if kind == "payload-byte":
        i = len(data) - len(KERNEL) - 3  # a byte of torch's part
        return data[:i] + bytes([data[i] ^ 1]) + data[i + 1 :]
    if kind == "kernel-byte":
        return data[:-3] + bytes([data[-3] ^ 1]) + data[-2:]
    fields = json.loads(header)
    if kind == "kernel-name":  # a path out of the inductor cache, with a matching checksum
        fields["kernels"][0][0] = "../../evil.so"
    if kind == "header-sizes":  # the parts' sizes no longer add up to the payload (whose checksum still holds)
        fields["torch_bytes"] -= 1
    if kind == "header-boundary":  # the sizes add up, but torch's part ends inside the kernel
        fields["torch_bytes"] += 5
        fields["kernels"][0][1] -= 5
    if kind == "header-type":
        fields["kernels"] = "none"
    return magic + b"\n" + json.dumps(fields).encode() + b"\n" + payload


CORRUPTIONS = [
    "empty",
    "garbage",
    "magic",
    "header-json",
    "truncated",
    "payload-byte",
    "kernel-byte",
    "kernel-name",
    "header-type",
    "header-sizes",
    "header-boundary",
]


@pytest.mark.parametrize("kind", CORRUPTIONS)
def test_corrupt_file_is_ignored(fake_torch, kind):
    compile_cache.save(fake_torch.file, fake_torch.key)
    fake_torch.lib.unlink()
    fake_torch.file.write_bytes(_corrupt(kind, fake_torch.file.read_bytes()))
    result = compile_cache.load(fake_torch.file, fake_torch.key)
    assert result.action == "ignored" and result.reason.startswith("corrupt"), result
    message = str(result)
    assert "\n" not in message and message.startswith(f"compile cache: ignored {fake_torch.file} (corrupt")
    assert fake_torch.loads == [] and not fake_torch.lib.exists()  # nothing reached torch or the inductor cache
    assert not (fake_torch.file.parent.parent / "evil.so").exists()
    fake_torch.lib.write_bytes(KERNEL)
    assert compile_cache.save(fake_torch.file, fake_torch.key).action == "saved"  # and the next save repairs it


@pytest.mark.parametrize("kernels", [0, 1])
@pytest.mark.parametrize("shift", [-1, 1])
def test_sizes_that_do_not_add_up_are_corrupt(fake_torch, monkeypatch, kernels, shift):
    """The header's part sizes (torch's bytes plus each kernel's) must add up to the payload: with no kernel
    (a GPU step) that sum is the only check on where torch's part ends."""
    if not kernels:
        monkeypatch.setattr(compile_cache, "_kernel_files", lambda: [])
    compile_cache.save(fake_torch.file, fake_torch.key)
    magic, header, payload = fake_torch.file.read_bytes().split(b"\n", 2)
    fields = json.loads(header)
    assert len(fields["kernels"]) == kernels
    fields["torch_bytes"] += shift
    fake_torch.file.write_bytes(magic + b"\n" + json.dumps(fields).encode() + b"\n" + payload)
    result = compile_cache.load(fake_torch.file, fake_torch.key)
    assert result.action == "ignored" and result.reason.startswith("corrupt"), result
    assert fake_torch.loads == []


def test_file_of_another_key_is_ignored(fake_torch):
    compile_cache.save(fake_torch.file, fake_torch.key)
    other = compile_cache.step_key(_state(shape=(5, 2)), _batch())
    result = compile_cache.load(fake_torch.file, other)
    assert result.action == "ignored" and fake_torch.loads == []
    assert result.reason == "made for another step: its key differs in trees"


@pytest.mark.parametrize("refusal", ["none", "raises"])
def test_file_torch_refuses_is_ignored(fake_torch, monkeypatch, refusal):
    compile_cache.save(fake_torch.file, fake_torch.key)

    def refuse(payload):
        if refusal == "raises":
            raise RuntimeError("unpickling failed\nsecond line")

    monkeypatch.setattr(torch.compiler, "load_cache_artifacts", refuse)
    result = compile_cache.load(fake_torch.file, fake_torch.key)
    assert result.action == "ignored" and "torch refused it" in result.reason and "\n" not in str(result)


def test_nothing_to_save(fake_torch, monkeypatch):
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None)
    monkeypatch.setitem(torch._dynamo.utils.counters, "inductor", collections.Counter())
    result = compile_cache.save(fake_torch.file, fake_torch.key)
    assert result.action == "nothing" and not fake_torch.file.exists()
    assert result.reason == "torch recorded no compile artifacts in this process"


def test_nothing_to_save_names_the_graphs_torch_would_not_cache(fake_torch, monkeypatch):
    """A step torch's FX graph cache bypassed (one holding a higher-order operator torch does not mark cacheable: a
    scanned GPT's step did, "Can't cache HigherOrderOperator: scan", until funcamp marked the scan) is said so, with
    where torch says why, rather than a bare "nothing"."""
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: None)
    monkeypatch.setitem(torch._dynamo.utils.counters, "inductor", collections.Counter(fxgraph_cache_bypass=1))
    result = compile_cache.save(fake_torch.file, fake_torch.key)
    assert result.action == "nothing" and not fake_torch.file.exists()
    assert "bypassed 1 graph (" in result.reason and "scan" in result.reason and "TORCH_LOGS=+cache" in result.reason


def test_unreadable_file_is_ignored(fake_torch):
    fake_torch.file.mkdir(parents=True)  # a directory where the file should be
    result = compile_cache.load(fake_torch.file, fake_torch.key)
    assert result.action == "ignored" and "cannot read it" in result.reason


# --- a file that another user owns or can write: refused (issue 33, item 11) ----------------------------------


def _saved(fake_torch):
    assert compile_cache.save(fake_torch.file, fake_torch.key).action == "saved"
    fake_torch.lib.unlink()  # a fresh inductor cache: loading would install the library
    return fake_torch.file.read_bytes()


def _assert_refused(fake_torch, result, contents, what):
    assert result.action == "refused" and what in result.reason, result
    message = str(result)
    assert "\n" not in message and message.startswith(f"compile cache: refused {fake_torch.file} (")
    assert message.endswith("; compiling without a cache")
    assert fake_torch.loads == [] and not fake_torch.lib.exists()  # nothing read, nothing installed
    assert fake_torch.file.read_bytes() == contents  # nothing written either


WRITABLE = {  # where the write bit for others is, the mode, and the reason's words
    "directory-group": ("dir", 0o770, "its directory"),
    "directory-world": ("dir", 0o777, "its directory"),
    "directory-world-sticky": ("dir", 0o1777, "its directory"),
    "file-group": ("file", 0o660, "the cache file"),
    "file-world": ("file", 0o606, "the cache file"),
    "above-group": ("above", 0o770, "a directory above it"),
    "above-world": ("above", 0o777, "a directory above it"),
}


@pytest.mark.parametrize("case", list(WRITABLE))
def test_file_others_can_write_is_refused(fake_torch, case):
    """A cache file, its directory or a directory above that a group or others can write: load and save refuse,
    in one line, and read or write nothing; with the write bits removed the same file loads."""
    where, mode, what = WRITABLE[case]
    contents = _saved(fake_torch)
    target = {"file": fake_torch.file, "dir": fake_torch.file.parent, "above": fake_torch.file.parent.parent}[where]
    private = target.stat().st_mode & 0o7777
    target.chmod(mode)
    try:
        _assert_refused(fake_torch, compile_cache.load(fake_torch.file, fake_torch.key), contents, what)
        _assert_refused(fake_torch, compile_cache.save(fake_torch.file, fake_torch.key), contents, what)
        assert f"mode {mode:o}" in compile_cache.load(fake_torch.file, fake_torch.key).reason
    finally:
        target.chmod(private)
    assert compile_cache.load(fake_torch.file, fake_torch.key).action == "loaded"


def test_sticky_world_writable_directory_above_is_allowed(fake_torch, tmp_path):
    """``/tmp``'s mode (1777) on a directory above the cache directory: others can add entries there, not change
    this user's; the file loads."""
    _saved(fake_torch)
    tmp_path.chmod(0o1777)
    try:
        assert compile_cache.load(fake_torch.file, fake_torch.key).action == "loaded"
    finally:
        tmp_path.chmod(0o700)


def test_file_of_another_user_is_refused(fake_torch, monkeypatch):
    """A file or directory owned by another user (as root: chown to nobody; else this process seen as another
    uid, root's entries aside): refused. Root's own are trusted, as ssh trusts them."""
    contents = _saved(fake_torch)
    if os.geteuid() != 0:
        uid = os.geteuid()
        monkeypatch.setattr(compile_cache.os, "geteuid", lambda: uid + 1000)
        _assert_refused(fake_torch, compile_cache.load(fake_torch.file, fake_torch.key), contents, "another user")
        return
    for target, what in ((fake_torch.file, "the cache file"), (fake_torch.file.parent, "its directory")):
        os.chown(target, 65534, 65534)
        try:
            result = compile_cache.load(fake_torch.file, fake_torch.key)
            _assert_refused(fake_torch, result, contents, f"{what} {target} is owned by another user (uid 65534)")
        finally:
            os.chown(target, 0, 0)
    assert compile_cache.load(fake_torch.file, fake_torch.key).action == "loaded"


def test_link_into_a_writable_directory_is_refused(fake_torch, tmp_path):
    """A cache file that is a symbolic link: the real file's directories are checked too."""
    contents = _saved(fake_torch)
    public = tmp_path / "public"
    public.mkdir(mode=0o777)
    public.chmod(0o777)
    real = public / "step.bin"
    fake_torch.file.rename(real)
    fake_torch.file.symlink_to(real)
    _assert_refused(fake_torch, compile_cache.load(fake_torch.file, fake_torch.key), contents, str(public))


def test_save_makes_private_directories(fake_torch):
    file = fake_torch.file.parent / "a" / "b" / "step.bin"
    assert compile_cache.save(file, fake_torch.key).action == "saved"
    for d in (file.parent, file.parent.parent):
        assert d.stat().st_mode & 0o077 == 0, oct(d.stat().st_mode)
    assert file.stat().st_mode & 0o077 == 0


# --- a warm start in a second process (inductor) ---------------------------------------------------------


def _worker(tmp_path: Path, name: str, inductor: Path, *extra: str) -> tuple[dict, list[torch.Tensor]]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TORCHINDUCTOR_CACHE_DIR": str(inductor), "OMP_NUM_THREADS": "1"}
    out = tmp_path / name
    cmd = [sys.executable, str(ROOT / "tests" / "_compile_cache_worker.py"), str(tmp_path / "cache"), str(out), *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(Path(f"{out}.json").read_text()), torch.load(f"{out}.pt", weights_only=True)


def _bitwise_equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) > 0 and all(x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.slow
def test_second_process_loads_the_step(tmp_path):
    first, first_state = _worker(tmp_path, "first", tmp_path / "inductor-1")
    assert first["load"]["action"] == "missing" and first["save"]["action"] == "saved"
    assert first["inductor"].get("fxgraph_cache_miss") == 1
    (file,) = (tmp_path / "cache").glob("step-*.bin")
    header = json.loads(file.read_bytes().split(b"\n", 2)[1])
    carried = {name for name, _, _ in header["kernels"]}
    assert any(name.endswith(".main.so") for name in carried)  # the step's C++ kernels

    # A fresh process on a fresh machine's (empty) inductor cache: loads, hits, compiles nothing.
    second, second_state = _worker(tmp_path, "second", tmp_path / "inductor-2")
    assert second["load"]["action"] == "loaded" and second["load"]["artifacts"] == first["save"]["artifacts"] > 0
    assert second["load"]["message"] == f"compile cache: loaded {first['save']['artifacts']} artifacts from {file}"
    assert second["inductor"].get("fxgraph_cache_hit") == 1 and "fxgraph_cache_miss" not in second["inductor"]
    assert second["aot_autograd"].get("autograd_cache_hit") == 1
    assert set(second["libraries"]) <= carried, set(second["libraries"]) - carried  # no C++ library built
    assert second["save"]["action"] == "unchanged"
    assert _bitwise_equal(first_state, second_state)

    # A corrupt file: ignored with one line, the step compiles (here on the first inductor cache) and trains.
    data = bytearray(file.read_bytes())
    data[-100] ^= 0xFF
    file.write_bytes(bytes(data))
    third, third_state = _worker(tmp_path, "third", tmp_path / "inductor-1")
    assert third["load"]["action"] == "ignored"
    assert third["load"]["message"] == f"compile cache: ignored {file} (corrupt: checksum mismatch); compiling instead"
    assert third["save"]["action"] == "saved"  # the file is written anew
    assert _bitwise_equal(first_state, third_state)
    assert hashlib.sha256(file.read_bytes()).hexdigest() != hashlib.sha256(bytes(data)).hexdigest()


@pytest.mark.slow
def test_a_scanned_step_is_saved_and_loaded(tmp_path):
    """A step whose run of blocks ``functionalize(scan=)`` stacks: torch 2.13's caches refuse a graph holding the
    scan operator unless it is marked cacheable (``funcamp.train._assemble.inductor_options``). Saved by the first
    process; a second on an empty inductor cache loads it, hits the FX graph cache, compiles no C++ and trains bit
    for bit as the first. (Planted: the scan left unmarked: the first process's graph is bypassed and nothing is
    saved.)"""
    first, first_state = _worker(tmp_path, "first", tmp_path / "inductor-1", "scan")
    assert first["save"]["action"] == "saved", first["save"]
    assert first["inductor"].get("fxgraph_cache_miss") == 1 and "fxgraph_cache_bypass" not in first["inductor"]
    (file,) = (tmp_path / "cache").glob("step-*.bin")
    carried = {name for name, _, _ in json.loads(file.read_bytes().split(b"\n", 2)[1])["kernels"]}
    second, second_state = _worker(tmp_path, "second", tmp_path / "inductor-2", "scan")
    assert second["file"] == first["file"] and second["load"]["action"] == "loaded", second["load"]
    assert second["inductor"].get("fxgraph_cache_hit") == 1 and "fxgraph_cache_miss" not in second["inductor"]
    assert set(second["libraries"]) <= carried, set(second["libraries"]) - carried  # no C++ library built
    assert _bitwise_equal(first_state, second_state)


def test_the_cache_key_holds_a_scans_body():
    """What marking the scan cacheable relies on (``funcamp.train._assemble.inductor_options``): torch's FX graph
    cache keys a graph with its scan's body, so two scans alike but for the body's activation are two entries,
    never one served for the other. Each compiled under funcamp's options gives its own eager values; the same
    body compiled again is served from the cache. (A factor new in every run makes the keys new, so no entry of an
    earlier run answers. Planted: every graph given one FX graph cache key: the second body is served the first's
    entry and its values are wrong.)"""
    from torch._dynamo.utils import counters
    from torch._higher_order_ops import scan

    from funcamp.train._assemble import inductor_options

    marked = inductor_options()["unsafe_marked_cacheable_functions"]
    assert "torch.ops.higher_order.scan" in marked

    factor = 1.0 + random.random()  # Dynamo writes it into the graph: keys no earlier run made

    def layers(act):
        def f(x, w):
            def body(h, wl):
                return act(h @ wl) * factor, h.new_zeros(())

            return scan(body, x, w)[0].sum(0)

        return f

    x, w = torch.randn(4, 8), torch.randn(3, 8, 8)
    hits = []
    for act in (torch.relu, torch.sigmoid, torch.relu):
        torch._dynamo.reset()
        before = counters["inductor"]["fxgraph_cache_hit"]
        with torch._inductor.config.patch(fx_graph_cache=True, unsafe_marked_cacheable_functions=marked):
            got = torch.compile(layers(act), fullgraph=True, backend="inductor")(x, w)
        hits.append(counters["inductor"]["fxgraph_cache_hit"] - before)
        torch.testing.assert_close(got, layers(act)(x, w), msg=f"{act.__name__}: another body's entry served")
    torch._dynamo.reset()
    assert hits == [0, 0, 1], hits  # the first body again: from the cache
