"""The benchmarks' shared result writer (benchmarks/common/results.py): every JSON is stamped
with where, when, at which commit (``+dirty`` unless the tree is the commit's) and by which
command it was measured, is named after its tool and subcommand, and its plot is drawn
beside it."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

from benchmarks.common.results import RESULTS, Command, commit, ints, report, stamp, tool, write


def test_stamp_names_machine_date_commit_and_command() -> None:
    s = stamp()
    assert set(s) == {"machine", "date", "commit", "command"}
    assert s["machine"] and "cores" in s["machine"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", s["date"])
    assert s["commit"] is None or re.fullmatch(r"[0-9a-f]{4,40}(\+dirty)?", s["commit"])
    assert "pytest" in s["command"]  # this process's command line


def test_commit_is_dirty_whenever_the_tree_differs_but_for_results(tmp_path: Path) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=t", "-c",
                        "user.email=t@t", *args], check=True, capture_output=True)

    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    (results / "r.json").write_text("{}\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "c")
    clean = commit(tmp_path)
    assert clean is not None and not clean.endswith("+dirty")
    (results / "r.json").write_text('{"new": 1}\n')  # an earlier run's result: still clean
    (results / "new.json").write_text("{}\n")
    assert commit(tmp_path) == clean
    (tmp_path / "scratch.py").write_text("")  # a file git neither tracks nor ignores
    assert commit(tmp_path) == clean + "+dirty"
    (tmp_path / "scratch.py").unlink()
    (tmp_path / "code.py").write_text("x = 2\n")
    assert commit(tmp_path) == clean + "+dirty"
    git("add", "code.py")  # staged counts too
    assert commit(tmp_path) == clean + "+dirty"
    assert commit(tmp_path / "nowhere") is None


def test_write_stamps_the_json_and_plots_beside_it(tmp_path: Path) -> None:
    calls: list[tuple[dict[str, Any], Path]] = []
    out = tmp_path / "new" / "bench.json"  # the folder does not exist yet
    result = {"benchmark": "x", "rows": [1, 2]}
    path = write(result, str(out), lambda r, png: calls.append((r, png)))
    assert path == out
    written = json.loads(out.read_text())
    assert written["benchmark"] == "x" and written["rows"] == [1, 2]
    assert {"machine", "date", "commit", "command"} <= set(written)
    assert result == {"benchmark": "x", "rows": [1, 2]}  # the caller's dict is left alone
    assert calls == [(written, out.with_suffix(".png"))]


def test_write_without_plot(tmp_path: Path) -> None:
    out = write({"a": 1}, tmp_path / "r.json")
    assert json.loads(out.read_text())["a"] == 1
    assert not out.with_suffix(".png").exists()


def test_a_tool_names_its_result_after_itself_and_the_subcommand(tmp_path: Path) -> None:
    def measure(a: Any) -> Path:
        """Measures nothing."""
        return report(a, {"value": a.n})

    def arguments(p: Any) -> None:
        p.add_argument("--n", type=ints, default=[1])

    where: dict[str, Command] = {"sub-cmd": (arguments, lambda a: a.out)}
    assert tool(None, "tool", where, ["sub-cmd"]) == RESULTS / "tool_sub_cmd.json"
    tagged = tool(None, "tool", where, ["sub-cmd", "--tag", "t1"])
    assert tagged == RESULTS / "tool_sub_cmd_t1.json"
    out = tmp_path / "x.json"
    tool(None, "tool", {"sub-cmd": (arguments, measure)},
         ["sub-cmd", "--n", "2,3", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["benchmark"] == "tool_sub_cmd" and written["value"] == [2, 3]
    assert written["args"]["n"] == [2, 3] and written["args"]["out"] == str(out)
    assert "run" not in written["args"]
