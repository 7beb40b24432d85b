"""A NIXL READ whose handle cannot be released (cancelled) while it runs may still write into the
reader's slots (issue 37 item 2): the transport says so with a future, done only once the agent
reports the transfer over or its peer is removed."""

from __future__ import annotations

import asyncio

from kvd.cluster.nixl_transport import NixlTransport
from kvd.supervisor import Supervisor


class StuckAgent:
    """A NIXL agent whose transfers run until told to end, and whose release fails while they run."""

    def __init__(self) -> None:
        self.state = "PROC"
        self.released = 0

    def register_memory(self, *args):
        return "registration"

    def get_partial_agent_metadata(self, descs, connection, backends):
        return b"metadata"

    def get_reg_descs(self, rows, kind):
        return rows

    def add_remote_agent(self, metadata):
        return b"peer-1"

    def remove_remote_agent(self, name):
        pass

    def get_xfer_descs(self, rows, kind):
        return rows

    def initialize_xfer(self, *args):
        return "handle"

    def transfer(self, handle):
        return self.state

    def check_xfer_state(self, handle):
        return self.state

    def release_xfer_handle(self, handle):
        if self.state == "PROC":
            raise RuntimeError("NIXL_ERR_REMOTE_DISCONNECT: cannot release a running transfer")
        self.released += 1

    def get_new_notifs(self):
        return {}

    def deregister_memory(self, registration):
        pass


async def stuck_read(agent: StuckAgent) -> tuple[NixlTransport, bool, asyncio.Future | None]:
    transport = NixlTransport("me", 1, 0x1000, 4096, agent=agent)
    await transport.add_peer("peer", b"metadata")
    done, running = await transport.read("peer", [0x1000], [0x2000], 64, timeout_s=0.01, grant=b"grant")
    return transport, done, running


def test_a_read_that_cannot_be_cancelled_is_running_until_the_agent_says_it_ended():
    async def scenario():
        agent = StuckAgent()
        transport, done, running = await stuck_read(agent)
        assert not done and running is not None
        for _ in range(20):  # the progress loop polls it; it is still running
            await asyncio.sleep(0.002)
        assert not running.done() and agent.released == 0
        agent.state = "DONE"
        await asyncio.wait_for(running, 5)
        assert agent.released == 1 and transport.failed_reads == 1
        await transport.close()

    asyncio.run(scenario())


def test_removing_its_peer_ends_an_uncancelled_read_and_a_cancelled_one_returns_none():
    async def scenario():
        agent = StuckAgent()
        transport, _, running = await stuck_read(agent)
        await transport.remove_peer("peer")
        assert running.done()
        agent.state = "ERR"  # released at once now: nothing keeps running
        await transport.add_peer("peer", b"metadata")
        done, running = await transport.read("peer", [0x1000], [0x2000], 64, timeout_s=0.01, grant=b"grant")
        assert (done, running) == (False, None)
        await transport.close()

    asyncio.run(scenario())


class BrokenAgent(StuckAgent):
    def get_new_notifs(self):
        raise RuntimeError("NIXL_ERR_BACKEND: the UCX worker is gone")


def test_an_agent_that_fails_in_the_progress_task_stops_kvd_loudly():
    """The progress task runs under the daemon's supervisor: it does not die silently."""
    async def scenario():
        supervisor = Supervisor()
        failed = asyncio.Event()
        supervisor.on_failure(lambda what, error: failed.set())
        transport = NixlTransport("me", 1, 0x1000, 4096, agent=BrokenAgent(), spawn=supervisor.spawn)
        transport.serving(+1)  # a peer holds pins here: the agent must progress
        await asyncio.wait_for(failed.wait(), 5)
        what, error = supervisor.failure
        assert what == "the nixl-progress task" and "UCX worker is gone" in str(error)
        transport.serving(-1)
        await transport.close()

    asyncio.run(scenario())
