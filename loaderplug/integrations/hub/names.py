"""Which names of a Hub call the hook may use as paths: a revision under ``refs/``, a
file under ``snapshots/<commit>/`` or a ``local_dir``.

A call names its repo, revision and file, and the hook joins them onto the local cache
and the mirror. Stock huggingface_hub joins them too, but only after checks of its own
(``validate_repo_id``, the repo type, ``_validate_relative_filename``), and it writes
``refs/<revision>`` only for a revision the Hub resolved, which no ``..`` ever is. So a
call with a name that is not plainly a path inside its folder is left to the original:
it raises what stock raises, or works as stock works, and the hook writes nothing for
it. The rules here may refuse more than stock does (the original then answers), never
less.
"""

from __future__ import annotations

import re
from pathlib import PurePosixPath, PureWindowsPath

# What git refuses in a ref name (``git check-ref-format``): a branch or tag the Hub could
# have is none of these, and none of them is needed to name a file under refs/.
_NOT_IN_A_REF = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{|//")


def ref_problem(revision: object) -> str:
    """Why ``revision`` cannot name ``refs/<revision>`` in a cache ("" where it can): a
    branch, a tag (``v1.0``, ``refs/pr/1``) or a commit can; a path that climbs, is
    absolute or hides a segment (``../x``, ``/x``, ``.x``) cannot."""
    if not isinstance(revision, str) or not revision:
        return f"the revision {revision!r} is not a non-empty string"
    if _NOT_IN_A_REF.search(revision) or revision == "@":
        return f"the revision {revision!r} is not a git ref name"
    for segment in revision.split("/"):
        if not segment or segment.startswith(".") or segment.endswith((".lock", ".")):
            return f"the revision {revision!r} is not a git ref name"
    return ""


def filename_problem(filename: object) -> str:
    """Why ``filename`` (a repo path, ``subfolder/filename`` as stock joins them) cannot
    be placed under a folder ("" where it can), by stock huggingface_hub's rule
    (``_validate_relative_filename``: no ``..`` segment, with either separator, and no
    absolute, drive or UNC path under POSIX or Windows rules), and no NUL byte."""
    if not isinstance(filename, str) or not filename:
        return f"the filename {filename!r} is not a non-empty string"
    if "\x00" in filename:
        return f"the filename {filename!r} holds a NUL byte"
    if ".." in filename.replace("\\", "/").split("/"):
        return f"the filename {filename!r} has a '..' segment"
    anchored = [PurePosixPath(filename), *(PureWindowsPath(p) for p in filename.split("/"))]
    if any(path.drive or path.root for path in anchored):
        return f"the filename {filename!r} is an absolute, drive or UNC path"
    return ""
