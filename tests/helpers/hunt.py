"""A hunt for wrong tensors: random loads while one of their files changes under them.

A trial writes a few safetensors files in two versions (the second with other values
and another layout, so the old header's offsets cut the new bytes wrongly), starts a
load, and at a random tensor the consumer has taken it changes one file: replaces it by
a rename (as a download, ``git`` or ``rsync`` lands a new version), truncates it, or
grows it. The load must then hand over, for every file, the tensors of one whole
version of it, or raise a loaderplug error; anything else (a tensor of neither version,
a mix, a raw exception) is a wrong tensor. The consumer copies each tensor as it takes
it, as a model's ``load_weights`` does, so a tensor is judged by the bytes it held when
handed over.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loaderplug.errors import LoaderplugError

CHANGES = ("rename", "truncate", "grow")


@dataclass
class Versions:
    """Each file's two versions: ``first`` on disk when the load starts, ``second``
    what a rename puts there; tensors by name."""

    paths: list[Path]
    first: dict[str, dict[str, Any]]
    second: dict[str, dict[str, Any]]


def write_versions(folder: Path, rng: random.Random, files: int = 3) -> Versions:
    """``files`` files of a few float32 tensors each, and a second version of each
    written aside (``<name>.next``) with other values and other shapes."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    versions = Versions([], {}, {})
    for index in range(files):
        path = folder / f"model-{index:05d}-of-{files:05d}.safetensors"
        count = rng.randint(3, 8)
        first = {f"layer{index}.w{i}": _filled(rng, 1.0 + i) for i in range(count)}
        second = {f"layer{index}.w{i}": _filled(rng, 100.0 + i) for i in range(count)}
        save_file(first, str(path))
        save_file(second, str(path) + ".next")
        versions.paths.append(path)
        versions.first[path.name] = first
        versions.second[path.name] = second
    del torch
    return versions


def _filled(rng: random.Random, value: float) -> Any:
    import torch

    rows = rng.choice((16, 64, 128, 256))
    return torch.full((rows, rng.choice((1024, 2048, 3072))), value, dtype=torch.float32)


def change(path: Path, how: str, rng: random.Random) -> None:
    """Change ``path`` as ``how`` says, the way other programs do."""
    if how == "rename":
        staged = path.with_name(path.name + ".landing")
        os.link(str(path) + ".next", staged)  # the second version, kept for the check
        os.replace(staged, path)
    elif how == "truncate":
        os.truncate(path, rng.randrange(0, os.stat(path).st_size))
    else:
        with open(path, "ab") as f:
            f.write(os.urandom(rng.randint(1, 1 << 20)))


@dataclass
class Outcome:
    """What a trial's load did: the tensors it handed over (copies), by file, or the
    loaderplug error it raised."""

    taken: dict[str, dict[str, Any]]
    error: LoaderplugError | None


def run_trial(
    load: Callable[[list[Path]], Iterator[tuple[str, Any]]],
    versions: Versions,
    rng: random.Random,
    how: str,
) -> Outcome:
    """Load ``versions.paths`` with ``load``; at a random tensor change one file."""
    total = sum(len(v) for v in versions.first.values())
    at = rng.randint(0, total)
    victim = rng.choice(versions.paths)
    file_of = {name: p.name for p in versions.paths for name in versions.first[p.name]}
    taken: dict[str, dict[str, Any]] = {p.name: {} for p in versions.paths}
    error = None
    try:
        for count, (name, tensor) in enumerate(load(list(versions.paths))):
            taken[file_of[name]][name] = tensor.detach().to("cpu").clone()
            del tensor
            if count == at:
                change(victim, how, rng)
        if at >= total:  # past the end: after the load, which read what it read
            change(victim, how, rng)
    except LoaderplugError as exc:
        error = exc
    return Outcome(taken, error)


def wrong_tensors(outcome: Outcome, versions: Versions) -> list[str]:
    """What is wrong with a trial's outcome: for each file that did not hand over the
    tensors of one whole version (all of them, unless the load raised), why."""
    wrong = []
    for path in versions.paths:
        taken = outcome.taken[path.name]
        first, second = versions.first[path.name], versions.second[path.name]
        if outcome.error is None and set(taken) != set(first):
            wrong.append(f"{path.name}: handed over {sorted(taken)}, not every tensor")
            continue
        if not (_all_equal(taken, first) or _all_equal(taken, second)):
            mixed = [n for n in taken if not _equal_one(taken[n], first[n], second[n])]
            wrong.append(
                f"{path.name}: tensors of neither version or of both (wrong: {mixed[:3]}, "
                f"values {[_values(taken[n]) for n in mixed[:3]]})"
            )
    return wrong


def _all_equal(taken: dict[str, Any], version: dict[str, Any]) -> bool:
    return all(_same(tensor, version[name]) for name, tensor in taken.items())


def _equal_one(tensor: Any, first: Any, second: Any) -> bool:
    return _same(tensor, first) or _same(tensor, second)


def _same(a: Any, b: Any) -> bool:
    return bool(a.dtype == b.dtype and a.shape == b.shape and a.equal(b))


def _values(tensor: Any) -> list[float]:
    return sorted({float(v) for v in tensor.flatten()[:: max(1, tensor.numel() // 64)]})[:4]
