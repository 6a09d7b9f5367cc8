"""The memory budget: a load's host memory stays within it, whatever the model's size,
and never waits on itself."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from loaderplug.engine.retry import Cancelled
from loaderplug.tensors.budget import MemoryBudget
from loaderplug.testing.model import write_model
from loaderplug.units import MiB

REPO = Path(__file__).resolve().parent.parent


def test_a_span_waits_for_room_and_goes_once_there_is_some() -> None:
    budget = MemoryBudget(100)
    cancel = threading.Event()
    budget.admit(80, continuation=False, cancel=cancel)
    admitted = threading.Event()

    def second() -> None:
        budget.admit(40, continuation=False, cancel=cancel)
        admitted.set()

    waiter = threading.Thread(target=second)
    waiter.start()
    assert not admitted.wait(0.2)
    budget.release(80)
    assert admitted.wait(5)
    waiter.join()
    assert budget.held == 40


def test_a_continuation_and_a_span_larger_than_the_budget_never_wait() -> None:
    budget = MemoryBudget(100)
    cancel = threading.Event()
    budget.admit(90, continuation=False, cancel=cancel)
    budget.admit(90, continuation=True, cancel=cancel)  # finishes a tensor begun before
    assert budget.held == 180
    budget.release(180)
    budget.admit(500, continuation=False, cancel=cancel)  # alone: the budget stretches
    assert budget.peak == 500


def test_a_waiting_span_is_cancelled() -> None:
    budget = MemoryBudget(10)
    cancel = threading.Event()
    budget.admit(10, continuation=False, cancel=cancel)
    cancel.set()
    with pytest.raises(Cancelled):
        budget.admit(5, continuation=False, cancel=cancel)


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


@pytest.mark.slow
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
    # handed over) + 64 MiB (the interpreter's own, a span past the budget to finish a
    # tensor); holding the model would take 256 MiB.
    bound = 32 * MiB + 2 * figures["largest"] + 64 * MiB
    assert figures["growth"] <= bound, figures
