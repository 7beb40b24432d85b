"""systemd's notification protocol (sd_notify): READY, STATUS, STOPPING, and the watchdog's
keep-alives, sent when systemd started the daemon with a NOTIFY_SOCKET (deploy/systemd/kvd.service)."""

from __future__ import annotations

import asyncio
import os
import socket


def sd_notify(state: str) -> bool:
    """Send a systemd notification if NOTIFY_SOCKET is set; True if sent."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.connect(address)
        sock.sendall(state.encode())
    return True


def watchdog_interval_s(environ: dict[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 keep-alives: half of systemd's WATCHDOG_USEC
    (sd_watchdog_enabled's rule), or None when no watchdog watches this process."""
    environ = os.environ if environ is None else environ
    usec = environ.get("WATCHDOG_USEC", "")
    pid = environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 2_000_000


async def keep_alive(interval_s: float) -> None:
    """WATCHDOG=1 every `interval_s`, for as long as the event loop runs this task."""
    while True:
        sd_notify("WATCHDOG=1")
        await asyncio.sleep(interval_s)
