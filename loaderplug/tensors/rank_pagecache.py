"""Sharing through the page cache: each rank reads its own files buffered, says when
one is done, and the others map it from the page cache, as safetensors does, without
reading the disk again (CPU tensors from files on a local filesystem)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

from loaderplug.errors import LoaderplugError
from loaderplug.jobs.runner import Runner
from loaderplug.tensors.delivery import TensorsOf
from loaderplug.tensors.device_path import DevicePath
from loaderplug.tensors.header_reads import read_header_of
from loaderplug.tensors.rank_steps import SharedPairs, Steps, cannot_map
from loaderplug.tensors.sinks import MappedTensors


def by_page_cache(
    runner: Runner, steps: Steps, files: list[Path], final: list[Path], device: DevicePath
) -> SharedPairs:
    """Own tensors as they complete; at each own file done, a step: the files the other
    ranks finished meanwhile are mapped from the page cache and yielded."""
    index = {f.name: i for i, f in enumerate(files)}
    events = runner.run()
    try:
        yield from _page_cache_steps(events, steps, index, final, device)
    finally:
        events.close()  # stopped early, or another rank failed: stop reading


def _page_cache_steps(
    events: Iterator[Any],
    steps: Steps,
    index: dict[str, int],
    final: list[Path],
    device: DevicePath,
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
                news = ("file", index[result.path])
        said = steps.exchange(news)
        for rank, step in enumerate(said):
            if rank != steps.share.rank and step is not None and step[0] == "file":
                yield from _mapped(final[step[1]], steps, device)
        if all(step is None for step in said):
            return


def _mapped(path: Path, steps: Steps, device: DevicePath) -> Iterator[tuple[str, Any]]:
    """Another rank's file, mapped from the page cache, on ``device``."""
    try:
        yield from OnDevice(MappedTensors(read_header_of(path)), device)
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
