"""The layering written in kvd/README.md, enforced on every module's imports."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "kvd"

# layer -> kvd modules it must never import (prefix match)
FORBIDDEN = {
    "kvd.core": ["kvd.planes", "kvd.tiers", "kvd.io", "kvd.server", "kvd.daemon", "kvd.cli", "kvd.client", "kvd.metrics", "kvd.v1",
                 "kvd.testing"],
    # Native adapters: below the tiers, beside the core.
    "kvd.io": ["kvd.planes", "kvd.tiers", "kvd.server", "kvd.daemon", "kvd.cli", "kvd.client", "kvd.metrics", "kvd.v1",
               "kvd.testing"],
    # Devices (CPU and CUDA): memory, streams and copies; below the tiers, beside kvd.io.
    "kvd.device": ["kvd.planes", "kvd.core", "kvd.tiers", "kvd.io", "kvd.server", "kvd.daemon", "kvd.cli", "kvd.client",
                   "kvd.metrics", "kvd.v1", "kvd.testing", "kvd.sim", "kvd.cluster", "kvd.connectors"],
    "kvd.tiers": ["kvd.planes", "kvd.server", "kvd.daemon", "kvd.cli", "kvd.client", "kvd.v1", "kvd.testing"],
    "kvd.metrics": ["kvd.planes", "kvd.server", "kvd.daemon", "kvd.cli", "kvd.client", "kvd.testing"],
    "kvd.server": ["kvd.daemon", "kvd.cli", "kvd.client", "kvd.testing"],
    # The data planes: below the gRPC edge, above the core and the tiers; no protobuf.
    "kvd.planes": ["kvd.server", "kvd.daemon", "kvd.cli", "kvd.client", "kvd.testing", "kvd.v1", "kvd.sim",
                   "kvd.cluster", "kvd.connectors", "kvd.metrics"],
    "kvd.daemon": ["kvd.cli", "kvd.client", "kvd.testing"],
    # The cluster: membership, directory placement and shards; beside the server, below the daemon.
    "kvd.cluster": ["kvd.planes", "kvd.server", "kvd.daemon", "kvd.cli", "kvd.client", "kvd.testing", "kvd.sim", "kvd.tiers",
                    "kvd.io"],
    "kvd.client": ["kvd.planes", "kvd.server", "kvd.daemon", "kvd.tiers", "kvd.io", "kvd.cli", "kvd.metrics", "kvd.testing"],
    # Engine connectors: clients of the daemon that live in an engine's process.
    "kvd.connectors": ["kvd.planes", "kvd.server", "kvd.daemon", "kvd.tiers", "kvd.io", "kvd.cli", "kvd.metrics", "kvd.testing",
                       "kvd.sim"],
    # The arena socket's wire format, shared by client and server.
    "kvd.arena_protocol": ["kvd.core", "kvd.tiers", "kvd.io", "kvd.server", "kvd.daemon", "kvd.cli", "kvd.client",
                           "kvd.metrics", "kvd.v1", "kvd.testing", "kvd.sim"],
    "kvd.errors": ["kvd."],
    "kvd.invariants": ["kvd."],
    "kvd.clock": ["kvd."],
    # The placement planner (issue 16): a pure model and search, below everything that does I/O.
    "kvd.planner": ["kvd.core", "kvd.tiers", "kvd.io", "kvd.device", "kvd.server", "kvd.daemon", "kvd.cli",
                    "kvd.client", "kvd.metrics", "kvd.v1", "kvd.testing", "kvd.sim", "kvd.cluster", "kvd.connectors"],
    # The simulator drives the engine the way the daemon does, in-process.
    "kvd.sim": ["kvd.planes", "kvd.server", "kvd.daemon", "kvd.cli", "kvd.client", "kvd.tiers", "kvd.io", "kvd.v1", "kvd.testing"],
}
# The core is pure: no transport, no clocks, no randomness, no threads, no I/O.
CORE_FORBIDDEN_STDLIB = {"asyncio", "grpc", "os", "time", "random", "threading", "socket", "mmap"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_layers_import_downwards_only():
    violations = []
    modules = [path for path in PACKAGE.rglob("*.py") if "v1" not in path.parts]
    assert len(modules) > 20
    for path in modules:
        name = module_name(path)
        for layer, forbidden in FORBIDDEN.items():
            if name == layer or name.startswith(layer + "."):
                for imported in imports_of(path):
                    if any(imported == bad.rstrip(".") or imported.startswith(bad if bad.endswith(".") else bad + ".")
                           or imported == bad for bad in forbidden):
                        violations.append(f"{name} imports {imported}")
        if name.startswith("kvd.core"):
            for imported in imports_of(path):
                if imported.split(".")[0] in CORE_FORBIDDEN_STDLIB:
                    violations.append(f"{name} imports {imported} (the core is pure)")
    assert violations == []


def test_nothing_in_the_package_imports_the_simulator():
    def simulator(name: str) -> bool:
        return name == "kvd.sim" or name.startswith("kvd.sim.")

    importers = sorted(
        module_name(path)
        for path in PACKAGE.rglob("*.py")
        if not simulator(module_name(path)) and any(simulator(name) for name in imports_of(path))
    )
    assert importers == []


def test_only_the_edges_import_generated_code():
    importers = sorted(
        module_name(path)
        for path in PACKAGE.rglob("*.py")
        if "v1" not in path.parts and any(name.startswith("kvd.v1") for name in imports_of(path))
    )
    # The connectors are clients too (the vLLM worker speaks Reserve/GetLayers itself), as is
    # the command line (kvd status), and the cluster is the daemons' edge toward one another
    # (kvd.v1.Cluster).
    allowed_prefixes = ("kvd.server.", "kvd.client.", "kvd.connectors.", "kvd.daemon", "kvd.testing.",
                        "kvd.cluster.", "kvd.cli.")
    assert importers and all(name.startswith(allowed_prefixes) for name in importers), importers


def imports_native(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(alias.name.startswith("kvd._native") for alias in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (
            (node.module or "").startswith("kvd._native")
            or (node.module == "kvd" and any(alias.name == "_native" for alias in node.names))
        ):
            return True
    return False


def test_only_kvd_io_the_prefix_index_and_the_device_data_paths_import_the_native_module():
    """kvd._native's I/O is imported by two kvd.io modules only, so nothing bypasses kvd.io's checks and
    fallback; the prefix index imports its walk (match_chain) and the CPU device its batched copy
    (copy_chunks), each with its own Python loop as the fallback; the I/O ring's proxy (kvd.device.io_ring)
    and the cuFile engine (kvd.io.cufile) exist only natively; the planner's search (kvd.planner.search) runs
    natively, its Python model (kvd.planner.latency) the reference the tests hold it to; the CUDA device
    (kvd.device.cuda) issues its batched copies from address arrays natively, where one Python object per
    address would cost millions on a long load."""
    importers = sorted(module_name(path) for path in PACKAGE.rglob("*.py") if imports_native(path))
    assert importers == ["kvd.core.radix", "kvd.device.cpu", "kvd.device.cuda", "kvd.device.io_ring",
                         "kvd.io.checksum", "kvd.io.cufile", "kvd.io.uring", "kvd.planner.search"], importers
