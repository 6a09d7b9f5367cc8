"""Text from a mirror (file names, the reasons they failed, errors naming them) reaches
the terminal escaped: a name cannot clear a line, move the cursor, set the window's
title or start a line of its own that looks like loaderplug's."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from loaderplug.jobs.model_folder import MANIFEST_NAME
from loaderplug.report import printable
from tests.helpers.cli import run_cli

REPO = Path(__file__).resolve().parent.parent
# Erase the line, go back to its start, and write a report line of one's own.
FORGED = "\x1b[2K\rhydrate done: 0 failed\nloaderplug: all files verified"


def loaderplug(*args: str) -> subprocess.CompletedProcess[str]:
    return run_cli(*args)


def raw_control(text: str) -> list[str]:
    """The characters of ``text`` a terminal would act on, other than line ends."""
    return [c for c in text if (ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) < 0xA0]


def test_a_mirror_file_name_is_shown_escaped_in_the_report(model: Path, tmp_path: Path) -> None:
    os.mkfifo(model / f"evil{FORGED}")  # refused (a FIFO), and so named in the report
    done = loaderplug("hydrate", "--from", str(model), "--to", str(tmp_path / "local"))
    assert done.returncode == 1
    assert raw_control(done.stdout) == []
    forged = ("hydrate done", "loaderplug: all")
    assert not any(line.startswith(forged) for line in done.stdout.splitlines())
    assert f"FAILED evil{printable(FORGED)}: " in done.stdout


def test_an_error_naming_a_mirror_path_is_shown_escaped(tmp_path: Path) -> None:
    mirror = tmp_path / f"models\x1b]0;owned\x07{FORGED}"
    mirror.mkdir()
    (mirror / "w.bin").write_bytes(b"x")
    os.mkfifo(mirror / MANIFEST_NAME)
    done = loaderplug("hydrate", "--from", str(mirror), "--to", str(tmp_path / "local"))
    assert done.returncode == 1
    assert raw_control(done.stderr) == []
    assert len(done.stderr.splitlines()) == 1
    assert printable(str(mirror)) in done.stderr


def test_printable_escapes_what_a_terminal_acts_on_and_keeps_the_rest() -> None:
    assert printable("a\x1b[31mb\tc\rd\ne\x9bf\u202eg\udcff") == (
        "a\\x1b[31mb\\tc\\rd\\ne\\x9bf\\u202eg\\udcff"
    )
    assert printable("model-é-中文-😀.safetensors") == "model-é-中文-😀.safetensors"
