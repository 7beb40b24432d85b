"""Suite-wide guards: no test may leak a block handle.

Every Engine built while a test runs is recorded (Engine.__init__ is wrapped
for the duration of the test), and after the test body the test fails if any
of them counted a leaked handle. A leak is a BlockHandle garbage collected
while still holding its reference; it is released by __del__ and warned
about, so without this check a leak would only show up as a log line.

The leak warning itself is also made an error. Raised from __del__ it
becomes an unraisable exception, which pytest reports (pyproject makes
PytestUnraisableExceptionWarning an error too).

A test that leaks on purpose marks itself `allow_leaked_handles`.
"""

from __future__ import annotations

import gc

import pytest

from kvd.core.engine import Engine

_TRACKED = pytest.StashKey[list[Engine]]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "allow_leaked_handles: the test leaks block handles on purpose")
    config.addinivalue_line("filterwarnings", "error:leaked block handle:ResourceWarning")


@pytest.fixture(autouse=True)
def _track_engines(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    engines: list[Engine] = []
    original_init = Engine.__init__

    def tracking_init(self: Engine, *args, **kwargs) -> None:
        original_init(self, *args, **kwargs)
        engines.append(self)

    monkeypatch.setattr(Engine, "__init__", tracking_init)
    request.node.stash[_TRACKED] = engines
    yield engines


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    result = yield
    # Reached only when the test body passed; a failure already says enough.
    engines = item.stash.get(_TRACKED, [])
    if engines and item.get_closest_marker("allow_leaked_handles") is None:
        # A handle in a reference cycle is only finalized by the collector.
        # A full collection costs ~0.2 s once torch is loaded, so run it only
        # when some handle lives outside every lease (held by the test, or
        # garbage not yet collected).
        if any(_handles_outside_leases(engine) for engine in engines):
            gc.collect()
        leaked = [engine.leaked_handles for engine in engines if engine.leaked_handles]
        if leaked:
            pytest.fail(f"engines created by this test leaked block handles: {leaked}", pytrace=False)
    return result


def _handles_outside_leases(engine: Engine) -> int:
    in_leases = sum(
        not handle.released
        for lease in engine.leases
        for handle in (*lease.handles, lease.parent_handle)
        if handle is not None
    )
    return engine.live_handles - in_leases


@pytest.fixture
def engine_factory(_track_engines: list[Engine]):
    """Build engines; each is verified at teardown (leaks are checked by the hook above)."""

    def build(slots: int = 6, slot_bytes: int = 1 << 10, **kwargs) -> Engine:
        return Engine(host_slot_count=slots, host_slot_bytes=slot_bytes, **kwargs)

    yield build
    for engine in _track_engines:
        engine.verify()
