"""Sharing through the page cache: each rank reads its own files buffered, says when
one is done, and the others map it from the page cache, as safetensors does, without
reading the disk again (CPU tensors from files on a local filesystem)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loaderplug.errors import LoaderplugError
from loaderplug.jobs.runner import Runner
from loaderplug.tensors.delivery.hand_over import TensorsOf
from loaderplug.tensors.delivery.tensor_sinks import MappedTensors
from loaderplug.tensors.device.path import DevicePath
from loaderplug.tensors.format.read import read_header_of
from loaderplug.tensors.ranks.files import FileKey, held_as_said, on_this_host
from loaderplug.tensors.ranks.steps import SharedPairs, Steps, cannot_map


def by_page_cache(
    runner: Runner,
    steps: Steps,
    files: list[Path],
    final: list[Path],
    device: DevicePath,
    agreed: list[FileKey] | None,
) -> SharedPairs:
    """Own tensors as they complete; at each own file done, a step: the files the other
    ranks finished meanwhile are mapped from the page cache and yielded. ``agreed``:
    the files read in place, as the ranks agreed on them before the load; None in a one
    pass, where each is the copy its owner published."""
    index = {f.name: i for i, f in enumerate(files)}
    events = runner.run()
    try:
        yield from _page_cache_steps(events, steps, index, final, device, agreed)
    finally:
        events.close()  # stopped early, or another rank failed: stop reading


def _page_cache_steps(
    events: Iterator[Any],
    steps: Steps,
    index: dict[str, int],
    final: list[Path],
    device: DevicePath,
    agreed: list[FileKey] | None,
) -> Iterator[tuple[str, Any]]:
    """A failure, this rank's own or a mapping of another's file, fails every rank at
    once (:meth:`Steps.fail`)."""
    own = TensorsOf(events, pause_at_files=True)
    while True:
        news: tuple[str, Any] | None = None
        if not own.done:
            try:
                yield from own  # up to this rank's next file done
            except Exception as exc:
                steps.fail(exc)
            result = own.finished
            if result is not None and result.status == "failed":
                steps.fail(LoaderplugError(f"{result.path}: {result.reason}"))
            if result is not None:
                at = index[result.path]
                # A file read in place is the one agreed on (the name may lead to another
                # by now); a copy, the one this rank published.
                key = agreed[at] if agreed is not None else _key(final[at], steps)
                news = ("file", (at, key))
        said = steps.exchange(news)
        for rank, step in enumerate(said):
            if rank != steps.share.rank and step is not None and step[0] == "file":
                owner = f"rank {steps.share.global_ranks[rank]}"
                at, key = step[1]
                yield from _mapped(final[at], key, owner, steps, device)
        if all(step is None for step in said):
            return


def _key(path: Path, steps: Steps) -> FileKey:
    """The file this rank read (or published) at ``path``, as the others are to find it."""
    try:
        return on_this_host(path)
    except LoaderplugError as exc:
        steps.fail(exc)


def _mapped(
    path: Path, said: FileKey, owner: str, steps: Steps, device: DevicePath
) -> Iterator[tuple[str, Any]]:
    """Another rank's file, mapped from the page cache, on ``device``: the file ``owner``
    read (``said``), held open, its header read and its tensors mapped from there."""
    try:
        held = held_as_said(path, said, owner)
        try:
            header = read_header_of(path, held.fd)
        except BaseException:
            held.close()
            raise
        yield from OnDevice(MappedTensors(header, held), device)
    except Exception as exc:
        steps.fail(cannot_map(path, exc))


class OnDevice(Iterator[tuple[str, Any]]):
    """``pairs`` (mapped CPU tensors) on ``device``. An iterator object: it keeps no
    reference to a tensor it handed over."""

    def __init__(self, pairs: Iterator[tuple[str, Any]], device: DevicePath) -> None:
        self._pairs, self._device = pairs, device

    def __next__(self) -> tuple[str, Any]:
        name, tensor = next(self._pairs)
        # Each rank copies from the one page cache to its own device.
        return name, self._device.to_device(tensor)
