"""What the ranks (or hosts) of a shared load agree on before they share, in one exchange
each: the sharing mode (rank 0's), and the files they load (the same names, and under
each name the same file).

Before sharing, the ranks of a host say each file's name and key as each sees it
(:mod:`~loaderplug.tensors.ranks.files`), in one exchange per load; files that differ
fail the load on every rank, saying which rank holds which file: never a silent swap,
never a hang. Hosts agree on the names here and compare each file's size and
header digest where they decide whether to split the reads
(:mod:`loaderplug.tensors.hosts.exchange`): hosts whose files differ each load their own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from loaderplug.errors import LoaderplugError
from loaderplug.tensors.ranks.files import FileKey, LoadPath, describe, name_of, on_this_host
from loaderplug.tensors.ranks.mode import SharingMode
from loaderplug.tensors.ranks.steps import Steps


def agreed_mode(steps: Steps, mode: SharingMode) -> SharingMode:
    """Rank 0's sharing mode, on every rank: a local copy published between two ranks'
    looks at it would have them share in different ways."""
    first = steps.exchange(("mode", mode))[0]
    assert first is not None and first[0] == "mode"
    return first[1]  # type: ignore[no-any-return]


def same_files(
    steps: Steps,
    files: Sequence[LoadPath],
    who: str = "rank",
    identify: Callable[[LoadPath], FileKey] | None = on_this_host,
) -> list[FileKey]:
    """Check that every member of ``steps`` loads the same files: of the same names and,
    by ``identify`` (None: by name only), the same files under each name; if not, raise
    the same error on every member, naming the first member that differs from the
    first (``who``: how members are called in the message). Returns each file's key,
    as every member has it. A file this member cannot look at fails the load on every
    member."""
    try:
        keys = [identify(path) if identify is not None else () for path in files]
    except LoaderplugError as exc:
        steps.fail(exc)
    said = steps.exchange(("files", [(name_of(p), k) for p, k in zip(files, keys, strict=True)]))
    lists = [step[1] if step is not None else [] for step in said]
    ranks = steps.share.global_ranks
    names = [[name for name, _ in listed] for listed in lists]
    differing = next((m for m, theirs in enumerate(names) if theirs != names[0]), None)
    if differing is not None:
        raise LoaderplugError(
            f"the ranks of a shared load must load the same files, and {who} "
            f"{ranks[differing]} does not: next to rank {ranks[0]}'s, its list "
            f"{_difference(names[0], names[differing])}; pass every rank the same files"
        )
    for member, listed in enumerate(lists):
        for (name, theirs), mine in zip(listed, lists[0], strict=True):
            if theirs != mine[1]:
                raise LoaderplugError(
                    f"the ranks of a shared load must load the same files, and {who} "
                    f"{ranks[member]} does not: its {name} is another file than rank "
                    f"{ranks[0]}'s ({describe(theirs)} against {describe(mine[1])}); "
                    "load files that differ under one name in separate loads, or give "
                    "them other names"
                )
    return keys


def _difference(first: list[str], theirs: list[str]) -> str:
    lacks, more = sorted(set(first) - set(theirs)), sorted(set(theirs) - set(first))
    parts = [f"lacks {', '.join(lacks)}"] if lacks else []
    parts += [f"also has {', '.join(more)}"] if more else []
    return "; ".join(parts) or "has some twice"
