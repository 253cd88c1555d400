"""tools/dev/harness_diag: the sitecustomize that wraps DeepEP's tests' bench() runs the one it stands in for
first, and replaces `bench` of a module named `utils` (and nothing else) when the test imports it."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_wraps_bench_and_chains(tmp_path: Any) -> None:
    site, test_dir = tmp_path / "site", tmp_path / "tests"
    site.mkdir()
    test_dir.mkdir()
    shutil.copy(os.path.join(ROOT, "tools", "dev", "harness_diag", "sitecustomize.py"), site / "sitecustomize.py")
    (site / "sitecustomize_next.py").write_text("import os\nos.environ['DIAG_CHAINED'] = 'yes'\n")
    (test_dir / "utils.py").write_text("def bench(fn):\n    return 'original'\n\ndef other():\n    return 1\n")
    code = ("import os\nfrom utils import bench, other\n"
            "print(os.environ.get('DIAG_CHAINED'), bench.__qualname__, other())\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=test_dir, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(site)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["yes", "_patch.<locals>.bench", "1"]
