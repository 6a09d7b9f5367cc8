"""Sharing by stream (a one pass from a network mirror, CPU tensors): no byte moves
between ranks. At each step each rank names its tensors that landed since the last; the
others map the file it is reading (or the copy it is writing) and take each tensor from
their mapping, and a one pass's copy leaves the page cache as every rank is done with
it."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loaderplug.jobs.partial import open_copy
from loaderplug.jobs.runner import Runner
from loaderplug.tensors.delivery.choice import TensorDelivery
from loaderplug.tensors.delivery.hand_over import Idle, TensorReady
from loaderplug.tensors.delivery.tensor_sinks import MappedFile
from loaderplug.tensors.device.path import DevicePath
from loaderplug.tensors.format.header import Header
from loaderplug.tensors.memory.copy_pages import ConsumedPages
from loaderplug.tensors.ranks.batches import LandedBatches
from loaderplug.tensors.ranks.files import FileKey, held_as_said
from loaderplug.tensors.ranks.steps import SharedPairs, Steps, cannot_map, each_step

# How long a streaming rank waits for a tensor of its own before it steps on without
# one: short next to the load, long next to a step. Measured (4 ranks, 3.8 GiB from the
# FUSE mirror, 2 cores): at 20 ms the idle steps cost the ranks 7.0-7.3 s of CPU and the
# load 1.14-1.19x a plain hydrate; at 100 ms 4.9 s and 1.05-1.06x, the first tensor at
# 0.72 s (1.07-1.66 s with no idle steps).
STREAM_IDLE_S = 0.1


def by_stream(
    runner: Runner,
    steps: Steps,
    files: list[Path],
    agreed: list[FileKey],
    local: Path | None,
    delivery: TensorDelivery,
    device: DevicePath,
) -> SharedPairs:
    """Steps as in a broadcast, but no byte moves between ranks: at each step each rank
    names the tensors of its own that landed since the last (and, with a file's first,
    the file's header), or that none did; the others map the file it is reading (or,
    in a one pass, the copy it is writing) and take each tensor from their mapping,
    touching only the pages they use. A one pass's copy leaves the page cache tensor by
    tensor as every rank has had it (see :mod:`loaderplug.tensors.memory.copy_pages`)."""
    # A rank with no tensor of its own yet steps on without one after a moment, so that
    # the others' tensors reach it: the first tensor reaches every rank when the first
    # rank has one, not when the last does.
    delivery.idle_after_s = STREAM_IDLE_S
    events = runner.run()
    files_mapped = MappedFiles(files, agreed, local, device)
    index = {f.name: i for i, f in enumerate(files)}
    told: set[int] = set()  # the files whose header this rank has sent
    pages = ConsumedPages([local / f.name for f in files]) if local is not None else None

    def new_step() -> StreamStep:
        return StreamStep(steps, files_mapped, index, delivery.headers, told, pages)

    try:
        yield from each_step(LandedBatches(events, delivery), new_step, steps)
        # Every rank past the last step lets go of its mappings, so that what is left
        # of a one pass's copy in the page cache can go too (but the tensors the
        # consumers still hold). On every rank alike, whatever its local folder.
        files_mapped.close()
        steps.exchange(None)
    finally:
        events.close()
        files_mapped.close()
        if pages is not None:
            pages.close()


class MappedFiles:
    """The other ranks' files as this rank maps them, each on its first tensor."""

    def __init__(
        self, files: list[Path], agreed: list[FileKey], local: Path | None, device: DevicePath
    ) -> None:
        self.files, self.agreed, self.local, self.device = files, agreed, local, device
        self.headers: dict[int, Header] = {}
        self._open: dict[int, MappedFile] = {}

    def tensor(self, index: int, name: str) -> Any:
        if index not in self._open:
            self._open[index] = self._map(index)
        return self.device.to_device(self._open[index].tensor(name))

    def _map(self, index: int) -> MappedFile:
        """Map where the file's bytes are: in a one pass the copy being written or, once
        published (renamed into place), the copy; else the file being read."""
        header = self.headers[index]
        if self.local is None:
            # The file the ranks agreed on, whatever its name leads to by now.
            held = held_as_said(self.files[index], self.agreed[index], "the ranks agreed on")
            try:
                return MappedFile(header, held=held)
            finally:
                held.close()  # the mapping keeps the file
        return open_copy(self.local / self.files[index].name, lambda p: MappedFile(header, str(p)))

    def close(self) -> None:
        for mapped in self._open.values():
            mapped.close()
        self._open.clear()


class StreamStep(Iterator[tuple[str, Any]]):
    """One step of a stream: this rank's offer (its own tensors landed by now,
    :attr:`own`, or that it has none yet), then every tensor offered, in rank order: its
    own from its memory, the others' from the mappings. It lets go of each own tensor
    as it hands it over; with ``pages``, the copy's pages of the tensors it offered two
    steps before leave the page cache."""

    def __init__(
        self,
        steps: Steps,
        files: MappedFiles,
        index: dict[str, int],
        headers: dict[str, Header],
        told: set[int],
        pages: ConsumedPages | None,
    ) -> None:
        self.steps, self.files = steps, files
        self.index, self.headers, self.told = index, headers, told
        self.pages = pages
        self.own: collections.deque[TensorReady] | Idle | None = None
        self.error: BaseException | None = None  # a mapping this rank could not make
        self._said: list[Any] = []
        self._next_rank = 0
        self._next_item = 0  # in the offer of rank ``_next_rank``

    def offer(self) -> tuple[str, Any] | None:
        if self.own is None:
            return None
        if isinstance(self.own, Idle):
            return ("waiting", None)
        offers = []
        for ready in self.own:
            file, header = self.index[ready.rel], self.headers[ready.rel]
            if self.pages is not None:
                self.pages.offered(file, header, ready.name)
            offers.append((file, ready.name, header if file not in self.told else None))
            self.told.add(file)
        return ("tensors", offers)

    def hand_over(self, said: list[Any]) -> StreamStep:
        self._said, self._next_rank, self._next_item = said, 0, 0
        if self.pages is not None:
            self.pages.step_entered(handed=any(s is not None and s[0] == "tensors" for s in said))
        return self

    def __next__(self) -> tuple[str, Any]:
        while self._next_rank < len(self._said):
            rank, step = self._next_rank, self._said[self._next_rank]
            if step is None or step[0] != "tensors" or self._next_item == len(step[1]):
                self._next_rank, self._next_item = self._next_rank + 1, 0
                continue
            file, name, header = step[1][self._next_item]
            self._next_item += 1
            if rank == self.steps.share.rank:
                assert isinstance(self.own, collections.deque)
                return name, self.own.popleft().tensor
            if header is not None:
                self.files.headers[file] = header
            try:
                return name, self.files.tensor(file, name)
            except Exception as exc:
                self.error = cannot_map(self.files.files[file], exc)
                break
        raise StopIteration
