"""pipesim stays torch-free; executor depends on pipesim, never the reverse."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_pipesim_imports_without_torch():
    code = ("import sys; import pipesim, pipesim.cli, pipesim.plot, pipesim.tune; "
            "assert 'torch' not in sys.modules, 'pipesim imported torch'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_pipesim_sources_never_mention_executor_or_torch_imports():
    for path in (ROOT / "pipesim").rglob("*.py"):
        text = path.read_text()
        assert "import torch" not in text and "from torch" not in text, path
        assert "from executor" not in text and "import executor" not in text, path

