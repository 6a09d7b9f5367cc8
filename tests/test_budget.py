"""The memory budget: a load's host memory stays within it, whatever the model's size,
and never waits on itself."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from loaderplug.engine.retry import Cancelled
from loaderplug.storage.mounts import MEMORY_TYPES, filesystem_type
from loaderplug.tensors.memory.budget import MemoryBudget
from loaderplug.testing.model import write_model, write_shard
from loaderplug.units import MiB
from tests.conftest import drop_from_page_cache

REPO = Path(__file__).resolve().parent.parent


def test_a_span_waits_for_room_and_goes_once_there_is_some() -> None:
    budget = MemoryBudget(100)
    cancel = threading.Event()
    budget.admit(80, finishing=0, cancel=cancel)
    admitted = threading.Event()

    def second() -> None:
        budget.admit(40, finishing=0, cancel=cancel)
        admitted.set()

    waiter = threading.Thread(target=second)
    waiter.start()
    assert not admitted.wait(0.2)
    budget.release(80)
    assert admitted.wait(5)
    waiter.join()
    assert budget.held == 40


def test_what_a_load_cannot_do_without_never_waits() -> None:
    budget = MemoryBudget(100)
    cancel = threading.Event()
    budget.admit(500, finishing=0, cancel=cancel)  # alone: the budget stretches
    budget.admit(0, finishing=500, cancel=cancel)  # continues a tensor held whole
    budget.admit(90, finishing=500, cancel=cancel)  # finishes the only tensor held
    assert (budget.held, budget.peak) == (590, 590)


def test_a_span_finishing_a_tensor_waits_while_others_are_held() -> None:
    budget = MemoryBudget(100)
    cancel = threading.Event()
    budget.admit(30, finishing=0, cancel=cancel)  # a tensor the consumer has not taken
    budget.admit(60, finishing=0, cancel=cancel)  # the tensor being read
    admitted = threading.Event()

    def finishing() -> None:  # its last span begins a 60-byte tensor
        budget.admit(60, finishing=60, cancel=cancel)
        admitted.set()

    waiter = threading.Thread(target=finishing)
    waiter.start()
    assert not admitted.wait(0.2)
    budget.release(30)  # taken and dropped: only the tensor being read is held
    assert admitted.wait(5)
    waiter.join()
    assert budget.held == 120


def test_a_waiting_span_is_cancelled() -> None:
    budget = MemoryBudget(10)
    cancel = threading.Event()
    budget.admit(10, finishing=0, cancel=cancel)
    cancel.set()
    with pytest.raises(Cancelled):
        budget.admit(5, finishing=0, cancel=cancel)


class _Recording(MemoryBudget):
    """A budget that records what each span asked for."""

    def __init__(self) -> None:
        super().__init__(1 << 40)
        self.asked: list[tuple[int, int]] = []

    def admit(self, nbytes: int, *, finishing: int, cancel: threading.Event) -> None:
        self.asked.append((nbytes, finishing))
        super().admit(nbytes, finishing=finishing, cancel=cancel)


def test_a_span_holds_the_tensors_it_begins_whole(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from loaderplug.tensors.delivery.tensor_sinks import TensorSink
    from loaderplug.tensors.format.read import read_header_of

    path = tmp_path / "model.safetensors"
    write_shard(path, [4 * MiB, MiB, 0, MiB, 6 * MiB], first_tensor=0, seed=0)
    header = read_header_of(path)
    data = min(t.begin for t in header.tensors)  # the header's own bytes come first
    budget = _Recording()
    sink = TensorSink(header, "cpu", lambda name, tensor: None, budget)
    cancel = threading.Event()
    spans = [
        (0, data),  # the header alone: no tensor
        (data, 4 * MiB),  # exactly the first tensor
        (data + 4 * MiB, MiB + MiB // 2),  # the next two (and the empty one), at their start
        (data + 5 * MiB + MiB // 2, MiB),  # finishes the third, begins the last
        (data + 6 * MiB + MiB // 2, 5 * MiB + MiB // 2),  # only continues the last
    ]
    for offset, length in spans:
        sink.admit(offset, length, cancel)
    assert budget.asked == [
        (0, 0),
        (4 * MiB, 0),
        (2 * MiB, 0),
        (6 * MiB, MiB),
        (0, 6 * MiB),
    ]
    assert budget.held == 12 * MiB  # every tensor, once
    sink.abort()
    assert budget.held == 0  # none was emitted: all of it goes back


def _load_slowly(paths: list[Path], budget: str) -> tuple[int, int]:
    """Load ``paths`` (cold, 4 MiB spans, eight readers) within ``budget``, the consumer
    slower than the reads: the tensors it got and the most the budget held."""
    from loaderplug.jobs.runner import Runner
    from loaderplug.settings import from_env
    from loaderplug.tensors.delivery.choice import TensorDelivery
    from loaderplug.tensors.delivery.hand_over import TensorsOf
    from loaderplug.tensors.delivery.plan import load_plan
    from loaderplug.tensors.device.path import DevicePath

    if filesystem_type(paths[0].parent) in MEMORY_TYPES:
        pytest.skip("files in memory are mapped, not read: no budget to measure")
    for path in paths:
        drop_from_page_cache(path)  # cold and owned: read by the engine, not mapped
    settings = from_env(
        bytes_in_flight=budget,
        span_bytes="4M",
        readers=8,
        direct_io="off",
        owned="own",
        progress=False,
    )
    plan = load_plan(paths, DevicePath("cpu", None), settings)
    assert isinstance(plan.delivery, TensorDelivery)
    count = 0
    for _name, tensor in TensorsOf(Runner(plan, settings).run()):
        time.sleep(0.02)
        del tensor
        count += 1
    assert plan.delivery.budget.held == 0  # every tensor released once handed over
    return count, plan.delivery.budget.peak


def test_with_a_slow_consumer_the_tensors_held_stay_within_the_budget(tmp_path: Path) -> None:
    """Spans that begin inside a tensor and end inside another (as most do: tensors are
    not aligned to spans): what is held never passes the budget. Letting each such span
    in because it continues a tensor (it also begins others) held 3.4x the budget."""
    pytest.importorskip("torch")
    pattern = [10 * MiB, 3 * MiB, 3 * MiB, MiB, 4096]  # 17 MiB: spans cut across tensors
    paths = [tmp_path / f"model-{i}.safetensors" for i in range(2)]
    for i, path in enumerate(paths):
        write_shard(path, pattern * 3, first_tensor=15 * i, seed=i)
    count, peak = _load_slowly(paths, "16M")
    assert count == 30
    assert 10 * MiB <= peak <= 16 * MiB, peak / MiB  # the tensors were held, and no more


def test_two_tensors_next_to_each_other_larger_than_the_budget_load(tmp_path: Path) -> None:
    """The span that finishes one 12 MiB tensor begins the next: together over the
    16 MiB budget, yet the load cannot go on without it, so it goes once the tensor it
    finishes is all that is held; what is held never passes the two tensors."""
    pytest.importorskip("torch")
    path = tmp_path / "model.safetensors"
    write_shard(path, [12 * MiB] * 4, first_tensor=0, seed=0)
    result: list[tuple[int, int]] = []
    loading = threading.Thread(
        target=lambda: result.append(_load_slowly([path], "16M")), daemon=True
    )
    loading.start()
    loading.join(60)
    assert result, "the load waited on itself"
    count, peak = result[0]
    assert count == 4
    assert 16 * MiB < peak <= 24 * MiB  # stretched to the two, and no further


PEAK = """
import json, resource, sys
import torch  # its own memory is the baseline
from pathlib import Path
from loaderplug.tensors.reader import iter_tensors
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
files = sorted(Path(sys.argv[1]).glob("*.safetensors"))
options = {"local_dir": sys.argv[3]} if len(sys.argv) > 3 else {}
largest = 0
for name, tensor in iter_tensors(files, bytes_in_flight=sys.argv[2], progress=False, **options):
    largest = max(largest, tensor.numel() * tensor.element_size())
    tensor.sum()  # use it, then drop it
    del tensor
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"growth": peak - base, "largest": largest}))
"""


@pytest.mark.slow("a process whose memory is watched as it loads")
@pytest.mark.parametrize("one_pass", [False, True])
def test_a_consumer_that_drops_each_tensor_holds_a_window_not_the_model(
    tmp_path: Path, one_pass: bool
) -> None:
    pytest.importorskip("torch")
    folder = tmp_path / "model"
    write_model(folder, 256 * MiB, shards=2, tensors_per_shard=32)  # 4 MiB tensors
    for shard in folder.glob("*.safetensors"):  # cold: read, not mapped from the cache
        with open(shard, "rb") as f:
            import os

            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    args = [str(folder), "32M"] + ([str(tmp_path / "local")] if one_pass else [])
    done = subprocess.run(
        [sys.executable, "-c", PEAK, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        check=True,
    )
    figures = json.loads(done.stdout)
    # Within bytes in flight + 2 x the largest tensor (the consumer's, and the one just
    # handed over) + 64 MiB (the interpreter's own); holding the model would take
    # 256 MiB.
    bound = 32 * MiB + 2 * figures["largest"] + 64 * MiB
    assert figures["growth"] <= bound, figures
