"""deploy/systemd: the unit, its disk drop-in and the example config.

`systemd-analyze verify` (Debian's systemd package, on the build machines'
image) checks every directive and value the way systemd would load them; it
exits 0 even on unknown keys or bad values and only prints them, so any
output fails the test. The settings kvd relies on are then checked by a
small parser of our own (no systemd runs here to start the unit for real;
tests/integration/test_systemd_notify.py plays systemd's notify side).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvd.cli import build_parser
from kvd.config import load

ROOT = Path(__file__).parents[2]
SYSTEMD = ROOT / "deploy" / "systemd"
UNIT = SYSTEMD / "kvd.service"
DROP_IN = SYSTEMD / "kvd.service.d" / "disk.conf"


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """section -> key -> values (a key may repeat), as systemd reads them:
    comments are whole lines starting with # or ;, never inline."""
    sections: dict[str, dict[str, list[str]]] = {}
    section = None
    for number, line in enumerate(re.sub(r"\\\n", " ", text).splitlines(), 1):
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            section = sections.setdefault(line[1:-1], {})
            continue
        key, sep, value = line.partition("=")
        assert section is not None and sep, f"line {number}: {line!r} is not key=value in a section"
        # systemd would take a trailing "# ..." as part of the value.
        assert "#" not in value, f"line {number}: inline comments are not comments in a unit: {line!r}"
        section.setdefault(key.strip(), []).append(value.strip())
    return sections


def timespan_s(text: str) -> float:
    units = {"min": 60, "h": 3600, "ms": 0.001, "s": 1, "": 1}
    return sum(float(count) * units[unit] for count, unit in re.findall(r"(\d+)\s*(min|ms|h|s|)", text))


def one(sections: dict, section: str, key: str) -> str:
    values = sections[section].get(key, [])
    assert len(values) == 1, f"[{section}] {key}: {values}"
    return values[0]


def test_systemd_analyze_verify_is_silent_on_the_unit_and_loud_on_a_broken_one(tmp_path):
    analyze = shutil.which("systemd-analyze")
    assert analyze, "systemd-analyze is needed (Debian: apt-get install systemd)"
    # verify also checks that ExecStart's program exists: point it at the
    # venv's kvd, which `make setup` installs as pip installs /usr/local/bin/kvd.
    kvd = Path(sys.executable).with_name("kvd")
    assert kvd.exists()
    for name, change in (("kvd.service", ""), ("broken.service", "Restart=sometimes\nWatchdogSecs=30s\n")):
        unit_dir = tmp_path / name
        unit_dir.mkdir()
        text = UNIT.read_text().replace("/usr/local/bin/kvd", str(kvd))
        (unit_dir / name).write_text(text.replace("[Install]", change + "\n[Install]") if change else text)
        shutil.copytree(DROP_IN.parent, unit_dir / f"{name}.d")
        result = subprocess.run([analyze, "verify", "--man=no", str(unit_dir / name)], capture_output=True,
                                text=True, check=False, timeout=60)
        output = (result.stdout + result.stderr).strip()
        if change:
            assert "sometimes" in output and "WatchdogSecs" in output, output
        else:
            assert result.returncode == 0 and output == "", output


def test_unit_speaks_notify_and_is_sandboxed():
    unit = parse_unit(UNIT.read_text())
    service = unit["Service"]
    expected = {
        "Type": "notify", "NotifyAccess": "main", "Restart": "on-failure", "KillSignal": "SIGTERM",
        "LimitMEMLOCK": "infinity", "ProtectSystem": "strict", "PrivateTmp": "true", "ProtectHome": "true",
        "NoNewPrivileges": "true", "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6", "StateDirectory": "kvd",
        "User": "kvd", "CapabilityBoundingSet": "",
    }
    assert {key: one(unit, "Service", key) for key in expected} == expected
    assert timespan_s(one(unit, "Service", "WatchdogSec")) > 0
    # READY waits for disk recovery: the start timeout leaves it minutes.
    assert timespan_s(one(unit, "Service", "TimeoutStartSec")) >= 300
    # The arena is memfd files passed over a socket: nothing in /dev/shm, no IPC objects.
    assert "/dev/shm" not in " ".join(service.get("ReadWritePaths", []))
    assert (one(unit, "Service", "PrivateIPC"), one(unit, "Service", "RemoveIPC")) == ("true", "true")
    # GPU hosts need /dev/nvidia*.
    assert service.get("PrivateDevices", ["false"]) == ["false"]
    # @system-service allows io_uring (@aio) on systemd >= 252.
    assert one(unit, "Service", "SystemCallFilter") == "@system-service"
    assert one(unit, "Install", "WantedBy") == "multi-user.target"


def test_exec_start_runs_kvd_on_the_state_directory_and_the_example_config():
    unit = parse_unit(UNIT.read_text())
    argv = shlex.split(one(unit, "Service", "ExecStart"))
    assert argv[0] == "/usr/local/bin/kvd"
    args = build_parser().parse_args(argv[1:])
    assert args.command == "serve"
    # The state directory is the one StateDirectory= creates and leaves writable.
    assert args.state_dir == "/var/lib/" + one(unit, "Service", "StateDirectory")
    assert str(args.config) == "/etc/kvd/kvd.toml"
    config = load(SYSTEMD / "kvd.toml", env={}, overrides={"state_dir": args.state_dir})
    # systemd's SIGKILL comes after the drain, never during it.
    assert timespan_s(one(unit, "Service", "TimeoutStopSec")) > config.server.grace_period_s + 5
    # The drop-in makes exactly the configured drives writable, and waits for their mounts.
    drop_in = parse_unit(DROP_IN.read_text())
    writable = one(drop_in, "Service", "ReadWritePaths").split()
    assert writable == config.disk.directories
    mounts = one(drop_in, "Unit", "RequiresMountsFor").split()
    assert [str(Path(directory).parent) for directory in writable] == mounts


@pytest.mark.parametrize("text, problem", [
    ("[Service]\nWatchdogSec=30s # half a minute\n", "inline comments"),
    ("Type=notify\n", "not key=value in a section"),
])
def test_the_parser_rejects_what_systemd_would_misread(text, problem):
    with pytest.raises(AssertionError, match=problem):
        parse_unit(text)
