"""Streaming safetensors reader: tensors are yielded as soon as their last byte lands.

Files are read by the range engine (range-parallel, under the IO policy of each file);
a :class:`TensorSink` per file scatters every landed range into the tensors it covers and
hands over each tensor the moment it is complete, while other ranges are still in
flight. Each yielded tensor owns its memory: it is never a view into a reused buffer.

With ``local_dir`` the same pass also hydrates: each range read from the mirror is
written to a local temp file (with hydrate's guarantees) and fed to the tensor sink, so
every byte is read from the volume once.
"""

from __future__ import annotations

import bisect
import mmap
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pluggy

from loaderplug.engine import READ_PADDING, TRANSIENT_ERRNOS, Engine, FileJob, backoff_s
from loaderplug.errors import FormatError, HydrateError, LoaderplugError, TransferFailed
from loaderplug.fs import IOPolicy, is_network_type
from loaderplug.header import LENGTH_BYTES, Header, TensorInfo, header_length, parse_header
from loaderplug.plugins import first_result, plugin_manager
from loaderplug.report import TransferReport
from loaderplug.settings import Settings, from_env
from loaderplug.sinks import Sink
from loaderplug.source import Identity, Source
from loaderplug.staging import StagingPool, as_bytes, backend_for, pool_for
from loaderplug.volume import file_sink

if TYPE_CHECKING:
    import torch

# safetensors dtype → torch attribute; a dtype the installed torch lacks is a clear error.
TORCH_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise LoaderplugError(
            "reading tensors needs torch: pip install 'loaderplug[torch]'"
        ) from exc
    return torch


def torch_dtype(path: str, name: str, dtype: str) -> torch.dtype:
    found = getattr(_torch(), TORCH_DTYPES.get(dtype, ""), None)
    if found is None:
        raise FormatError(f"{path}: tensor {name!r}: dtype {dtype} is not supported by this torch")
    return found  # type: ignore[no-any-return]


def torch_dtypes(header: Header) -> dict[str, torch.dtype]:
    """Each tensor's torch dtype; a dtype this torch lacks fails before any read."""
    return {t.name: torch_dtype(header.path, t.name, t.dtype) for t in header.tensors}


def read_header(source: Source, path: str) -> Header:
    """Read and validate the header of an open source (two small reads)."""
    size = source.size
    first = bytearray(min(size, LENGTH_BYTES))
    got = source.pread_into(memoryview(first), 0)
    n = header_length(path, bytes(first[:got]), size)
    raw = bytearray(n)
    if source.pread_into(memoryview(raw), LENGTH_BYTES) < n:
        raise FormatError(f"{path}: file ended inside its header")
    return parse_header(path, bytes(raw), size)


def _read_header_retrying(
    pm: pluggy.PluginManager, settings: Settings, path: str, policy: IOPolicy
) -> tuple[Identity, Header]:
    """The file's identity and header, retrying transient errors like the engine does."""
    for attempt in range(settings.retry_attempts):
        try:
            source: Source = first_result(pm, "loaderplug_open_source", path=path, policy=policy)
            try:
                return source.identity(), read_header(source, path)
            finally:
                source.close()
        except OSError as exc:
            if exc.errno not in TRANSIENT_ERRNOS or attempt + 1 == settings.retry_attempts:
                raise HydrateError(
                    f"{path}: reading the header failed: {exc.strerror or exc}",
                    path=path,
                    errno=exc.errno,
                ) from exc
            time.sleep(backoff_s(settings, attempt))
    raise AssertionError("unreachable")


class _Coverage:
    """Counts the bytes of each non-empty tensor still to land; thread-safe."""

    def __init__(self, header: Header) -> None:
        self.tensors = [t for t in header.tensors if t.nbytes]
        self._starts = [t.begin for t in self.tensors]
        self._left = {t.name: t.nbytes for t in self.tensors}
        self._lock = threading.Lock()
        self.aborted = False

    def pieces(self, offset: int, end: int) -> Iterator[tuple[TensorInfo, int, int]]:
        """``(tensor, begin, end)`` for each tensor overlapping ``[offset, end)``."""
        first = max(0, bisect.bisect_right(self._starts, offset) - 1)
        for t in self.tensors[first:]:
            if t.begin >= end:
                return
            begin, stop = max(offset, t.begin), min(end, t.end)
            if stop > begin:
                yield t, begin, stop

    def landed(self, offset: int, end: int) -> list[TensorInfo]:
        """Record ``[offset, end)`` as landed; returns the tensors it completed (none once
        aborted, so a failed file never hands over a tensor)."""
        done = []
        with self._lock:
            if self.aborted:
                return []
            for t, begin, stop in self.pieces(offset, end):
                self._left[t.name] -= stop - begin
                if self._left[t.name] == 0:
                    done.append(t)
        return done

    def check_complete(self, path: str) -> None:
        with self._lock:
            missing = [name for name, left in self._left.items() if left]
        if missing:
            raise FormatError(f"{path}: tensors never completed: {missing[:5]}")

    def abort(self) -> None:
        with self._lock:
            self.aborted = True


Emit = Callable[[str, "torch.Tensor"], None]


class TensorSink:
    """Assembles a file's tensors in host memory of their own; emits each once complete.

    The file's bytes land in one page-aligned anonymous mapping per file, at their file
    offsets: the engine reads ranges straight into it (:meth:`place`) or, when it staged
    them elsewhere, :meth:`write` copies them in. A finished tensor is a view of that
    mapping, which is never reused, so it keeps its bytes for as long as it lives.
    """

    def __init__(self, header: Header, device: str, emit: Emit) -> None:
        self.header = header
        self.device = device
        self.emit = emit
        self._dtypes = torch_dtypes(header)
        self._coverage = _Coverage(header)
        self._mapping: mmap.mmap | None = None
        self._view = memoryview(b"")

    def prepare(self) -> None:
        # Room past the end for the last range's read, padded to the O_DIRECT alignment.
        self._mapping = mmap.mmap(-1, self.header.size + READ_PADDING)
        self._view = memoryview(self._mapping)
        for t in self.header.tensors:
            if not t.nbytes:
                self._deliver(t)

    def place(self, offset: int, length: int) -> memoryview:
        return self._view[offset : offset + length]

    def write(self, data: memoryview, offset: int) -> None:
        if data.obj is not self._mapping:  # staged elsewhere: copy it in
            self._view[offset : offset + len(data)] = data
        for t in self._coverage.landed(offset, offset + len(data)):
            self._deliver(t)

    def _deliver(self, t: TensorInfo) -> None:
        torch = _torch()
        if t.nbytes:
            raw = torch.frombuffer(self._mapping, dtype=torch.uint8, count=t.nbytes, offset=t.begin)
        else:
            raw = torch.empty(0, dtype=torch.uint8)
        tensor = raw.view(self._dtypes[t.name]).reshape(t.shape)
        if self.device != "cpu":  # a device without a staging backend
            tensor = tensor.to(self.device)
        self.emit(t.name, tensor)

    def commit(self) -> None:
        self._coverage.check_complete(self.header.path)

    def abort(self) -> None:
        self._coverage.abort()


class DeviceTensorSink:
    """Sends each landed range to device memory through pinned staging (see
    :mod:`loaderplug.staging`); emits a tensor once its copies have completed.

    Host memory stays bounded by the staging pool: the file is never assembled on the
    host. Each tensor gets device memory of its own when the file is prepared.
    """

    def __init__(self, header: Header, pool: StagingPool, emit: Emit) -> None:
        self.header = header
        self.pool = pool
        self.emit = emit
        self._dtypes = torch_dtypes(header)
        self._coverage = _Coverage(header)
        self._device: dict[str, torch.Tensor] = {}
        self._lock = threading.Lock()
        self._aborted = False

    def prepare(self) -> None:
        for t in self._coverage.tensors:
            self._device[t.name] = self.pool.backend.empty(t.nbytes)
        for t in self.header.tensors:
            if not t.nbytes:
                self._deliver(t, self.pool.backend.empty(0))

    def write(self, data: memoryview, offset: int) -> None:
        step = self.pool.size
        for start in range(0, len(data), step):
            self._stage(data[start : start + step], offset + start)

    def _stage(self, data: memoryview, offset: int) -> None:
        end = offset + len(data)
        buffer = self.pool.take()
        try:
            as_bytes(buffer)[: len(data)] = data
            with self._lock:  # abort() may be dropping the device memory
                if self._aborted:
                    return
                for t, begin, stop in self._coverage.pieces(offset, end):
                    self.pool.backend.copy_async(
                        self._device[t.name][begin - t.begin : stop - t.begin],
                        buffer[begin - offset : stop - offset],
                    )
        finally:
            self.pool.give(buffer, self.pool.backend.record())
        done = self._coverage.landed(offset, end)
        if not done:
            return
        # Other writers may have queued pieces of these tensors after this writer's
        # event; an event recorded now follows every copy queued before they reported
        # their pieces landed (one stream runs copies in order).
        self.pool.backend.record().synchronize()
        with self._lock:
            finished = [(t, self._device.pop(t.name, None)) for t in done]
        for t, raw in finished:
            if raw is not None:
                self._deliver(t, raw)

    def _deliver(self, t: TensorInfo, raw: torch.Tensor) -> None:
        self.emit(t.name, raw.view(self._dtypes[t.name]).reshape(t.shape))

    def commit(self) -> None:
        self._coverage.check_complete(self.header.path)

    def abort(self) -> None:
        self._coverage.abort()
        with self._lock:
            self._aborted = True
            # Copies already queued finish before their device memory can be reused.
            self.pool.backend.record().synchronize()
            self._device.clear()


_DONE = object()


def _served_from_memory(policy: IOPolicy) -> bool:
    """Buffered on a local filesystem means the bytes are in memory already (tmpfs, or a
    file mostly in the page cache): mapping them beats copying them."""
    return not policy.direct and not is_network_type(policy.fs_type)


def _mapped_tensors(header: Header) -> Iterator[tuple[str, torch.Tensor]]:
    """Tensors over a private (copy-on-write) mapping of the file, as safetensors does:
    they share the page cache's pages until written to, and own their mapping."""
    torch = _torch()
    with open(header.path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else None
    for t in header.tensors:
        dtype = torch_dtype(header.path, t.name, t.dtype)
        if not t.nbytes or mapping is None:
            yield t.name, torch.empty(t.shape, dtype=dtype)
            continue
        raw = torch.frombuffer(mapping, dtype=torch.uint8, count=t.nbytes, offset=t.begin)
        yield t.name, raw.view(dtype).reshape(t.shape)


def iter_tensors(
    paths: Sequence[str | os.PathLike[str]],
    device: str = "cpu",
    *,
    local_dir: str | os.PathLike[str] | None = None,
    settings: Settings | None = None,
    stats: dict[str, Any] | None = None,
    **overrides: Any,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` from safetensors ``paths`` as each tensor completes.

    With ``local_dir``, each file is also hydrated there (same name) in the same pass.
    A file that fails raises :class:`TransferFailed` (a ``HydrateError``) naming it; a
    tensor is only ever yielded whole. ``stats``, if given, receives the job's report and
    the time to first tensor.
    """
    settings = (settings or from_env()).replace(**overrides)
    pm = plugin_manager(settings.disable_plugins)
    ready: queue.SimpleQueue[Any] = queue.SimpleQueue()
    jobs = []
    backend = backend_for(device)
    pool = pool_for(backend, settings.bytes_in_flight) if backend is not None else None

    def tensor_sink(header: Header) -> Sink:
        def emit(name: str, tensor: torch.Tensor) -> None:
            ready.put((name, tensor))

        if pool is not None:
            return DeviceTensorSink(header, pool, emit)
        return TensorSink(header, device, emit)

    mapped: list[Header] = []
    io_modes: dict[str, str] = {}
    for raw_path in paths:
        path = str(raw_path)
        policy = first_result(pm, "loaderplug_io_policy", path=path, mode=settings.direct_io)
        identity, header = _read_header_retrying(pm, settings, path, policy)
        if local_dir is None and device == "cpu" and _served_from_memory(policy):
            io_modes[path] = f"mapped ({policy.reason})"
            mapped.append(header)
            continue
        io_modes[path] = f"{'direct' if policy.direct else 'buffered'} ({policy.reason})"
        sinks: list[Sink] = []
        if local_dir is not None:
            dst = Path(local_dir) / Path(path).name
            target = first_result(
                pm, "loaderplug_io_policy", path=str(dst), mode=settings.direct_io
            )
            sinks.append(file_sink(dst, identity, settings, target))
        sinks.append(tensor_sink(header))
        jobs.append(FileJob(Path(path).name, path, identity, sinks, policy))
    engine = Engine(settings, pm, job="load")
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["results"] = engine.run(jobs)
        except BaseException as exc:
            outcome["error"] = exc
        finally:
            ready.put(_DONE)

    started = time.monotonic()
    worker = threading.Thread(target=run, name="loaderplug-load", daemon=True)
    worker.start()
    first_at: float | None = None
    try:
        for header in mapped:
            for item in _mapped_tensors(header):
                if first_at is None:
                    first_at = time.monotonic() - started
                yield item
        while (item := ready.get()) is not _DONE:
            if first_at is None:
                first_at = time.monotonic() - started
            yield item
    finally:
        if worker.is_alive():  # the consumer stopped early, or an error: stop reading
            engine.cancel()
        worker.join()
    if "error" in outcome:
        raise outcome["error"]
    report = TransferReport(
        "load",
        ",".join(map(str, paths)),
        str(local_dir or ""),
        engine.workers,
        engine.chunk,
        outcome["results"],
        engine.bytes_copied,
        time.monotonic() - started,
        engine.retries,
    )
    if stats is not None:
        stats.update(report=report, first_tensor_s=first_at, io=io_modes)
    if not report.ok:
        raise TransferFailed(report)


def load_file(path: str | os.PathLike[str], device: str = "cpu") -> dict[str, torch.Tensor]:
    """A drop-in for ``safetensors.torch.load_file``: every tensor, owned, on ``device``."""
    return dict(iter_tensors([path], device))
