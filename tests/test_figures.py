"""The library's figures leave matplotlib's global state alone: no backend switch, no pyplot figure."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import sys, matplotlib
matplotlib.use("svg")  # the user's choice, which the library must keep
from gdnprune.runtime.figures import new_figure
fig = new_figure(figsize=(3, 2), dpi=50)
ax = fig.subplots()
ax.plot([0, 1], [1, 0])
fig.savefig(sys.argv[1])
print(matplotlib.get_backend(), "matplotlib.pyplot" in sys.modules)
"""


def test_a_figure_is_drawn_and_saved_without_pyplot_or_a_backend_switch(tmp_path):
    out = tmp_path / "plot.png"
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(out)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["svg", "False"]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"  # the file's own format, whatever the backend
