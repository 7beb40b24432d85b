"""The layering written in kvd/README.md (its table's "may import" column, an allow-list), enforced on
every module's imports."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "kvd"

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


README = PACKAGE / "README.md"
# What a "may import" cell grants beyond the layers it names.
EVERYTHING = "anything"


def table_rows() -> list[tuple[list[str], str]]:
    """kvd/README.md's layer table: (the layers of a row, its "may import" cell as written)."""
    rows = [line for line in README.read_text().splitlines() if line.startswith("| `kvd.")]
    assert len(rows) >= 15, "kvd/README.md's layer table is gone"
    table = []
    for row in rows:
        layers_cell, _, may, _ = [cell.strip() for cell in row.strip("|").split(" | ")]
        table.append((layers_cell.replace("`", "").split(", "), may))
    return table


def written_allowances() -> dict[str, set[str]]:
    """kvd/README.md's layer table: each layer (kvd.x) -> the kvd layers its row says it may
    import (top-level names: "core", "v1", "_native", ...), or {EVERYTHING}."""
    top_level = {path.stem if path.is_file() else path.name for path in PACKAGE.iterdir()} | {"v1", "_native"}
    allowances: dict[str, set[str]] = {}
    for layers, may in table_rows():
        allowed = _allowed_in(may, top_level)
        for layer in layers:
            allowances[layer] = allowed
    return allowances


def _allowed_in(may: str, top_level: set[str]) -> set[str]:
    may = re.sub(r" ?\([^)]*\)", "", may)  # what a grant is for, or narrowed to, is not a layer
    if may == "anything":
        return {EVERYTHING}
    if may.startswith("everything but "):
        excluded = {name.strip().removeprefix("kvd.")
                    for name in may[len("everything but "):].replace(" and ", ", ").split(",")}
        return {EVERYTHING, *(f"-{name}" for name in excluded)}
    allowed = set()
    for item in may.replace("`", "").split(","):
        word = item.strip().split(" ")[0].removeprefix("kvd.")
        if word in top_level:
            allowed.add(word)
    return allowed


def layer_of(name: str, allowances: dict[str, set[str]]) -> str | None:
    """The table's row for module `name` (its longest matching layer), if any."""
    matches = [layer for layer in allowances if name == layer or name.startswith(layer + ".")]
    return max(matches, key=len, default=None)


def permits(allowed: set[str], layer: str, target: str) -> bool:
    own = layer.split(".")[1]
    if target in (own, "kvd"):  # itself, and the package root (__version__)
        return True
    if EVERYTHING in allowed:
        return f"-{target}" not in allowed
    return target in allowed


def test_every_import_is_one_the_layer_table_allows():
    allowances = written_allowances()
    violations = []
    modules = [path for path in PACKAGE.rglob("*.py") if "v1" not in path.parts]
    assert len(modules) > 20
    for path in modules:
        name = module_name(path)
        if name in ("kvd", "kvd.__main__"):
            continue
        layer = layer_of(name, allowances)
        if layer is None:
            violations.append(f"{name} belongs to no row of kvd/README.md's layer table")
            continue
        for imported in imports_of(path):
            parts = imported.split(".")
            if parts[0] != "kvd":
                continue
            target = parts[1] if len(parts) > 1 else "kvd"
            if not permits(allowances[layer], layer, target):
                violations.append(f"{name} imports {imported}, which the {layer} row does not allow")
    assert violations == []


def test_the_table_forbids_what_it_should():
    """The allow-list is read right: a few imports the table must refuse."""
    allowances = written_allowances()
    for layer, target in (("kvd.core", "tiers"), ("kvd.core", "v1"), ("kvd.planes", "server"), ("kvd.planes", "v1"),
                          ("kvd.tiers", "planes"), ("kvd.client", "server"), ("kvd.daemon", "cli"),
                          ("kvd.errors", "core"), ("kvd.sim", "tiers")):
        assert not permits(allowances[layer], layer, target), (layer, target)
    assert permits(allowances["kvd.server"], "kvd.server", "planes")
    assert permits(allowances["kvd.daemon"], "kvd.daemon", "server")
    assert not permits(allowances["kvd.daemon"], "kvd.daemon", "v1")
    grants = generated_code_grants()
    assert grants["kvd.server"] == ("kvd.server.convert", "kvd.server.registration"), grants
    assert grants["kvd.cluster"] == ("kvd.cluster.wire",) and grants["kvd.client"] is None, grants
    assert not {"kvd.core", "kvd.planes", "kvd.tiers", "kvd.daemon", "kvd.sim"} & grants.keys(), grants


def test_the_core_is_pure():
    violations = []
    for path in PACKAGE.rglob("*.py"):
        name = module_name(path)
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


# A "may import" cell that grants kvd.v1 to some modules of its layer only: `kvd.v1 (only in `kvd.a.b` and ...)`.
GENERATED_ONLY_IN = re.compile(r"kvd\.v1 \(only in ([^)]*)\)")


def generated_code_grants() -> dict[str, tuple[str, ...] | None]:
    """kvd/README.md's layer table on kvd.v1: each layer whose row grants it -> the modules its
    "may import" cell narrows the grant to, or None where the whole layer may import it."""
    allowances = written_allowances()
    grants: dict[str, tuple[str, ...] | None] = {}
    for layers, may in table_rows():
        narrowed = GENERATED_ONLY_IN.search(may)
        for layer in layers:
            if permits(allowances[layer], layer, "v1"):
                grants[layer] = tuple(re.findall(r"`(kvd\.[\w.]+)`", narrowed.group(1))) if narrowed else None
    return grants


def imports_generated_code(path: Path) -> bool:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import) and any(alias.name.startswith("kvd.v1") for alias in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (
            (node.module or "").startswith("kvd.v1")
            or (node.module == "kvd" and any(alias.name == "v1" for alias in node.names))
        ):
            return True
    return False


def within(name: str, modules: tuple[str, ...]) -> bool:
    return any(name == module or name.startswith(module + ".") for module in modules)


def test_only_the_modules_the_layer_table_names_import_generated_code():
    """kvd.v1 is imported where kvd/README.md's table grants it and nowhere else: by the client-side
    layers and the test harness, and in the daemon by the modules the table names (the server's
    conversion and registration, the cluster's wire), each of which does import it."""
    allowances, grants = written_allowances(), generated_code_grants()
    importers = sorted(module_name(path) for path in PACKAGE.rglob("*.py")
                       if "v1" not in path.relative_to(PACKAGE).parts and imports_generated_code(path))
    refused = []
    for name in importers:
        layer = layer_of(name, allowances)
        if layer not in grants:
            refused.append(f"{name} imports kvd.v1, which the {layer} row does not grant")
        elif grants[layer] is not None and not within(name, grants[layer]):
            refused.append(f"{name} imports kvd.v1, which the {layer} row grants only to {', '.join(grants[layer])}")
    assert refused == []
    named = tuple(module for modules in grants.values() if modules for module in modules)
    assert named, "no row of kvd/README.md's layer table narrows kvd.v1 to modules"
    stale = [module for module in named if not any(within(name, (module,)) for name in importers)]
    assert stale == [], f"kvd/README.md's table names modules that do not import kvd.v1: {stale}"


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
    exists only natively; the planner's search (kvd.planner.search) runs
    natively, its Python model (kvd.planner.latency) the reference the tests hold it to; the CUDA device
    (kvd.device.cuda) issues its batched copies from address arrays natively, where one Python object per
    address would cost millions on a long load."""
    importers = sorted(module_name(path) for path in PACKAGE.rglob("*.py") if imports_native(path))
    assert importers == ["kvd.core.radix", "kvd.device.cpu", "kvd.device.cuda", "kvd.device.io_ring",
                         "kvd.io.checksum", "kvd.io.uring", "kvd.planner.search"], importers
