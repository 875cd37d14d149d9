"""A result: the stamp on it, the command line that measures it, writing it as JSON with its
PNG beside it, and the plotting helpers the figures share.

Every result names where, when and from what it was measured (``stamp``): the same
benchmark differs ~2x between hosts of one kind (an AVX2-only EPYC, a Zen 4 EPYC with
AVX512-BF16, a Xeon with AMX), so the CPU and the vector extensions that decide the kernels'
speed are read from /proc/cpuinfo; the commit says ``+dirty`` whenever the tree differs from
it; the command line is the one that measures the same again.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results"

# ---- the stamp ------------------------------------------------------------------------------

# /proc/cpuinfo flag → how results name it; in this order
FLAGS = {"avx2": "AVX2", "avx512f": "AVX512F", "avx512_bf16": "AVX512-BF16",
         "amx_bf16": "AMX-BF16"}


def _cpuinfo_field(name: str) -> str | None:
    info = Path("/proc/cpuinfo")
    if not info.is_file():
        return None
    for line in info.read_text().splitlines():
        if line.split(":", 1)[0].strip() == name:
            return line.split(":", 1)[1].strip()
    return None


def host() -> str:
    """e.g. 'AMD EPYC 9R14, 2 cores, AVX2 AVX512F AVX512-BF16': a result's ``machine``."""
    model = _cpuinfo_field("model name") or platform.processor() or platform.machine()
    have = set((_cpuinfo_field("flags") or "").split())
    flags = " ".join(label for flag, label in FLAGS.items() if flag in have) or "no AVX2"
    return f"{model}, {len(os.sched_getaffinity(0))} cores, {flags}"


def commit(repo: Path = REPO) -> str | None:
    """HEAD's short hash, with ``+dirty`` when the tree differs from it: a tracked file
    changed (staged or not) or a file git neither tracks nor ignores, anywhere but in
    ``benchmarks/results/`` (results of earlier runs change nothing that runs). None outside
    git."""

    def git(*args: str) -> str:
        # --no-optional-locks: a status must not take index.lock while other git runs
        return subprocess.run(["git", "--no-optional-locks", "-C", str(repo), *args],
                              capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--", ":(top)",
                      ":(top,exclude)benchmarks/results")
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("+dirty" if changed else "")


def stamp() -> dict[str, Any]:
    """Where, when, from what and how a result was measured: ``machine`` (CPU, cores,
    vector extensions), ``date`` (UTC), ``commit`` (``+dirty`` unless the tree is HEAD's)
    and ``command`` (this process's command line, as typed)."""
    return {
        "machine": host(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit(),
        "command": shlex.join(getattr(sys, "orig_argv", sys.argv)),
    }


# ---- command lines --------------------------------------------------------------------------

Command = tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], Any]]


def parser(doc: str | None, name: str) -> argparse.ArgumentParser:
    """A tool's parser, described by ``doc``, with the result options (``--tag``, ``--out``)
    of the result ``name``."""
    p = argparse.ArgumentParser(description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    _output_arguments(p, name)
    return p


def _output_arguments(p: argparse.ArgumentParser, name: str) -> None:
    p.add_argument("--tag", default="",
                   help=f"a variant's name: the result is benchmarks/results/{name}_TAG.json")
    p.add_argument("--out", type=Path, default=None,
                   help=f"the result's path (default benchmarks/results/{name}[_TAG].json), "
                   "its figure beside it (.png)")
    p.set_defaults(benchmark=name)


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> argparse.Namespace:
    """``p``'s arguments, ``out`` resolved: ``--out``, else ``<results>/<name>[_<tag>].json``."""
    a = p.parse_args(argv)
    if a.out is None:
        a.out = RESULTS / f"{a.benchmark}{'_' + a.tag if a.tag else ''}.json"
    return a


def tool(doc: str | None, name: str, commands: dict[str, Command],
         argv: Sequence[str] | None = None) -> Any:
    """Run the subcommand ``argv`` names; ``commands`` maps each subcommand to (a function
    that adds its arguments, the function that runs it, whose docstring describes it).
    A subcommand's result is ``<results>/<name>_<subcommand>[_<tag>].json``."""
    ap = argparse.ArgumentParser(prog=f"python -m benchmarks.{name}", description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    subs = ap.add_subparsers(dest="subcommand", required=True)
    for sub, (arguments, run) in commands.items():
        what = " ".join((run.__doc__ or "").split())
        first = re.split(r"(?<=[.?])\s", what, maxsplit=1)[0]  # the first sentence
        p = subs.add_parser(sub, help=first.replace("%", "%%"), description=what)
        arguments(p)
        _output_arguments(p, f"{name}_{sub.replace('-', '_')}")
        p.set_defaults(run=run)
    a = parse(ap, argv)
    return a.run(a)


def ints(text: str) -> list[int]:
    """``"1,4,16"`` → [1, 4, 16] (an argument type)."""
    return [int(x) for x in text.split(",") if x]


def names(text: str) -> list[str]:
    """``"off,auto"`` → ["off", "auto"] (an argument type)."""
    return [x for x in text.split(",") if x]


# ---- results --------------------------------------------------------------------------------

Plot = Callable[[dict[str, Any], Path], object]


def arguments(a: argparse.Namespace) -> dict[str, Any]:
    """A tool's arguments as JSON values (paths as strings, functions left out)."""
    def value(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return [value(x) for x in v]
        return v if isinstance(v, (int, float, str, bool, type(None))) else str(v)

    return {k: value(v) for k, v in vars(a).items() if not callable(v)}


def write(result: dict[str, Any], out: str | Path, plot: Plot | None = None) -> Path:
    """Stamp ``result``, write it as JSON to ``out`` and, with ``plot``, its figure to the
    same path with ``.png``; says where. Returns the JSON's path."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {**result, **stamp()}
    path.write_text(json.dumps(result, indent=2) + "\n")
    if plot is not None:
        plot(result, path.with_suffix(".png"))
    print(f"wrote {path}" + (f" and {path.with_suffix('.png')}" if plot else ""))
    return path


def report(a: argparse.Namespace, result: dict[str, Any], plot: Plot | None = None) -> Path:
    """``result`` with the benchmark's name and arguments, stamped, to ``a.out``."""
    return write({"benchmark": a.benchmark, "args": arguments(a), **result}, a.out, plot)


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend (no display here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def grouped_bars(ax: Any, groups: Sequence[str], series: dict[str, dict[str, float]],
                 labels: Sequence[str] | None = None) -> None:
    """One bar per series in each group, side by side (a value a series lacks is left out);
    the groups named under them (``labels``, default the groups)."""
    width = 0.8 / len(series)
    for i, (name, values) in enumerate(series.items()):
        ax.bar([j + i * width for j, g in enumerate(groups) if g in values],
               [values[g] for g in groups if g in values], width, label=name)
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(groups))],
                  list(labels or groups))


def save(fig: Any, path: str | Path, dpi: int = 110) -> Path:
    """Lay ``fig`` out, write it to ``path`` and close it; returns the path."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return Path(path)
