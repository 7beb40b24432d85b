"""ClusterLookup: the matched prefix per node, in one parallel round of directory queries.

The chain's directory keys are cut into segments (kvd.cluster.placement);
each owner gets one DirectoryQuery with all of its segments, every owner at
once, each under the cluster deadline. Where segments have several replicas
(cluster.directory_replicas), this node answers a segment it is a replica of
itself, and asks one reachable replica at random for each other one. The answers compose into a matched
length per node (kvd.cluster.directory.longest_prefixes), stopping at the
first segment whose owner did not answer. This node's own match comes from
its index, exactly, and replaces what the directory says about it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
from collections import defaultdict
from dataclasses import dataclass

import grpc
import numpy as np

from kvd.cluster import wire
from kvd.cluster.directory import DirectoryShard, longest_prefixes
from kvd.cluster.keys import KEY_BYTES, mask_keys, namespace_mask, rendezvous_ids, split
from kvd.cluster.members import MemberView
from kvd.cluster.placement import Rendezvous, packed_segment_starts
from kvd.cluster.rpc import Peers, query_response

log = logging.getLogger("kvd.cluster")


@dataclass(frozen=True, slots=True)
class NodeMatch:
    """How many leading blocks of a chain one node holds; `local`: this node."""

    node: str
    address: str
    matched: int
    local: bool
    load_s: float = math.nan  # with load times: seconds until the node has them in host memory (NaN: unknown)


@dataclass(frozen=True, slots=True)
class LookupAnswer:
    """A lookup's answer (ClusterLookup's, kvd.server.convert): the nodes, most blocks first, and
    how many of the chain's segments were asked and how many of those went unanswered."""

    nodes: list[NodeMatch]
    segments: int
    segments_unanswered: int


class ClusterRouter:
    def __init__(self, self_name: str, view: MemberView, shard: DirectoryShard, peers: Peers,
                 segment_blocks: int, timeout_s: float, replicas: int = 1) -> None:
        self.self_name = self_name
        self.replicas = replicas
        self._random = random.Random()
        self.view = view
        self.shard = shard
        self.peers = peers
        self.segment_blocks = segment_blocks
        self.timeout_s = timeout_s
        self.owners: Rendezvous | None = None
        self.unanswered_queries = 0

    def set_members(self, names: list[str]) -> None:
        self.owners = Rendezvous(names) if names else None

    async def lookup(self, namespace_id: bytes, packed: bytes, local_matched: int) -> LookupAnswer:
        keys = mask_keys(packed, namespace_mask(namespace_id))
        starts = packed_segment_starts(keys, self.segment_blocks)
        bounds = list(zip(starts, [*starts[1:], len(keys) // KEY_BYTES]))
        answers: list[list[tuple[str, ...]] | None] = [None] * len(bounds)
        if self.owners is not None and bounds:
            await self._ask_owners(keys, bounds, answers)
        answered = next((i for i, answer in enumerate(answers) if answer is None), len(answers))
        matched = longest_prefixes(answers[:answered], [end - start for start, end in bounds[:answered]])
        matched.pop(self.self_name, None)
        if local_matched:
            matched[self.self_name] = local_matched
        nodes = []
        for node, length in sorted(matched.items(), key=lambda item: (-item[1], item[0])):
            member = self.view.get(node)
            if member is not None:
                nodes.append(NodeMatch(node=node, address=member.address, matched=length,
                                       local=node == self.self_name))
        return LookupAnswer(nodes=nodes, segments=len(bounds),
                            segments_unanswered=sum(answer is None for answer in answers))

    async def _ask_owners(self, keys: bytes, bounds: list[tuple[int, int]], answers: list) -> None:
        """One round of queries, one replica per segment; segments whose replica failed fast
        (a dead node refuses at once) are asked of their next replica, within the same deadline."""
        anchors = np.frombuffer(keys, dtype=np.uint8).reshape(-1, KEY_BYTES)[[start for start, _ in bounds]]
        replica_sets = self.owners.replica_indices(rendezvous_ids(anchors.tobytes()), self.replicas)
        untried = [[self.owners.members[i] for i in row] for row in replica_sets.tolist()]
        segment_keys = [keys[start * KEY_BYTES:end * KEY_BYTES] for start, end in bounds]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        pending = list(range(len(bounds)))
        while pending and (remaining := deadline - loop.time()) > 0:
            by_owner: dict[str, list[int]] = defaultdict(list)
            for segment in pending:
                if untried[segment]:
                    owner = self._pick(untried[segment])
                    untried[segment].remove(owner)
                    by_owner[owner].append(segment)
            if not by_owner:
                return
            await asyncio.gather(*(self._ask(owner, segments, segment_keys, answers, remaining)
                                   for owner, segments in by_owner.items()))
            pending = [segment for segment in pending if answers[segment] is None]

    async def price(self, namespace_id: bytes, packed: bytes, nodes: list[NodeMatch]) -> list[NodeMatch]:
        """Each other node's own price of its match (PriceBlocks, all at once within the timeout): its
        exact match and the seconds until it could be in its host memory; NaN where it did not answer.
        Longest match first again; a node that holds nothing after all is left out."""
        async def ask(match: NodeMatch) -> NodeMatch:
            stub = self.peers.stub(match.node)
            if match.local or stub is None:
                return match
            try:
                response = await stub.PriceBlocks(wire.price_blocks_request(namespace_id, packed),
                                                  timeout=self.timeout_s, metadata=self.peers.metadata)
            except grpc.RpcError as error:
                log.info("a node's price not known", extra={"peer": match.node, "reason": error.code().name})
                return match
            matched, load_s = wire.price(response)
            return dataclasses.replace(match, matched=matched, load_s=load_s)
        priced = await asyncio.gather(*(ask(match) for match in nodes))
        return sorted((match for match in priced if match.matched), key=lambda match: (-match.matched, match.node))

    def _pick(self, replicas: list[str]) -> str:
        """This node where it is a replica, else one with a channel at random (the first if none has)."""
        if self.self_name in replicas:
            return self.self_name
        reachable = [name for name in replicas if self.peers.stub(name) is not None]
        return self._random.choice(reachable) if reachable else replicas[0]

    async def _ask(self, owner: str, segments: list[int], segment_keys: list[bytes], answers: list,
                   timeout_s: float) -> None:
        request = [segment_keys[i] for i in segments]
        if owner == self.self_name:
            response = query_response(self.shard, [split(data) for data in request])
        else:
            stub = self.peers.stub(owner)
            if stub is None:
                return
            try:
                response = await stub.DirectoryQuery(wire.directory_query_request(request),
                                                     timeout=timeout_s, metadata=self.peers.metadata)
            except grpc.RpcError as error:
                self.unanswered_queries += 1
                log.warning("directory query failed", extra={"owner": owner, "code": str(error.code())})
                return
        decoded = wire.query_answers(response, len(segments))
        if decoded is None:
            return
        for i, answer in zip(segments, decoded):
            answers[i] = answer
