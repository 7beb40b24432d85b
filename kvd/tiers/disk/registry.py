"""The namespaces a drive holds blocks of: its NAMESPACES registry.

Recovery must know each namespace's shape (layers, layer bytes) before any
client registers it again, or the blocks on disk could not be read back.
Every drive therefore keeps an append-only file of framed, checksummed
records (frames.encode_frame, type NAMESPACE):

    payload = namespace id (32)  NamespaceSpec.encode() bytes

A tenant's namespace (auth.mode = "token") has its tenant's name in its
spec, so it is recovered as that tenant's namespace and no other's. A kvd
that predates tenants cannot decode such a spec and leaves it alone.

A namespace is appended (and fsynced) to every drive's registry before the
first block of it is written anywhere, so a drive's manifest never names a
namespace its own registry lacks, barring damage.

The spec encoding is tagged and length-prefixed (kvd.core.keys), so it can
be decoded back into a NamespaceSpec: `decode_spec`. A decoded spec must
re-encode to the same bytes and digest to the id it is filed under; a record
that does not is refused (a different key schema wrote it, or a bug did).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvd.core.keys import KEY_BYTES, DType, InnerLayout, KvOrder, NamespaceSpec
from kvd.errors import InvalidArgument
from kvd.invariants import check
from kvd.tiers.disk.frames import RecordType, decode_frames, encode_frame
from kvd.tiers.disk.fs import FileSystem, OsFileSystem
from kvd.tiers.disk.layout import NAMESPACES

_LENGTH = struct.Struct("<I")
_U32 = struct.Struct("<I")


def _text(value: bytes) -> str:
    return value.decode("utf-8")


def _u32(value: bytes) -> int:
    if len(value) != _U32.size:
        raise ValueError(f"expected 4 bytes, got {len(value)}")
    return _U32.unpack(value)[0]


# The fields of NamespaceSpec.encode(), in its order. The round-trip test in
# tests/disk/test_registry.py fails if keys.py gains a field this lacks.
_FIELDS: tuple[tuple[str, Callable[[bytes], object]], ...] = (
    ("model_id", _text),
    ("model_revision", _text),
    ("kv_dtype", lambda value: DType(_u32(value))),
    ("num_layers", _u32),
    ("num_kv_heads", _u32),
    ("head_dim", _u32),
    ("block_tokens", _u32),
    ("inner_layout", lambda value: InnerLayout(_u32(value))),
    ("kv_order", lambda value: KvOrder(_u32(value))),
    ("tp_rank", _u32),
    ("tp_size", _u32),
    ("pp_stage", _u32),
    ("pp_size", _u32),
    ("lora_id", _text),
    ("tenant_salt", bytes),
    ("hash_scheme", _text),
    # Encoded only when not empty (a tenant's namespace, auth.mode = "token").
    ("tenant", _text),
)
_OPTIONAL_FIELDS = frozenset({"tenant"})


def decode_spec(encoding: bytes) -> NamespaceSpec:
    """The NamespaceSpec whose encode() is `encoding`; InvalidArgument otherwise."""
    values: dict[str, object] = {}
    position = 0
    for name, convert in _FIELDS:
        if position == len(encoding) and name in _OPTIONAL_FIELDS:
            break
        if position >= len(encoding):
            raise InvalidArgument(f"namespace encoding ends before field {name!r}")
        tag_length = encoding[position]
        tag = encoding[position + 1 : position + 1 + tag_length]
        if tag != name.encode() and name in _OPTIONAL_FIELDS:
            break  # not this optional field: bytes after the last field
        position += 1 + tag_length
        if tag != name.encode():
            raise InvalidArgument(f"namespace encoding has field {tag!r} where {name!r} belongs")
        if position + _LENGTH.size > len(encoding):
            raise InvalidArgument(f"namespace encoding is cut inside field {name!r}")
        (value_length,) = _LENGTH.unpack_from(encoding, position)
        position += _LENGTH.size
        value = encoding[position : position + value_length]
        if len(value) != value_length:
            raise InvalidArgument(f"namespace encoding is cut inside field {name!r}")
        position += value_length
        try:
            values[name] = convert(value)
        except (ValueError, UnicodeDecodeError) as error:
            raise InvalidArgument(f"namespace encoding field {name!r}: {error}") from None
    if position != len(encoding):
        raise InvalidArgument(f"namespace encoding has {len(encoding) - position} bytes after its last field")
    spec = NamespaceSpec(**values)  # validates every field
    # Canonical form only: anything that re-encodes differently digests differently.
    if spec.encode() != encoding:
        raise InvalidArgument("namespace encoding is not canonical")
    return spec


@dataclass(frozen=True, slots=True)
class NamespaceEntry:
    namespace_id: bytes
    encoding: bytes
    spec: NamespaceSpec | None  # None: written by a kvd whose spec encoding this one cannot read


@dataclass(slots=True)
class RegistryReport:
    records: int = 0
    truncated_bytes: int = 0
    malformed_records: int = 0
    damaged_regions: int = 0
    damaged_bytes: int = 0


class NamespaceRegistry:
    """The NAMESPACES file of one drive directory."""

    def __init__(self, directory: Path, fs: FileSystem | None = None, *, read_only: bool = False) -> None:
        self.directory = Path(directory)
        self.path = self.directory / NAMESPACES
        self.fs = fs or OsFileSystem()
        self.read_only = read_only
        self.entries: dict[bytes, NamespaceEntry] = {}

    def open(self) -> RegistryReport:
        report = RegistryReport()
        data = self.fs.read(self.path)
        if data is None:
            if not self.read_only:
                # Created empty and durable now, so later appends only append.
                self.fs.write_new(self.path, b"")
                self.fs.fsync(self.path)
                self.fs.fsync_directory(self.directory)
            return report
        scan = decode_frames(data)
        if scan.valid_end < len(data):
            report.truncated_bytes = len(data) - scan.valid_end
            if not self.read_only:
                self.fs.truncate(self.path, scan.valid_end)
                self.fs.fsync(self.path)
        # Damage inside the file costs the records it hit (decode_frames
        # resynchronises after it); every drive holds every namespace, so
        # the tier completes this one from the others.
        report.damaged_regions = len(scan.damaged)
        report.damaged_bytes = scan.damaged_bytes
        for record_type, payload in scan.frames:
            report.records += 1
            if record_type != RecordType.NAMESPACE or len(payload) <= KEY_BYTES:
                report.malformed_records += 1
                continue
            namespace_id, encoding = payload[:KEY_BYTES], payload[KEY_BYTES:]
            entry = self._entry(namespace_id, encoding)
            if entry is None:
                report.malformed_records += 1
                continue
            self.entries[namespace_id] = entry
        return report

    def _entry(self, namespace_id: bytes, encoding: bytes) -> NamespaceEntry | None:
        """The entry of a record; None for a spec filed under an id it does not digest to."""
        try:
            spec = decode_spec(encoding)
        except InvalidArgument:
            return NamespaceEntry(namespace_id, encoding, None)
        if spec.namespace_id() != namespace_id:
            # Never written so by kvd (register_namespace checks the digest):
            # a resynchronisation that landed inside a spec's text, or a bug.
            return None
        return NamespaceEntry(namespace_id, encoding, spec)

    def rewrite(self) -> None:
        """Write the file anew from the entries (after damage inside it):
        a temporary file, fsync, rename over NAMESPACES, fsync the directory."""
        check(not self.read_only, "registry opened read-only")
        data = b"".join(encode_frame(RecordType.NAMESPACE, entry.namespace_id + entry.encoding)
                        for entry in self.entries.values())
        temporary = self.path.with_name(NAMESPACES + ".tmp")
        self.fs.write_new(temporary, data)
        self.fs.fsync(temporary)
        self.fs.rename(temporary, self.path)
        self.fs.fsync_directory(self.directory)

    def add(self, entry: NamespaceEntry) -> None:
        """Append and fsync: the namespace is durable when this returns."""
        check(not self.read_only, "registry opened read-only")
        if entry.namespace_id in self.entries:
            return
        frame = encode_frame(RecordType.NAMESPACE, entry.namespace_id + entry.encoding)
        self.fs.append(self.path, frame)
        self.fs.fsync(self.path)
        self.entries[entry.namespace_id] = entry
