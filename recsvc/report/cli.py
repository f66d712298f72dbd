"""`recsvc report FILE... --out DIR`: plots (PNG and SVG) from `recsvc eval --json`, `recsvc bench
decode|speculative|cache|replay|serve --json` files and training records, each file's kind read from its content
(``recsvc.report.inputs``). Per input, files ``DIR/<name>_<plot>.{png,svg}``:

- eval: ``_quality`` (Recall@K / NDCG@K per method and cutoff; the model / baseline ratio with its 95% paired
  bootstrap interval) and ``_cold_warm`` (the cold and warm target slices);
- decode, speculative, cache: ``_latency``; replay, serve: ``_throughput``; a training record: ``_curves``.

Every title names the data (``--label``), the machine and the precision: the JSON's own record where it has one,
else ``--machine`` / ``--precision``. A missing, unreadable or unknown file: exit 2 before anything is written;
a layout that breaks a plot: exit 2 naming the file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from recsvc.errors import UserError
from recsvc.report import curves, latency, quality, serving

PLOTS = {  # kind -> the function drawing it (matplotlib itself is imported when a figure is drawn)
    "eval": quality.plot_eval,
    "decode": latency.plot_decode,
    "speculative": latency.plot_speculative,
    "cache": serving.plot_cache,
    "replay": serving.plot_replay,
    "serve": serving.plot_serve,
    "curves": curves.plot_curves,
}
FORMATS = ("png", "svg")


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="plots (PNG, SVG) from eval / bench JSON and training records")
    p.add_argument("inputs", nargs="*", metavar="FILE",
                   help="`recsvc eval --json` or `recsvc bench decode|speculative|cache|replay|serve --json` files, "
                        "training records (BUNDLE/target/training.json), or bundle directories (their target's)")
    p.add_argument("--out", required=True, type=Path, help="directory the plots are written to")
    p.add_argument("--label", default="", help="the data set, first in every title (e.g. 'Amazon Beauty')")
    p.add_argument("--machine", help="the machine, for inputs that do not record it (eval, serve, training records)")
    p.add_argument("--precision", help="the precision, for inputs that do not record it")
    p.add_argument("--formats", default=",".join(FORMATS), help="comma-separated subset of png,svg (default: both)")
    p.set_defaults(func=cmd_report)


def parse_formats(text: str) -> list[str]:
    formats = [f.strip().lower() for f in text.split(",") if f.strip()]
    if not formats or set(formats) - set(FORMATS):
        raise UserError(f"--formats takes png and/or svg, got {text!r}")
    return list(dict.fromkeys(formats))


def cmd_report(args: argparse.Namespace) -> int:
    from recsvc.report.figure import Context
    from recsvc.report.inputs import read_input

    formats = parse_formats(args.formats)
    if not args.inputs:
        raise UserError("no input files: give `recsvc eval --json` / `recsvc bench ... --json` files or training "
                        "records")
    inputs = [read_input(text) for text in args.inputs]  # every file checked before anything is written
    names: dict[str, Path] = {}
    for item in inputs:
        if item.stem in names:
            raise UserError(f"{item.path} and {names[item.stem]} would write the same plots ({item.stem}_*): "
                            "rename one")
        names[item.stem] = item.path
    ctx = Context(label=args.label, machine=args.machine, precision=args.precision)
    written: list[Path] = []
    for item in inputs:
        plot = PLOTS[item.kind]
        try:
            paths = plot(item.path, item.data, ctx, args.out, item.stem, formats)
        except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError) as exc:
            raise UserError(f"{item.path}: malformed {item.kind} JSON ({type(exc).__name__}: {exc})") from None
        print(f"{item.path} ({item.kind}): " + ", ".join(str(p) for p in paths))
        written += paths
    print(f"wrote {len(written)} files to {args.out}")
    return 0
