"""The ``loaderplug`` command (:mod:`.commands`) and its storage bench, doctor and demo."""

from loaderplug.cli.commands import main

__all__ = ["main"]
