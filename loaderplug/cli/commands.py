"""The ``loaderplug`` command: hydrate, sync, load, doctor, bench and a self-contained demo.

Exit codes: 0 done; 1 a file or the job failed (a corrupt file, a missing path, an
unreachable mirror, ...); 2 bad usage or settings only; 130 interrupted.

Whatever it prints that may come from a mirror (file names, reasons, error messages)
goes through :func:`loaderplug.report.printable`: a name cannot write to the terminal.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from types import FrameType

from loaderplug.errors import LoaderplugError, SettingsError
from loaderplug.jobs.copies import hydrate, sync
from loaderplug.report import TransferReport, printable
from loaderplug.settings import BY_FIELD, Settings, from_env
from loaderplug.storage.object_source import ObjectFiles
from loaderplug.storage.object_urls import ObjectURL, is_object_url
from loaderplug.units import MiB, parse_size

EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class _UsageError(Exception):
    """The command line asks for something impossible (exit code 2)."""


def _add_transfer_args(parser: argparse.ArgumentParser, src_help: str, dst_help: str) -> None:
    parser.add_argument("--from", dest="src", required=True, metavar="SRC", help=src_help)
    parser.add_argument("--to", dest="dst", required=True, metavar="DST", help=dst_help)
    # --workers and --chunk-bytes: the old names, kept for a release.
    parser.add_argument(
        "--readers",
        "--workers",
        dest="readers",
        help="reader threads, or auto (LOADERPLUG_READERS)",
    )
    parser.add_argument(
        "--span-bytes",
        "--chunk-bytes",
        dest="span_bytes",
        help="span size, e.g. 16M (LOADERPLUG_SPAN_BYTES)",
    )
    parser.add_argument(
        "--bytes-in-flight", help="most bytes read at once, e.g. 512M (LOADERPLUG_BYTES_IN_FLIGHT)"
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="loaderplug", description="Fast, safe model cold starts.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_transfer_args(
        commands.add_parser("hydrate", help="copy a model from the volume mirror to local disk"),
        "mirror folder to copy from",
        "local folder to restore into",
    )
    _add_transfer_args(
        commands.add_parser("sync", help="copy a local model to the mirror, manifest last"),
        "local folder to copy from",
        "mirror folder to copy into",
    )
    doctor = commands.add_parser(
        "doctor", help="how each path would be read, and the settings in effect"
    )
    doctor.add_argument("paths", nargs="+", metavar="PATH")
    load = commands.add_parser(
        "load", help="read safetensors files (and hydrate them in the same pass with --to)"
    )
    load.add_argument(
        "paths",
        nargs="*",
        metavar="PATH",
        help="files, or folders of them; default: *.safetensors in --from",
    )
    load.add_argument("--device", default="cpu")
    load.add_argument("--from", dest="src", metavar="MIRROR", help="folder the files are in")
    load.add_argument("--to", dest="dst", metavar="DST", help="also hydrate the files here")
    load.add_argument("--json", action="store_true", help="print the figures as JSON")
    bench = commands.add_parser(
        "bench", help="measure the storage at PATH (read-only) and print the best setting"
    )
    bench.add_argument("path", metavar="PATH", help="a model folder or file on that storage")
    bench.add_argument("--seconds", type=float, default=30.0, help="time budget (default 30)")
    bench.add_argument("--max-bytes", default="4G", help="most bytes to read (default 4G)")
    bench.add_argument("--json", action="store_true", help="print the figures as JSON")
    run = commands.add_parser(
        "run",
        help="run a command with the Hub hook on in every Python process it starts",
        description="Run COMMAND with every Hugging Face Hub download of its Python "
        "processes served from the mirror (LOADERPLUG_MIRROR), with no change to it.",
    )
    run.add_argument("argv", nargs=argparse.REMAINDER, metavar="[--] COMMAND [ARGS...]")
    demo = commands.add_parser(
        "demo", help="hydrate a synthetic model from a throttled test volume"
    )
    demo.add_argument("--size-mib", type=int, default=256, help="model size (default 256)")
    demo.add_argument("--shards", type=int, default=4, help="number of shards (default 4)")
    return parser


FLAGS = {
    "readers": "readers",
    "span_bytes": "span_bytes",
    "bytes_in_flight": "bytes_in_flight",
}


def _settings_from_flags(args: argparse.Namespace) -> Settings:
    """Settings from the environment, overridden by flags; a bad flag is named as such."""
    base = from_env()
    for field, flag in FLAGS.items():
        try:
            base = base.replace(**{field: getattr(args, flag)})
        except SettingsError as exc:
            if exc.variable != BY_FIELD[field].name:
                raise
            raise exc.renamed("--" + flag.replace("_", "-")) from None
    return base


def _print_report(report: TransferReport, as_json: bool) -> int:
    if as_json:
        print(json.dumps(report.to_dict(), indent=2))
    else:
        print(report.summary())
    return 0 if report.ok else EXIT_FAILED


def _load(args: argparse.Namespace) -> int:
    from loaderplug.tensors.reader import iter_tensors

    paths = _paths_to_load(args)
    if not paths:
        raise _UsageError("nothing to load: name safetensors files, or a folder with --from")
    count = nbytes = 0
    load = iter_tensors(paths, args.device, local_dir=args.dst)
    for _name, tensor in load:
        count += 1
        nbytes += tensor.numel() * tensor.element_size()
    report = load.report
    assert report is not None
    figures = {
        "tensors": count,
        "tensor_bytes": nbytes,
        # What the job read, and in how long; mapped bytes were not read by it (their
        # pages are read as they are touched): they are said apart, never as a speed.
        "bytes_read": report.bytes_copied,
        "bytes_mapped": report.bytes_mapped,
        "seconds": round(report.seconds, 3),
        "mib_per_s": round(report.mib_per_s, 1),
        "first_tensor_s": round(load.first_tensor_s or 0.0, 3),
        "io": {str(p): load.io_modes[str(p)] for p in paths},
        "hydrated_to": args.dst,
        "report": report.to_dict(),
    }
    if args.json:
        print(json.dumps(figures, indent=2))
    else:
        read = (
            f"read {report.bytes_copied / MiB:.1f} MiB in {report.seconds:.2f} s "
            f"({report.mib_per_s:.1f} MiB/s)"
            if report.bytes_copied
            else f"read nothing in {report.seconds:.2f} s"
        )
        mapped = (
            f"; mapped {report.bytes_mapped / MiB:.1f} MiB, read as touched"
            if report.bytes_mapped
            else ""
        )
        print(
            f"loaded {count} tensors ({nbytes / MiB:.1f} MiB): {read}{mapped}; "
            f"first tensor after {figures['first_tensor_s']} s"
        )
        for path, mode in figures["io"].items():
            print(printable(f"  {path}: {mode}"))
    return 0


def _paths_to_load(args: argparse.Namespace) -> list[Path] | list[str]:
    """The files ``load`` reads: its PATHs (under --from where given), a folder standing
    for its safetensors files; a bucket's URL as --from, the objects it names or its
    ``*.safetensors`` objects."""
    if args.src and is_object_url(args.src):
        url = ObjectURL.parse(args.src, variable="--from")
        if args.paths:
            return [str(url.child(p)) for p in args.paths]
        found, _ = ObjectFiles(from_env().object_timeout_s).list(url)
        names = sorted(o.rel for o in found if "/" not in o.rel and o.rel.endswith(".safetensors"))
        return [str(url.child(name)) for name in names]
    if any(is_object_url(p) for p in args.paths):
        return [str(p) for p in args.paths]
    paths = [Path(p) for p in args.paths]
    if args.src:
        paths = [Path(args.src) / p for p in paths] or sorted(Path(args.src).glob("*.safetensors"))
    # A folder named as a PATH stands for its safetensors files, as with --from.
    return [f for p in paths for f in (sorted(p.glob("*.safetensors")) if p.is_dir() else [p])]


def _bench(args: argparse.Namespace) -> int:
    from loaderplug.cli.bench import run_bench

    if args.seconds <= 0:
        raise SettingsError("--seconds", args.seconds, "a positive number")
    max_bytes = parse_size(args.max_bytes)
    if max_bytes is None:
        raise SettingsError("--max-bytes", args.max_bytes, "a size such as 64M or 1GiB")
    result = run_bench(args.path, seconds=args.seconds, max_bytes=max_bytes)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result.summary())
    return 0


def _interrupt_on_sigterm() -> None:
    # A terminated hydrate cleans up like an interrupted one: temp files removed.
    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, handler)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "run":  # before any handler of ours: the program's signals are its own
        from loaderplug.cli.run import run_command

        return run_command(args.argv)
    _interrupt_on_sigterm()
    try:
        if args.command == "doctor":
            from loaderplug.cli.doctor import doctor

            print(doctor(args.paths))
            return 0
        if args.command == "load":
            return _load(args)
        if args.command == "bench":
            return _bench(args)
        if args.command == "demo":
            from loaderplug.cli.demo import run_demo

            return run_demo(size_mib=args.size_mib, shards=args.shards)
        settings = _settings_from_flags(args)
        job = hydrate if args.command == "hydrate" else sync
        report = job(args.src, args.dst, check=False, settings=settings)
        return _print_report(report, args.json)
    except KeyboardInterrupt:
        print("loaderplug: interrupted; temp files removed", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (SettingsError, _UsageError) as exc:
        print(printable(f"loaderplug: error: {exc}"), file=sys.stderr)
        return EXIT_USAGE
    except (LoaderplugError, OSError) as exc:
        print(printable(f"loaderplug: error: {exc}"), file=sys.stderr)
        return EXIT_FAILED
