"""The daemon's long-lived tasks and threads, watched: a failure stops kvd, loudly.

A long-lived task (the disk writer, the commit task, the lease sweeper,
the watchdog) or thread (the disk I/O thread) that ends with an exception
has met a bug or a state kvd cannot go on from. Carrying on would leave
blocks pinned and durable waits unanswered while health says SERVING. So
the first failure is logged once, with its traceback, and every listener
is told (the daemon turns health NOT_SERVING and stops with a non-zero
exit status, which systemd's Restart=on-failure or the DaemonSet's
restart policy answers with a fresh start that recovers from the drives).
Nothing is restarted in place. A task that returns, or is cancelled,
ended normally.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

log = logging.getLogger(__name__)

Listener = Callable[[str, BaseException], None]


class Supervisor:
    def __init__(self) -> None:
        # (what failed, its exception): the first failure, kept for the exit status.
        self.failure: tuple[str, BaseException] | None = None
        self._listeners: list[Listener] = []

    def on_failure(self, listener: Listener) -> None:
        """Call listener(name, error) on the event loop when something watched fails."""
        self._listeners.append(listener)

    def spawn(self, coroutine: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        """A long-lived task, watched."""
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        task.add_done_callback(self._task_ended)
        return task

    def _task_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.fail(f"the {task.get_name()} task", task.exception())

    def fail(self, what: str, error: BaseException) -> None:
        """Report a failure of something kvd cannot go on without (on the loop)."""
        if self.failure is not None:
            log.error("%s failed too, while kvd stops: %r", what, error)
            return
        self.failure = (what, error)
        log.critical("%s failed; kvd stops (a restart recovers from the drives)", what, exc_info=error)
        for listener in self._listeners:
            listener(what, error)
