"""Tensor sinks: a file's landed ranges become tensors, each handed over once complete.

:class:`TensorSink` assembles a file's bytes in memory of the load's own (a load to a
device with a backend has its own sink, :mod:`loaderplug.tensors.device.sink`), whoever
reads them: the engine, or the readers of :mod:`loaderplug.tensors.delivery.owned_reads`.
:class:`PageCacheTensorSink` lets the page cache hold a file's bytes and hands over
mappings of them. :class:`MappedTensors` serves a file in memory already over a private
mapping, as safetensors does, where the load's rule says the file stays put
(:mod:`loaderplug.tensors.delivery.map_rule`: a file someone shrinks under a mapping kills the
process that touches it).
"""

from __future__ import annotations

import mmap
import os
import threading
from typing import TYPE_CHECKING

from loaderplug.engine.reading import READ_PADDING
from loaderplug.errors import FileError
from loaderplug.storage.held import HeldFile
from loaderplug.tensors.format.coverage import Coverage, Emit
from loaderplug.tensors.format.header import Header, TensorInfo
from loaderplug.tensors.format.torch_dtypes import (
    TorchLayout,
    empty_tensor,
    torch_dtypes,
    torch_layout,
    torch_module,
)
from loaderplug.tensors.memory.arena import Arena
from loaderplug.tensors.memory.budget import FileHold, MemoryBudget
from loaderplug.tensors.memory.page_release import PageReleaser

if TYPE_CHECKING:
    import torch

    from loaderplug.tensors.device.path import DevicePath


class _CoveredSink:
    """What the tensor sinks that count landed bytes with a :class:`Coverage` share: a
    commit checks every tensor completed, and either end closes the sink once."""

    header: Header
    _coverage: Coverage

    def commit(self) -> None:
        self._coverage.check_complete(self.header.path)
        self._close()

    def abort(self) -> None:
        self._coverage.abort()
        self._close()

    def _close(self) -> None:
        raise NotImplementedError


class TensorSink(_CoveredSink):
    """Assembles a file's tensors in host memory; emits each once complete, and gives its
    memory back when its consumer drops it.

    The file's bytes land in one arena per file (:mod:`loaderplug.tensors.memory.arena`: on
    huge pages where the kernel gives them), at their file offsets: the engine reads
    ranges straight into it (:meth:`place`) or, when it staged them elsewhere,
    :meth:`write` copies them in. A finished tensor is a view of that
    mapping, which is never reused; its pages are returned to the kernel once the
    tensor's storage dies (see :mod:`loaderplug.tensors.memory.page_release`), so a consumer
    that drops each tensor holds a window of the file, never all of it. With a
    ``budget`` the sink holds each tensor there from its first span's admission
    (:meth:`admit`) until the runner hands the tensor over (see
    :mod:`loaderplug.tensors.memory.budget`).
    """

    def __init__(
        self, header: Header, path: DevicePath, emit: Emit, budget: MemoryBudget | None = None
    ) -> None:
        self.header = header
        self.path = path
        self.emit = emit
        self._dtypes = torch_dtypes(header)
        self._coverage = Coverage(header)
        self._hold = FileHold(self._coverage.tensors, budget)
        self._mapping: mmap.mmap | None = None
        self._pages: PageReleaser | None = None
        self._view = memoryview(b"")

    def prepare(self) -> None:
        # Room past the end for the last range's read, padded to the O_DIRECT alignment.
        size = self.header.size + READ_PADDING
        arena = Arena(size)
        self._mapping = arena.mapping
        self._pages = PageReleaser(arena.mapping, self.header, size, base=arena.base)
        self._view = arena.view
        for t in self.header.tensors:
            if not t.nbytes:
                self._deliver(t)

    # -- the memory budget ---------------------------------------------------------

    def admit(self, offset: int, length: int, cancel: threading.Event) -> None:
        """Hold in the budget, before ``[offset, offset+length)`` is read, every tensor
        it begins, whole (so the spans continuing them need no room)."""
        self._hold.admit(offset, length, cancel)

    # -- landing ---------------------------------------------------------------------

    def place(self, offset: int, length: int, cancel: threading.Event) -> memoryview:
        return self._view[offset : offset + length]

    def placed_read_done(self, offset: int) -> None:
        """Nothing to do: the file's memory is its own, never lent to another range."""

    def write(self, data: memoryview, offset: int) -> None:
        if data.obj is not self._mapping:  # staged elsewhere: copy it in
            self._view[offset : offset + len(data)] = data
        for t in self._coverage.landed(offset, offset + len(data)):
            self._deliver(t)

    def _deliver(self, t: TensorInfo) -> None:
        torch = torch_module()
        dtype = self._dtypes[t.name]
        if not t.nbytes:
            self.emit(t.name, empty_tensor(dtype, t))
            return
        assert self._pages is not None
        if not self._hold.emitting(t.nbytes):  # aborted since it landed
            return
        handle = self._pages.tensor(t)
        tensor = torch.frombuffer(handle, dtype=torch.uint8).view(dtype).reshape(t.torch_shape)
        del handle  # the tensor's storage holds it now, and lets go when it dies
        if not self.path.on_host:  # a device without a backend: moved with .to()
            tensor = self.path.to_device(tensor)
        self.emit(t.name, tensor)

    def _close(self) -> None:
        """The file is done: what it held for tensors it will never emit goes back;
        emitted ones go when handed over."""
        if not self._hold.close():
            return
        if self._pages is not None:
            self._pages.release_rest()


class PageCacheTensorSink(_CoveredSink):
    """Hands over each tensor of a local file, once its bytes landed, as a mapping of the
    file (see :class:`MappedFile`), never a copy of its own.

    For ranks of a host sharing a load through the page cache: the engine reads the file
    buffered into its own reused buffers, which leaves the bytes in the page cache, and
    this sink only counts what landed. The tensor then shares the page cache's pages
    with every other rank's mapping of the same file: the host holds the model once, and
    the reading rank neither zeroes fresh memory for it nor keeps it in its budget. In a
    one pass ``path`` is the partial copy, which the copy's sink (before this one) has
    created at its full size and writes each span to before this sink hears of it; its
    pages are the tensors', and stay theirs once the copy is renamed into place.
    """

    def __init__(self, header: Header, emit: Emit, path: str, held: HeldFile | None = None) -> None:
        self.header = header
        self.emit = emit
        self.path = path  # the file to map: the one read, or the copy being written
        self._held = held  # the file read, as its header saw it
        self._coverage = Coverage(header)
        self._file: MappedFile | None = None
        self._lock = threading.Lock()

    def prepare(self) -> None:
        held, self._held = self._held, None
        try:
            self._file = MappedFile(self.header, self.path, held)
        finally:
            if held is not None:
                held.close()  # the mapping keeps the file
        for t in self.header.tensors:
            if not t.nbytes:
                self.emit(t.name, self._file.tensor(t.name))

    def write(self, data: memoryview, offset: int) -> None:
        # ``data`` was read buffered: its bytes are in the page cache the mapping shares.
        done = self._coverage.landed(offset, offset + len(data))
        if not done:
            return
        with self._lock:
            file = self._file
        if file is not None:
            for t in done:
                self.emit(t.name, file.tensor(t.name))

    def _close(self) -> None:
        with self._lock:
            file, self._file = self._file, None
        if file is not None:
            file.close()


class MappedFile:
    """A file's tensors over one private (copy-on-write) mapping of it, as safetensors
    does: they share the page cache's pages until written to, and each gives its pages
    back when it dies (see :mod:`loaderplug.tensors.memory.page_release`). Tensors are taken
    by name, in any order, or by their place in the file (:meth:`tensor_at`). The file
    mapped is ``held`` (the descriptor its header was read under, see
    :mod:`loaderplug.storage.held`), else ``path`` (by default the header's); one shorter
    than the header says fails here, never in a tensor's view. ``layout``: the header's
    tensors with their torch dtypes and shapes, where the caller has them already."""

    def __init__(
        self,
        header: Header,
        path: str | None = None,
        held: HeldFile | None = None,
        layout: TorchLayout | None = None,
    ) -> None:
        self.torch = torch_module()
        self.header = header
        self.layout = layout if layout is not None else torch_layout(header)
        self._by_name: dict[str, int] | None = None
        if held is not None:
            mapping, size = _map(header, held.fd, held.path)
        else:
            with open(path or header.path, "rb") as f:
                mapping, size = _map(header, f.fileno(), path or header.path)
        # The releaser walks the tensors once more: the list made already, not the table.
        listed = Header(header.path, header.size, header.data_start, self.layout.tensors, {})
        self.releaser = PageReleaser(mapping, listed, size) if mapping is not None else None

    def tensor(self, name: str) -> torch.Tensor:
        if self._by_name is None:
            self._by_name = {t.name: i for i, t in enumerate(self.layout.tensors)}
        return self.tensor_at(self._by_name[name])

    def tensor_at(self, index: int) -> torch.Tensor:
        """The tensor at ``index`` in the order of offsets."""
        layout = self.layout
        t, dtype = layout.tensors[index], layout.dtypes[index]
        if not t.nbytes or self.releaser is None:
            return empty_tensor(dtype, t)
        lib = self.torch
        raw = lib.frombuffer(self.releaser.tensor(t), dtype=lib.uint8)
        tensor: torch.Tensor = raw.view(dtype).reshape(layout.shapes[index])
        return tensor

    def close(self) -> None:
        """Give back the pages no tensor handed over holds (idempotent)."""
        releaser, self.releaser = self.releaser, None
        if releaser is not None:
            releaser.release_rest()


class MappedTensors:
    """Every tensor of a file, in order, over a :class:`MappedFile`; with ``held``, of
    the file open there, which once every tensor is handed over must still be the file
    it was when opened (a truncation or a rewrite in place since fails the file).

    An iterator object, not a generator: nothing of it refers to a tensor it handed
    over, so a tensor its consumer drops is freed at once."""

    def __init__(
        self, header: Header, held: HeldFile | None = None, layout: TorchLayout | None = None
    ) -> None:
        self._file: MappedFile | None = None
        self._held = held
        self._next = 0
        self._count = 0
        try:
            self._file = MappedFile(header, held=held, layout=layout)
            self._count = len(self._file.layout.tensors)
        except BaseException:
            self.close()
            raise

    def __iter__(self) -> MappedTensors:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        held, file, index = self._held, self._file, self._next
        try:
            # Before each tensor (an fstat, about a microsecond): one cut short under the
            # mapping would kill the process that touches it (SIGBUS), one rewritten in
            # place would mix two versions; and after the last.
            if held is not None and file is not None:
                held.check("while its tensors were handed over")
        except BaseException:
            self.close()
            raise
        if file is None or index >= self._count:
            self.close()
            raise StopIteration
        self._next = index + 1
        layout = file.layout
        t, dtype = layout.tensors[index], layout.dtypes[index]
        releaser = file.releaser
        if not t.nbytes or releaser is None:
            return t.name, empty_tensor(dtype, t)
        lib = file.torch  # MappedFile.tensor_at, inline: one call less for each tensor
        raw = lib.frombuffer(releaser.tensor(t), dtype=lib.uint8)
        return t.name, raw.view(dtype).reshape(layout.shapes[index])

    def close(self) -> None:
        """Give back the pages of every tensor not handed over, and the file (idempotent)."""
        file, self._file = self._file, None
        held, self._held = self._held, None
        self._count = 0
        if file is not None:
            file.close()
        if held is not None:
            held.close()

    def __del__(self) -> None:
        # One whose __init__ failed early lacks what close() reads.
        if hasattr(self, "_held"):
            self.close()


def _map(header: Header, fd: int, path: str) -> tuple[mmap.mmap | None, int]:
    """A private mapping of ``header.size`` bytes of the open file ``fd`` (None for an
    empty header), and its length."""
    on_disk = os.fstat(fd).st_size
    size = header.size or on_disk
    if on_disk < size:
        raise FileError(
            f"{path}: ended at {on_disk} bytes, inside its tensors (the header says "
            f"{header.size}): it was truncated or replaced; load it again once it holds "
            "still",
            path=path,
        )
    return (mmap.mmap(fd, size, access=mmap.ACCESS_COPY) if size else None), size
