"""Run the coverage-guided fuzzer of the request handlers (atheris_service.py) for a bounded number of inputs.

libFuzzer ends its process when it is done, so the harness runs in a
subprocess. KVD_ATHERIS_RUNS sets the number of inputs (`make fuzz-long`
runs many more), KVD_ATHERIS_SEED the mutation seed. A failure shows the
exception and keeps the crashing input (crash-<sha1>) in the test's
temporary directory: `python tests/fuzz/atheris_service.py CRASH_FILE`
replays it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("atheris")

RUNS = int(os.environ.get("KVD_ATHERIS_RUNS", "15000"))
SEED = int(os.environ.get("KVD_ATHERIS_SEED", "1"))
HARNESS = Path(__file__).with_name("atheris_service.py")


def test_atheris_finds_no_crash_in_the_request_handlers(tmp_path):
    corpus = tmp_path / "corpus"
    result = subprocess.run(
        [sys.executable, str(HARNESS), f"-runs={RUNS}", f"-seed={SEED}", "-max_len=65536", "-timeout=30",
         "-rss_limit_mb=4096", "-print_final_stats=1", str(corpus)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    crashes = sorted(path.name for path in tmp_path.glob("crash-*"))
    assert result.returncode == 0 and not crashes, (
        f"atheris exited with {result.returncode}, crashing inputs {crashes} in {tmp_path}:\n{result.stderr[-6000:]}")
    assert f"Done {RUNS} runs" in result.stderr, result.stderr[-3000:]
    # Seeds of every method and what the fuzzer kept: it did explore.
    assert len(list(corpus.iterdir())) > 20
