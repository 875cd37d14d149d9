"""What every benchmark script shares: its argument parser, the stamp on its result (host,
date, commit), writing the JSON beside its PNG, headless matplotlib and saving a figure."""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from benchmarks.host import host

REPO = Path(__file__).resolve().parents[1]


def parser(doc: str | None) -> argparse.ArgumentParser:
    """An argument parser described by the first paragraph of a script's docstring."""
    return argparse.ArgumentParser(description=(doc or "").split("\n\n")[0].strip())


def stamp() -> dict[str, Any]:
    """Where and when a result was measured: ``machine`` (CPU and vector extensions),
    ``date`` (UTC) and ``commit`` (with ``+dirty`` when the tree had changes; None outside
    git)."""
    return {
        "machine": host(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": _commit(),
    }


def _commit() -> str | None:
    def git(*args: str) -> str:
        # --no-optional-locks: a status must not take index.lock while other git runs
        return subprocess.run(["git", "--no-optional-locks", *args], cwd=REPO,
                              capture_output=True, text=True, check=True).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def write(
    result: dict[str, Any],
    out: str | Path,
    plot: Callable[[dict[str, Any], Path], object] | None = None,
) -> Path:
    """Stamp ``result``, write it as JSON to ``out`` and, with ``plot``, its figure to the
    same path with ``.png``; says where. Returns the JSON's path."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    result = {**result, **stamp()}
    path.write_text(json.dumps(result, indent=2) + "\n")
    if plot is None:
        print(f"wrote {path}")
        return path
    png = path.with_suffix(".png")
    plot(result, png)
    print(f"wrote {path} and {png}")
    return path


def pyplot() -> ModuleType:
    """matplotlib.pyplot on the Agg backend (no display here)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig: Any, path: str | Path, dpi: int = 110) -> Path:
    """Lay ``fig`` out, write it to ``path`` and close it; returns the path."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return Path(path)
