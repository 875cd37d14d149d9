"""The benchmarks' shared result writer (benchmarks/report.py): every JSON is stamped with
where, when and at which commit it was measured, and the plot is drawn beside it."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from benchmarks import report


def test_stamp_names_machine_date_and_commit() -> None:
    s = report.stamp()
    assert set(s) == {"machine", "date", "commit"}
    assert s["machine"] and "cores" in s["machine"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", s["date"])
    assert s["commit"] is None or re.fullmatch(r"[0-9a-f]{4,40}(\+dirty)?", s["commit"])


def test_write_stamps_the_json_and_plots_beside_it(tmp_path: Path) -> None:
    calls: list[tuple[dict[str, Any], Path]] = []
    out = tmp_path / "new" / "bench.json"  # the folder does not exist yet
    result = {"benchmark": "x", "rows": [1, 2]}
    path = report.write(result, str(out), lambda r, png: calls.append((r, png)))
    assert path == out
    written = json.loads(out.read_text())
    assert written["benchmark"] == "x" and written["rows"] == [1, 2]
    assert {"machine", "date", "commit"} <= set(written)
    assert result == {"benchmark": "x", "rows": [1, 2]}  # the caller's dict is left alone
    assert calls == [(written, out.with_suffix(".png"))]


def test_write_without_plot(tmp_path: Path) -> None:
    out = report.write({"a": 1}, tmp_path / "r.json")
    assert json.loads(out.read_text())["a"] == 1
    assert not out.with_suffix(".png").exists()
