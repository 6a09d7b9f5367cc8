"""The steps of a shared load: the ranks advance all together, each saying at every
step (through one small collective) what it has done since the last one, and an error
on any rank is raised on every rank. Each collective is waited for in short slices with
an eye on the peers' processes, so a death ends the wait at once.

How the steps end (the watch stopped, the groups freed) is
:mod:`~loaderplug.tensors.ranks.teardown`; what the ranks agree on in them (the sharing
mode, the files) is :mod:`~loaderplug.tensors.ranks.agreement`."""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any, NoReturn, Protocol

from loaderplug.errors import DistributedError, LoaderplugError
from loaderplug.tensors.ranks.collectives import WAKE, collective, completed_well, stopped_answering
from loaderplug.tensors.ranks.peers import PeerWatch
from loaderplug.tensors.ranks.world import Share

log = logging.getLogger(__name__)

# A sharing mode's hand-over: every tensor of the load, on this rank.
SharedPairs = Generator[tuple[str, Any], None, None]


class Steps:
    """The share's collectives, each waited for with an eye on the peers: a collective
    on the share's (gloo) group is started asynchronously and waited for in short
    slices, so a peer's death ends the wait at once, whatever gloo makes of it."""

    WAKE = WAKE

    def __init__(self, share: Share, watch: PeerWatch) -> None:
        self.share = share
        self.watch = watch
        self.pending: Any = None  # a collective not waited out (a peer died during it)

    def exchange(self, news: tuple[str, Any] | None) -> list[tuple[str, Any] | None]:
        """Tell the other ranks ``news`` and hear theirs; an error anywhere (a rank's
        error, a dead rank) is raised here, on every rank alike."""
        import torch
        import torch.distributed as dist

        self.watch.check()
        size, group = self.share.size, self.share.group
        # As all_gather_object does, in two collectives (lengths, then the padded
        # bytes), but asynchronous, so the wait can watch the peers.
        payload = torch.frombuffer(bytearray(pickle.dumps(news)), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(size)]
        self._wait(dist.all_gather(lengths, length, group=group, async_op=True))
        longest = max(int(n.item()) for n in lengths)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: payload.numel()] = payload
        gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(size)]
        self._wait(dist.all_gather(gathered, padded, group=group, async_op=True))
        said: list[tuple[str, Any] | None] = [
            pickle.loads(data[: int(n.item())].numpy().tobytes())
            for data, n in zip(gathered, lengths, strict=True)
        ]
        for rank, step in enumerate(said):
            # This rank's own error is raised by :meth:`fail`, as itself.
            if step is not None and step[0] == "error" and rank != self.share.rank:
                raise DistributedError(
                    f"rank {self.share.global_ranks[rank]} of the shared load failed: {step[1]}"
                )
        return said

    def fail(self, exc: BaseException) -> NoReturn:
        """Tell the other ranks this one failed, then raise ``exc`` itself (its type and
        traceback, for this rank's caller); the others raise a
        :class:`DistributedError` naming this rank and ``exc``."""
        try:
            self.exchange(("error", str(exc) or type(exc).__name__))
            told = None
        except DistributedError as other:  # another rank failed or died meanwhile
            told = other
        if told is not None:
            log.info("rank %s also met: %s", self.share.global_ranks[self.share.rank], told)
        raise exc

    def gather(self, tensor: Any) -> list[Any]:
        """Every rank's ``tensor`` (all of one shape), in rank order, watched."""
        import torch
        import torch.distributed as dist

        gathered = [torch.empty_like(tensor) for _ in range(self.share.size)]
        self._wait(dist.all_gather(gathered, tensor, group=self.share.group, async_op=True))
        return gathered

    def broadcast(self, raw: Any, src: int, group: Any) -> None:
        """``raw`` from global rank ``src`` to the others over ``group``: the share's
        own, watched, or an NCCL group (blocking: NCCL's own watchdog guards it)."""
        import torch.distributed as dist

        if group is not self.share.group:
            collective(dist.broadcast, raw, src=src, group=group)
            return
        self._wait(dist.broadcast(raw, src=src, group=group, async_op=True))

    def _wait(self, work: Any) -> None:
        self.pending = work
        while True:
            self.watch.check()
            try:
                work.wait(timeout=self.WAKE)
                self.pending = None
                return
            except RuntimeError as exc:
                if not work.is_completed():
                    continue  # only this slice of the wait ran out
                if completed_well(work):
                    # The slice ran out a moment before the collective completed:
                    # gloo says "timed out", yet it is done and went well.
                    self.pending = None
                    return
                # A peer's death fails the collective a moment before it is seen.
                self.watch.check(wait_s=self.watch.settle_s)
                raise stopped_answering(exc) from exc


class Step(Protocol):
    """One step of a per-tensor share (see :func:`each_step`)."""

    own: Any
    error: BaseException | None

    def offer(self) -> tuple[str, Any] | None: ...

    def hand_over(self, said: list[Any]) -> Iterator[tuple[str, Any]]: ...


def each_step(
    own: Iterator[Any], new_step: Callable[[], Step], steps: Steps
) -> Iterator[tuple[str, Any]]:
    """Steps until every rank is done: at each, every rank offers its next own tensor
    (``step.offer()``; a stream's rank may say it has none yet) and hands over every
    tensor offered (``step.hand_over(said)``).
    An error, this rank's own or one it met handing over, ends the load on every rank."""
    done = False
    while True:
        step = new_step()
        if not done:
            try:
                step.own = next(own, None)
            except Exception as exc:  # every rank hears of it at once
                steps.fail(exc)
            done = step.own is None
        said = steps.exchange(step.offer())
        yield from step.hand_over(said)
        if step.error is not None:  # the others hear of it at once, and all raise
            steps.fail(step.error)
        if all(s is None for s in said):
            return


def cannot_map(path: Path, exc: Exception) -> Exception:
    """The error of another rank's file this rank could not map: ``exc`` itself, or,
    for an OSError, a :class:`LoaderplugError` naming the file (caused by it)."""
    if not isinstance(exc, OSError):
        return exc
    try:
        raise LoaderplugError(f"cannot map {path.name}: {exc}") from exc
    except LoaderplugError as error:  # raised, so that it carries where it happened
        return error
