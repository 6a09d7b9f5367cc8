"""Sharing by broadcast: a step per tensor, each broadcast from its owner over the group
(CUDA tensors over NCCL, or files on a network filesystem, whose pages no other
process can share)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from loaderplug.jobs.runner import Runner
from loaderplug.tensors.delivery.hand_over import TensorsOf
from loaderplug.tensors.device.path import DevicePath
from loaderplug.tensors.ranks.groups import Gather, agreed_group
from loaderplug.tensors.ranks.steps import SharedPairs, Steps, each_step


def by_broadcast(runner: Runner, steps: Steps, device: DevicePath, data_group: Any) -> SharedPairs:
    """A step per tensor: each rank offers its next own tensor, and every offered tensor
    is broadcast from its owner to the others over ``data_group``."""
    events = runner.run()
    try:
        yield from each_step(
            TensorsOf(events), lambda: BroadcastStep(steps, device, data_group), steps
        )
    finally:
        events.close()


def data_group(steps: Steps, device: DevicePath) -> Any:
    """The group tensors are broadcast over: the share's own (gloo) for host tensors, a
    group of the same ranks on the device's collective backend for device ones (NCCL
    for CUDA, from the reader's device copy)."""
    share = steps.share
    if device.collective == "gloo":
        return share.group
    return agreed_group(share.global_ranks, _by_steps(steps), share.timeout_s, device.collective)


def _by_steps(steps: Steps) -> Gather:
    """The gather of :func:`agreed_group` as a step of the share: watched, so a peer's
    death ends it at once."""

    def gather(mine: int) -> dict[int, int]:
        said = steps.exchange(("groups", mine))
        return {
            rank: step[1] if step is not None else 0
            for rank, step in zip(steps.share.global_ranks, said, strict=True)
        }

    return gather


class BroadcastStep(Iterator[tuple[str, Any]]):
    """One step of a broadcast: this rank's offer (its next own tensor, :attr:`own`),
    then every tensor offered, in rank order, each broadcast from its owner and handed
    over. It lets go of its own tensor as it hands it over."""

    def __init__(self, steps: Steps, device: DevicePath, data_group: Any) -> None:
        self.steps, self.device, self.data_group = steps, device, data_group
        self.own: tuple[str, Any] | None = None
        self.error: BaseException | None = None  # a broadcast's failure is the collective's
        self._said: list[Any] = []
        self._next_rank = 0

    def offer(self) -> tuple[str, Any] | None:
        if self.own is None:
            return None
        name, tensor = self.own
        return ("tensor", (name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape)))

    def hand_over(self, said: list[Any]) -> BroadcastStep:
        self._said, self._next_rank = said, 0
        return self

    def __next__(self) -> tuple[str, Any]:
        import torch

        share = self.steps.share
        while self._next_rank < len(self._said):
            rank, step = self._next_rank, self._said[self._next_rank]
            self._next_rank += 1
            if step is None or step[0] != "tensor":
                continue
            name, dtype_name, shape = step[1]
            if rank == share.rank:
                assert self.own is not None
                tensor, self.own = self.own[1].contiguous(), None
            else:
                tensor = self.device.receive_buffer(getattr(torch, dtype_name), shape)
            raw = tensor.view(-1).view(torch.uint8) if tensor.numel() else tensor
            if raw.numel():
                self.steps.broadcast(raw, share.global_ranks[rank], self.data_group)
            return name, tensor
        raise StopIteration
