"""What a load asks once and no more: a mount's IO policy once a load, each file's share
in the page cache once, a mapped file opened once (its header read from the descriptor
it is mapped through), the hooks' implementations looked up once a job; and a header as
safetensors writes it, decoded at once, read exactly as the walk over its bytes reads
it. Calls are counted, never timed."""

from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from loaderplug import hookimpl
from loaderplug.errors import FormatError
from loaderplug.storage import io_policy as io_policy_module
from loaderplug.storage import mounts
from loaderplug.storage.mounts import filesystem_type, is_buffered_type
from loaderplug.tensors.delivery import choice
from loaderplug.tensors.format import header as header_module
from loaderplug.tensors.format.header import parse_header
from loaderplug.types import IOPolicy

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
from loaderplug.plugins import manager  # noqa: E402
from loaderplug.tensors.reader import iter_tensors  # noqa: E402
from tests.helpers.tensors import reference, same  # noqa: E402


def counting(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, calls: Counter[str]) -> None:
    """Count the calls of ``module.name`` in ``calls[name]``, passing them on."""
    real = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[name] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


def loaded(paths: list[Path]) -> tuple[dict[str, Any], dict[str, str]]:
    load = iter_tensors(paths, progress=False)
    return dict(load), load.io_modes


def warm(paths: list[Path]) -> None:
    for p in paths:
        p.read_bytes()


def test_a_load_reads_the_mount_table_once_a_process_and_the_page_cache_once_a_file(
    shards: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    warm(shards)
    calls: Counter[str] = Counter()
    counting(monkeypatch, mounts, "find_mount", calls)
    counting(monkeypatch, io_policy_module, "cached_fraction", calls)
    counting(monkeypatch, choice, "cached_fraction", calls)
    monkeypatch.setattr(mounts, "_types", {})  # as in a process's first load
    for load in range(2):
        calls.clear()
        got, modes = loaded(shards)
        assert all(same(got[k], v) for k, v in reference(shards).items())
        # Each file's mount is asked by its path; the table is read at most once, by
        # the first load, and only where the statfs magic does not name the filesystem.
        assert calls["find_mount"] <= (1 if load == 0 else 0), calls
        # The policy asks of a local block filesystem's file; the delivery never asks again.
        asked = 0 if is_buffered_type(filesystem_type(shards[0])) else len(shards)
        assert calls["cached_fraction"] == asked, calls
        assert all(mode.startswith("mapped") for mode in modes.values()), modes


def test_a_plugin_s_io_policy_is_asked_for_each_file_of_a_load(
    shards: list[Path], register_plugin: Any
) -> None:
    asked: list[str] = []

    class Buffered:
        @hookimpl
        def loaderplug_io_policy(self, path: str, mode: str) -> IOPolicy:
            asked.append(path)
            return IOPolicy.buffered("ext4", "a plugin said so")

    register_plugin(Buffered())
    got, modes = loaded(shards)
    assert sorted(asked) == sorted(str(p) for p in shards)
    assert all("a plugin said so" in mode for mode in modes.values()), modes
    assert all(same(got[k], v) for k, v in reference(shards).items())


def test_a_mapped_file_s_header_is_read_from_the_descriptor_it_is_mapped_through(
    shards: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    warm(shards)

    def refused(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a mapped file was opened again, or read through a source")

    monkeypatch.setattr(manager.Plugins, "open_source", refused)
    monkeypatch.setattr(choice.HeldFile, "open", refused)
    monkeypatch.setattr(choice, "read_header", refused)
    got, modes = loaded(shards)
    assert all(mode.startswith("mapped") for mode in modes.values()), modes
    assert all(same(got[k], v) for k, v in reference(shards).items())


def test_a_source_plugin_reads_the_header_of_a_mapped_file(
    shards: list[Path], register_plugin: Any
) -> None:
    seen: list[str] = []

    class Spy:
        @hookimpl(hookwrapper=True)
        def loaderplug_open_source(self, path: str, policy: IOPolicy):  # type: ignore[no-untyped-def]
            seen.append(path)
            yield

    warm(shards)
    register_plugin(Spy())
    got, modes = loaded(shards)
    assert all(mode.startswith("mapped") for mode in modes.values()), modes
    assert sorted(seen) == sorted(str(p) for p in shards)
    assert all(same(got[k], v) for k, v in reference(shards).items())


def test_the_hooks_implementations_are_looked_up_once_a_job(
    shards: list[Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    looked: Counter[str] = Counter()
    real = manager.Plugins._answerers

    def counted(self: manager.Plugins, name: str) -> list[Any]:
        if name not in self._impls:
            looked[name] += 1
        return real(self, name)

    monkeypatch.setattr(manager.Plugins, "_answerers", counted)
    loaded(shards)
    assert looked and set(looked.values()) == {1}, looked


# -- the header decoded at once, and walked ------------------------------------------------


def header_bytes(entries: dict[str, Any], text: str | None = None) -> bytes:
    raw = (text if text is not None else json.dumps(entries, separators=(",", ":"))).encode()
    return raw


def both_ways(raw: bytes, size: int, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """The header parsed as it is (decoded at once where it can be), then with the walk
    over its bytes alone: each a Header or the FormatError's message."""

    def parse() -> Any:
        try:
            return list(parse_header("f", raw, size).tensors)
        except FormatError as exc:
            return str(exc)

    fast = parse()
    with monkeypatch.context() as patched:
        patched.setattr(header_module, "_at_once", lambda path, raw: None)
        walked = parse()
    return fast, walked


def entry(
    dtype: str = "F32", shape: list[int] | None = None, offsets: Any = None
) -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape if shape is not None else [2], "data_offsets": offsets}


HEADERS = {
    "as written": {"a": entry(offsets=[0, 8]), "b": entry(shape=[1, 2], offsets=[8, 16])},
    "out of order": {"b": entry(offsets=[8, 16]), "a": entry(offsets=[0, 8])},
    "same offsets": {"z": entry(shape=[0], offsets=[0, 0]), "y": entry(shape=[0], offsets=[0, 0])},
    "a gap": {"a": entry(offsets=[0, 8]), "b": entry(offsets=[12, 20])},
    "an overlap": {"a": entry(offsets=[0, 8]), "b": entry(offsets=[4, 12])},
    "a wrong size": {"a": entry(shape=[3], offsets=[0, 8])},
    "unknown dtype": {"a": entry(dtype="F99", offsets=[0, 8])},
    "three offsets": {"a": entry(offsets=[0, 8, 8])},
    "negative offset": {"a": entry(offsets=[-8, 8])},
    "float shape": {"a": entry(shape=[2.0], offsets=[0, 8])},
    "with metadata": {"__metadata__": {"format": "pt"}, "a": entry(offsets=[0, 8])},
    "bad metadata": {"__metadata__": {"format": 1}, "a": entry(offsets=[0, 8])},
    "an extra field": {"a": {**entry(offsets=[0, 8]), "extra": [[1]]}},
    "an array entry": {"a": ["F32", [2], [0, 8]]},
}
TEXTS = {
    "a repeated tensor": '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},'
    '"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "a repeated field": '{"a":{"dtype":"F32","shape":[2],"shape":[2],"data_offsets":[0,8]}}',
    "an escaped name": '{"\\u0061":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}',
    "a negative zero": '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"x":-0}',
    "spaces": ' { "a" : { "dtype" : "F32" , "shape" : [ 2 ] , "data_offsets" : [ 0 , 8 ] } } ',
    "trailing data": '{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}} x',
}


@pytest.mark.parametrize("case", [*HEADERS, *TEXTS])
def test_a_header_decoded_at_once_reads_as_the_walk_reads_it(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = header_bytes(HEADERS.get(case, {}), TEXTS.get(case))
    for data in (8, 16, 20):  # the data area: each case's own, and sizes it does not fit
        fast, walked = both_ways(raw, 8 + len(raw) + data, monkeypatch)
        assert fast == walked, (case, data)


def test_a_whole_file_s_header_is_read_in_one_read(tmp_path: Path) -> None:
    from loaderplug.tensors.format.read import header_of_fd

    raw = header_bytes({"a": entry(offsets=[0, 8])})
    path = tmp_path / "one.safetensors"
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(8))
    reads: list[int] = []

    def counted_pread(fd: int, n: int, offset: int) -> bytes:
        reads.append(n)
        return real_pread(fd, n, offset)

    import os

    real_pread = os.pread
    with open(path, "rb") as f, pytest.MonkeyPatch.context() as patched:
        patched.setattr(os, "pread", counted_pread)
        header = header_of_fd(str(path), f.fileno(), path.stat().st_size)
    assert len(reads) == 1
    assert [t.name for t in header.tensors] == ["a"]


def test_a_file_moved_to_another_mount_after_listing_gets_that_mount_s_policy_alone(
    tmp_path: Path,
) -> None:
    from loaderplug.settings import from_env

    shm = Path("/dev/shm")
    if not shm.is_dir() or filesystem_type(shm) == filesystem_type(tmp_path):
        pytest.skip("needs /dev/shm on another filesystem than the test folder")
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    b.write_bytes(b"x" * 4096)
    elsewhere = shm / f"loaderplug-test-{tmp_path.name}"
    elsewhere.write_bytes(b"x" * 4096)
    try:
        a.symlink_to(elsewhere)  # a file replaced, since it was listed, by one elsewhere
        plugins = manager.Plugins(from_env({}))
        assert plugins.file_policy(a).policy.fs_type == filesystem_type(elsewhere)
        assert plugins.file_policy(b).policy.fs_type == filesystem_type(tmp_path)
    finally:
        elsewhere.unlink()


def test_a_mapped_file_swapped_for_a_fifo_after_listing_fails_instead_of_hanging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import threading

    from safetensors.torch import save_file

    from loaderplug.errors import LoaderplugError

    path = tmp_path / "m.safetensors"
    save_file({"a": torch.zeros(4)}, str(path))
    path.read_bytes()
    prepare = choice.TensorDelivery.prepare

    def swapped_then_prepared(self: Any, entry: Any, *args: Any, **kwargs: Any) -> Any:
        path.unlink()
        os.mkfifo(path)
        return prepare(self, entry, *args, **kwargs)

    monkeypatch.setattr(choice.TensorDelivery, "prepare", swapped_then_prepared)
    said: list[BaseException] = []

    def load() -> None:
        try:
            dict(iter_tensors([path], progress=False))
        except BaseException as exc:
            said.append(exc)

    loading = threading.Thread(target=load, daemon=True)
    loading.start()
    loading.join(60)
    hung = loading.is_alive()
    if hung:  # a writer lets the blocked open return, so the thread can end
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
    assert not hung, "the load hangs on a FIFO"
    assert said and isinstance(said[0], LoaderplugError), said
    assert "not a regular file" in str(said[0])
