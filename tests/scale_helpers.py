"""Helpers of the scaling tests: the README's lab.yaml examples, and the dpflow CLI with its JSON result."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def readme_lab(title: str) -> dict:
    """The README's ``# lab.yaml: <title>`` example, parsed."""
    import yaml

    blocks = re.findall(r"```yaml\n(# lab\.yaml: ([^\n]+)\n.*?)```", (REPO / "README.md").read_text(), re.S)
    found = [text for text, name in blocks if name.strip() == title]
    assert len(found) == 1, f"README has {len(found)} lab.yaml examples titled {title!r}"
    return yaml.safe_load(found[0])


def dpflow(*args: str, prefix: tuple[str, ...] = (), timeout: float = 600) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Run the dpflow CLI; its DPFLOW_JSON result line parsed (None when absent)."""
    proc = subprocess.run([*prefix, str(Path(sys.executable).parent / "dpflow"), *args], capture_output=True, text=True,
                          timeout=timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("DPFLOW_JSON ")), None)
    return proc, json.loads(line.split(" ", 1)[1]) if line else None
