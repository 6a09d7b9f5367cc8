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
from loaderplug.tensors.rank_steps import SharedPairs, Steps
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
    own = TensorsOf(events, pause_at_files=True)
    while True:
        news: tuple[str, Any] | None = None
        if not own.done:
            try:
                yield from own  # up to this rank's next file done
            except LoaderplugError as exc:
                news, own.done = ("error", str(exc)), True
            else:
                result = own.finished
                if result is not None and result.status == "failed":
                    news = ("error", f"{result.path}: {result.reason}")
                elif result is not None:
                    news = ("file", index[result.path])
        said = steps.exchange(news)
        for rank, step in enumerate(said):
            if rank != steps.share.rank and step is not None and step[0] == "file":
                yield from OnDevice(MappedTensors(read_header_of(final[step[1]])), device)
        if all(step is None for step in said):
            return


class OnDevice(Iterator[tuple[str, Any]]):
    """``pairs`` (mapped CPU tensors) on ``device``. An iterator object: it keeps no
    reference to a tensor it handed over."""

    def __init__(self, pairs: Iterator[tuple[str, Any]], device: DevicePath) -> None:
        self._pairs, self._device = pairs, device

    def __next__(self) -> tuple[str, Any]:
        name, tensor = next(self._pairs)
        # Each rank copies from the one page cache to its own device.
        return name, self._device.to_device(tensor)
