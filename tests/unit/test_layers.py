"""The package's layers (setup.cfg's import-linter contracts) hold: no module imports upward."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_module_imports_a_layer_above_its_own() -> None:
    """A change that makes the store import the extension, or the client the server, fails here
    (and in `make lint`), not in a reader's head."""
    lint_imports = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    assert lint_imports, (
        "import-linter is a dev dependency: make install puts lint-imports in .venv"
    )
    run = subprocess.run(
        [lint_imports, "--no-cache"], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout
