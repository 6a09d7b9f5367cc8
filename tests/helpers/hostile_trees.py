"""Hostile mirrors: trees of links (relative, absolute, chained, dangling, looping),
FIFOs, odd names and deep nesting, built from a seed; and the sentinel tree outside a
destination whose every byte a test checks.

Run as a module it plays one randomized trial in a folder (``python -m
tests.helpers.hostile_trees FOLDER SEED``): it builds a mirror there, plants links in
the destination, hydrates, changes the mirror so that its new files and links aim at
the sentinel tree, hydrates again, and exits non-zero saying what went wrong. The test
runs it in a subprocess with a timeout, so a hang fails it too.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import stat
import sys
from pathlib import Path

# Names a model folder might hold on a mirror someone else writes.
ODD_NAMES = [
    "plain",
    "with space",
    "new\nline",
    "tab\tname",
    "ünïcödé",
    "emoji-\N{GRINNING FACE}",
    "-dash",
    "..dots",
    ".hidden",
    "back\\slash",
    "$(touch pwned)",
    "*glob?[x]",
    "%s%n",
    "n" * 120,
]

# What the sentinel tree holds: what an attacker would aim at.
SENTINEL_FILES = {
    ".bashrc": b"# the user's shell setup\n",
    ".ssh/id_rsa": b"-----BEGIN PRIVATE KEY-----\nsecret\n",
    "deep/a/b/c/data.bin": bytes(range(256)) * 4,
    "config.json": b'{"victim": true}\n',
}

Entry = tuple[str, ...]


def snapshot(root: Path, skip: frozenset[str] = frozenset()) -> dict[str, Entry]:
    """Every entry under ``root`` (its top-level names in ``skip`` left out), by path:
    a file's bytes and mode, a link's target, a folder's mode; nothing is followed and
    no FIFO is opened."""
    found: dict[str, Entry] = {}
    pending = [""]
    while pending:
        rel_dir = pending.pop()
        for entry in os.scandir(root / rel_dir if rel_dir else root):
            if not rel_dir and entry.name in skip:
                continue
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            st = entry.stat(follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                found[rel] = ("link", os.readlink(entry.path))
            elif stat.S_ISDIR(st.st_mode):
                found[rel] = ("dir", oct(stat.S_IMODE(st.st_mode)))
                pending.append(rel)
            elif stat.S_ISREG(st.st_mode):
                data = Path(entry.path).read_bytes()
                found[rel] = ("file", data.hex(), oct(stat.S_IMODE(st.st_mode)))
            else:
                found[rel] = ("special", oct(stat.S_IFMT(st.st_mode)))
    return found


def make_sentinel(root: Path) -> Path:
    """The tree an attacker aims at, outside every destination."""
    for rel, data in SENTINEL_FILES.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    (root / "link-to-config").symlink_to("config.json")
    return root


def chain(depth: int, climb: int) -> tuple[str, dict[str, str]]:
    """The folder ``d0/.../d{depth-1}`` and two links in it: ``0up`` climbing to the
    tree's root, which reads as inside, and ``1esc`` climbing ``climb`` more from
    there through ``0up``, which reads as inside too and leads out."""
    folder = "/".join(f"d{i}" for i in range(depth))
    return folder, {
        f"{folder}/0up": "/".join([".."] * depth),
        f"{folder}/1esc": "/".join(["0up", *[".."] * climb]),
    }


def links_leaving(root: Path, skip: dict[str, str]) -> list[str]:
    """The links under ``root`` that, followed by the kernel, lead out of it (those
    in ``skip``, path -> target, as they stand, excepted)."""
    real = os.path.realpath(root)
    bad = []
    for rel, entry in snapshot(root).items():
        if entry[0] != "link" or skip.get(rel) == entry[1]:
            continue
        leads = os.path.realpath(root / rel)
        if leads != real and not leads.startswith(real + os.sep):
            bad.append(f"{rel!r} -> {entry[1]!r} leads to {leads}")
    return bad


class Trial:
    """One randomized hostile mirror, its destination and the sentinel beside them."""

    def __init__(self, folder: Path, seed: int) -> None:
        self.rng = random.Random(seed)
        self.folder = folder
        self.mirror = folder / "mirror"
        self.local = folder / "local"
        self.sentinel = folder / "outside"
        self.dirs: list[str] = []
        self.links: dict[str, str] = {}
        self.planted: dict[str, str] = {}

    def name(self) -> str:
        return self.rng.choice(ODD_NAMES) + f"{self.rng.randrange(100)}"

    def build(self) -> None:
        """Folders (some deep), files with odd names, links of every kind, FIFOs."""
        self.mirror.mkdir()
        self.dirs = [""]
        for _ in range(self.rng.randrange(3, 12)):
            parent = self.rng.choice(self.dirs)
            rel = "/".join(p for p in [parent, self.name()] if p)
            if rel.count("/") < 30 and len(rel) < 1500:
                (self.mirror / rel).mkdir(exist_ok=True)
                self.dirs.append(rel)
        folder, links = chain(self.rng.randrange(1, 20), self.rng.randrange(1, 40))
        (self.mirror / folder).mkdir(parents=True, exist_ok=True)
        self.dirs.append(folder)
        for rel, target in links.items():
            self._link(rel, target)
        for _ in range(self.rng.randrange(4, 16)):
            path = self.mirror / self._child()
            if not os.path.lexists(path):
                path.write_bytes(self.rng.randbytes(self.rng.randrange(0, 5000)))
        for _ in range(self.rng.randrange(6, 24)):
            self._link(self._child(), self._target())
        loop = self.rng.choice(self.dirs)
        self._link(f"{loop}/loopA".lstrip("/"), "loopB")
        self._link(f"{loop}/loopB".lstrip("/"), "loopA/x")
        for _ in range(self.rng.randrange(0, 3)):
            path = self.mirror / self._child()
            if not os.path.lexists(path):
                os.mkfifo(path)

    def _child(self) -> str:
        return "/".join(p for p in [self.rng.choice(self.dirs), self.name()] if p)

    def _link(self, rel: str, target: str) -> None:
        path = self.mirror / rel
        if not os.path.lexists(path):
            path.symlink_to(target)
            self.links[rel] = target

    def _target(self) -> str:
        """A link target of one of the kinds a hostile mirror holds."""
        depth = self.rng.randrange(0, 8)
        pick = self.rng.randrange(9)
        existing = list(self.links) or ["missing"]
        if pick == 0:  # absolute, at the sentinel or the root
            return self.rng.choice([str(self.sentinel), "/", str(self.sentinel / ".bashrc")])
        if pick == 1:  # climbing, perhaps out
            return "/".join([".."] * self.rng.randrange(1, 40))
        if pick == 2:  # relative, at the sentinel
            return "/".join([".."] * (depth + 1) + ["outside"])
        if pick == 3:  # through another link, then climbing
            return "/".join([self.rng.choice(existing).split("/")[-1], *[".."] * depth])
        if pick == 4:  # dangling
            return self.rng.choice(["missing", "missing/../../..", "nowhere/x"])
        if pick == 5:  # looping
            return self.rng.choice([".", "self/x", self.rng.choice(existing).split("/")[-1]])
        if pick == 6:  # a file or folder inside
            return self.rng.choice(self.dirs[1:] or ["."]).split("/")[-1] or "."
        if pick == 7:  # an odd name
            return self.name()
        return "/".join([*[".."] * depth, self.rng.choice(self.dirs) or "."])

    def plant(self) -> None:
        """Links planted in the destination before the first hydrate: where the mirror
        has folders, and at the names of a copy's partial file and journal."""
        self.local.mkdir()
        for rel in self.rng.sample(self.dirs[1:], k=min(3, len(self.dirs) - 1)):
            self._plant(rel, self.rng.choice([str(self.sentinel), "../" * 40 + "tmp"]))
        files = [
            str(p.relative_to(self.mirror))
            for p in self.mirror.rglob("*")
            if p.is_file() and not p.is_symlink()
        ]
        for rel in self.rng.sample(files, k=min(2, len(files))):
            parent, name = os.path.split(rel)
            suffix = self.rng.choice([".loaderplug-partial", ".loaderplug-landed"])
            victim = str(self.sentinel / self.rng.choice(list(SENTINEL_FILES)))
            self._plant(os.path.join(parent, f".{name}{suffix}"), victim)

    def _plant(self, rel: str, target: str) -> None:
        # Never one under or above another: making its folders would go through it.
        if any(p.startswith(rel + "/") or rel.startswith(p + "/") for p in self.planted):
            return
        path = self.local / rel
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.symlink_to(target)
        except OSError:
            return  # a planted link on the way: this one is not needed
        self.planted[rel] = target

    def aim(self) -> None:
        """Change the mirror: each link that leads out becomes a folder whose files and
        links sit where the sentinel's are, seen through the old link; sometimes a
        manifest lists links that climb out and files under them."""
        outside = os.path.realpath(self.sentinel)
        for rel in list(self.links):
            path = self.mirror / rel
            leads = os.path.realpath(path)
            if not os.path.lexists(path) or leads.startswith(os.path.realpath(self.mirror)):
                continue
            path.unlink()
            del self.links[rel]
            for victim in SENTINEL_FILES:
                aimed = os.path.relpath(os.path.join(outside, victim), leads)
                if aimed.startswith(".."):
                    continue
                where = path / aimed
                where.parent.mkdir(parents=True, exist_ok=True)
                if self.rng.random() < 0.3:
                    where.symlink_to("pwned")
                else:
                    where.write_bytes(b"pwned " + victim.encode())
        if self.rng.random() < 0.4:
            self._hostile_manifest()

    def _hostile_manifest(self) -> None:
        files = {}
        for p in self.mirror.rglob("*"):
            if p.is_file() and not p.is_symlink():
                st = p.stat()
                files[str(p.relative_to(self.mirror))] = {
                    "size": st.st_size,
                    "mtime_ns": st.st_mtime_ns,
                }
        depth = self.rng.randrange(1, 20)
        folder, links = chain(depth, depth + 40)
        victim = os.path.realpath(self.sentinel / ".bashrc").lstrip("/")
        links[f"{folder}/1esc/{victim}"] = "pwned"
        links.update(self.links)
        manifest = {"version": 1, "files": files, "symlinks": links, "incomplete": {}}
        (self.mirror / ".loaderplug-manifest.json").write_text(json.dumps(manifest))


def hydrate_once(trial: Trial) -> str | None:
    """Hydrate the trial's mirror; what went wrong, or None. A refusal is no fault: a
    crash, a changed sentinel, a changed mirror or a link out of the destination is."""
    from loaderplug import LoaderplugError, hydrate

    skip = frozenset({"local"})
    before = snapshot(trial.folder, skip)
    with contextlib.suppress(LoaderplugError):  # a refusal is no fault
        hydrate(trial.mirror, trial.local, check=False, progress=False, readers=4)
    after = snapshot(trial.folder, skip)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if changed:
        return f"a hydrate changed what is outside its destination: {changed[:5]}"
    leaving = links_leaving(trial.local, trial.planted)
    if leaving:
        return f"links in the destination lead out of it: {leaving[:5]}"
    return None


def main(folder: str, seed: int) -> int:
    trial = Trial(Path(folder), seed)
    trial.sentinel.mkdir(exist_ok=True)
    trial.build()
    trial.plant()
    for step in ("first hydrate", "aim", "second hydrate"):
        if step == "aim":
            trial.aim()
            continue
        fault = hydrate_once(trial)
        if fault:
            print(f"{step}: {fault}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2])))
