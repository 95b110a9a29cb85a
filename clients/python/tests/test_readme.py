"""The five-line example in README.md and docs/python.md runs as shown against the dev cluster."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO, DevCluster


@pytest.mark.parametrize("doc", ["README.md", "docs/python.md"])
def test_the_documented_example_takes_a_lock(cluster: DevCluster, doc: str) -> None:
    text = (REPO / doc).read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "session.lock(" in b]
    assert blocks, f"no example in {doc}"
    example = blocks[0]
    assert len(example.strip().splitlines()) <= 5, example
    # The docs use the dev cluster's default port; this cluster runs on its own.
    script = example.replace("127.0.0.1:7001", cluster.endpoints[0])
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(r"holding reports/nightly with token [1-9][0-9]*\n", out.stdout), out.stdout
