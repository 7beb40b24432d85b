"""The contenders of bench_peers.py as processes: what to start, and talking to them.

Each contender is a driver under bench/peers/ run by the Python of its own virtual environment
and spoken to over the line protocol of bench/peers/protocol.py. A driver whose peer cannot be
built on this host says so in its first line; that becomes a row of its own ("could not run",
with the peer's exception word for word and where it was raised), never a silent gap and never
a figure.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _common import REPO_ROOT, progress

PEERS_DIR = REPO_ROOT / "bench" / "peers"


@dataclass(frozen=True)
class ContenderSpec:
    name: str
    venv: str
    script: str
    args: tuple[str, ...] = ()
    store_variants: tuple[tuple[str, dict], ...] = ()

    @property
    def python(self) -> Path:
        return REPO_ROOT / self.venv / "bin" / "python"

    def available(self) -> bool:
        return self.python.exists() and (PEERS_DIR / self.script).exists()


class CouldNotRun(RuntimeError):
    """The driver started, but its peer cannot be built here; `row` says why, as the peer raised it."""

    def __init__(self, name: str, hello: dict[str, Any]) -> None:
        super().__init__(f"{name} could not run: {hello.get('could_not_run')} ({hello.get('raised_at')})")
        self.row = {"status": "could not run", "error": hello.get("could_not_run"),
                    "raised_at": hello.get("raised_at"), "raised_in": hello.get("raised_in")}


class Contender:
    """One driver process; handshake() waits for its first line, ask() sends a command and returns
    its answer."""

    def __init__(self, spec: ContenderSpec, workload, log_dir: Path) -> None:
        self.spec = spec
        self.log_path = log_dir / f"{spec.name.replace(' ', '_')}.log"
        self._log = open(self.log_path, "wb")
        self.process = subprocess.Popen(
            [str(spec.python), str(PEERS_DIR / spec.script), workload.to_json(), *spec.args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True, cwd=REPO_ROOT)
        self.version = "?"
        self.notes: dict[str, Any] = {}

    def handshake(self) -> None:
        """Wait until the driver is ready; CouldNotRun where its peer cannot be built here."""
        hello = self._read()
        if hello.get("could_not_run"):
            self.close()
            raise CouldNotRun(self.spec.name, hello)
        if not hello.get("ready"):
            self.close()
            raise RuntimeError(f"{self.spec.name} did not start: {hello}")
        self.version = hello.get("version", "?")
        self.notes = hello.get("notes") or {}

    def _read(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            tail = self.log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{self.spec.name} exited ({self.process.poll()}):\n{tail}")
        return json.loads(line)

    def ask(self, op: str, **fields: Any) -> dict:
        self.process.stdin.write(json.dumps({"op": op, **fields}) + "\n")
        self.process.stdin.flush()
        answer = self._read()
        if "error" in answer:
            raise RuntimeError(f"{self.spec.name} {op}: {answer['error']} (log: {self.log_path})")
        if answer.get("ok") is False:
            raise RuntimeError(f"{self.spec.name} {op}: the bytes read back are not the bytes stored")
        return answer

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write('{"op": "quit"}\n')
                self.process.stdin.flush()
                self.process.wait(120)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self._log.close()


def start_all(specs, workload_of, log_dir: Path,
              refused: dict[str, dict] | None = None) -> dict[str, Contender]:
    """Start every available contender, all at once (their imports overlap), then wait for each;
    those whose peer cannot run here go into `refused`."""
    spawned = {}
    for spec in specs:
        if not spec.available():
            progress(f"{spec.name}: not installed ({spec.venv} or bench/peers/{spec.script} missing), left out")
            continue
        progress(f"starting {spec.name}")
        spawned[spec.name] = Contender(spec, workload_of(spec), log_dir)
    started = {}
    for name, contender in spawned.items():
        try:
            contender.handshake()
            started[name] = contender
        except CouldNotRun as error:
            progress(str(error))
            if refused is not None:
                refused[name] = error.row
        except RuntimeError as error:
            progress(f"{name}: failed to start, left out: {str(error)[-600:]}")
    return started


def close_all(contenders: dict[str, Contender]) -> None:
    for contender in contenders.values():
        contender.close()
