"""The import structure: ``scripts/layout.py`` finds no circle among modules or packages and
no crossing between the front end and a backend's insides; and it does see one where there
is one (a check that cannot fail would say nothing)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(root / "scripts" / "layout.py")],
                          capture_output=True, text=True, timeout=120)


def test_the_tree_has_no_import_circle_or_crossing() -> None:
    done = run(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 violations" in done.stdout


def test_a_circle_and_a_crossing_are_found(tmp_path: Path) -> None:
    for part in ("scripts", "tlt_serve", "trainer", "clients"):
        (tmp_path / part).mkdir()
    (tmp_path / "scripts" / "layout.py").write_text((ROOT / "scripts/layout.py").read_text())
    files = {
        "tlt_serve/__init__.py": "",
        "tlt_serve/engine/__init__.py": "",
        "tlt_serve/engine/loop.py": "from tlt_serve.speculative import drafts\n",
        "tlt_serve/speculative/__init__.py": "",
        "tlt_serve/speculative/drafts.py": "def f():\n    from tlt_serve.engine import loop\n",
        "tlt_serve/server/__init__.py": "",
        "tlt_serve/server/routes.py": "from tlt_serve.backends.native import process\n",
        "tlt_serve/backends/__init__.py": "",
        "tlt_serve/backends/native/__init__.py": "",
        "tlt_serve/backends/native/process.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    done = run(tmp_path)
    assert done.returncode == 1
    assert "modules import each other: tlt_serve.engine.loop <-> tlt_serve.speculative.drafts" \
        in done.stdout
    assert "packages import each other: tlt_serve.engine <-> tlt_serve.speculative" in done.stdout
    assert "tlt_serve.server.routes imports tlt_serve.backends.native.process" in done.stdout
