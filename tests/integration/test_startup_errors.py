"""Every way `kvd serve` cannot start ends in one line and exit 2, never a traceback.

Exit 2 is what the systemd unit's RestartPreventExitStatus names: a restart
would not fix any of these (issue 10, item 7: a missing mount point used to
exit 1 with a FileNotFoundError traceback, so systemd restarted it in a loop;
a list-valued --set was taken as one literal path).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from kvd.testing.daemon import run_daemon, to_toml

DISK = {"capacity_bytes": 4 << 20, "slot_bytes": 64 << 10, "segment_bytes": 1 << 20}


def serve(tmp_path: Path, *flags: str, config: dict | None = None) -> subprocess.CompletedProcess:
    arguments = [sys.executable, "-m", "kvd", "serve", "--state-dir", str(tmp_path / "state"),
                 "--tcp-address", "", "--metrics-address", "", "--capacity", "16MiB"]
    if config is not None:
        path = tmp_path / "kvd.toml"
        path.write_text(to_toml(config))
        arguments += ["--config", str(path)]
    return subprocess.run([*arguments, *flags], capture_output=True, text=True, timeout=120)


def assert_refused(result: subprocess.CompletedProcess, *words: str) -> str:
    """Exit 2, no traceback, and exactly one line of kvd's own saying why."""
    assert result.returncode == 2, (result.returncode, result.stderr[-3000:])
    assert "Traceback" not in result.stderr and "Traceback" not in result.stdout, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("kvd: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    for word in words:
        assert word in lines[0], lines[0]
    return lines[0]


def test_a_missing_mount_point(tmp_path):
    result = serve(tmp_path, "--set", "disk.directories=/nonexistent-mount/kvd")
    assert_refused(result, "/nonexistent-mount", "does not exist")
    assert not Path("/nonexistent-mount").exists()


def test_a_list_flag_that_is_not_toml_is_refused_and_one_that_is_is_parsed(tmp_path):
    assert_refused(serve(tmp_path, "--set", 'disk.directories=["/x"'), "disk.directories", "TOML")
    drives = [str(tmp_path / "a"), str(tmp_path / "b")]
    result = subprocess.run([sys.executable, "-m", "kvd", "config", "--set", f"disk.directories={json.dumps(drives)}"],
                            capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(result.stdout)["disk"]["directories"] == drives


def test_ports_already_taken(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        assert_refused(serve(tmp_path, "--tcp-address", address), address, "server.tcp_address")
        assert_refused(serve(tmp_path, "--metrics-address", address), address, "metrics.address")


def test_directories_that_cannot_be_used(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    assert_refused(serve(tmp_path, "--set", f"disk.directories={a_file}"), str(a_file), "not a directory")
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("someone else's")
    assert_refused(serve(tmp_path, "--set", f"disk.directories={foreign}"), "files kvd did not write")
    assert_refused(serve(tmp_path, "--state-dir", str(a_file / "state")), "state_dir")


def test_a_drive_written_with_another_slot_size(tmp_path):
    """An IDENTITY that disagrees with the configuration (docs/operations.md, Upgrades)."""
    drive = tmp_path / "nvme0"
    with run_daemon(tmp_path / "first", config={"disk": {"directories": [str(drive)], **DISK}}):
        pass
    changed = {**DISK, "slot_bytes": 128 << 10}
    result = serve(tmp_path, config={"disk": {"directories": [str(drive)], **changed}})
    assert_refused(result, str(drive), "slot_bytes")


@pytest.mark.parametrize("flag", ["--capacity=0", "--set=leases.max_ms=-1", "--set=no.such_setting=1"])
def test_config_mistakes(tmp_path, flag):
    assert_refused(serve(tmp_path, flag), "config field")
