"""Reading a run bundle's tar safely: bounded, streamed, plain files only (docs/security.md).

A bundle comes from someone else. Its tar is read as a stream (`r|*`: one pass, nothing
seeks back) through `_Capped`, which counts every decompressed byte tarfile asks for and
refuses a read that would pass `Limits.total_bytes` *before* it is made: a decompression bomb,
or a pax header that claims a gigabyte, costs at most the bound, never the bomb's size. A
member is refused from its header alone when it says it is larger than `member_bytes`, as is
any member that is not a plain file or a folder (a symlink, a hard link, a device), any name that
is absolute or climbs out (`..`), and the member after the `members`-th. Nothing is written to
disk: the members are returned as bytes.
"""

from __future__ import annotations

import gzip
import io
import tarfile
import unicodedata
import zlib
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

__all__ = ["DEFAULT_LIMITS", "Limits", "UnsafeBundle", "printable", "read_members"]

_CHUNK = 1024 * 1024
_GZIP_MAGIC = b"\x1f\x8b"


class UnsafeBundle(Exception):
    """A bundle refused: unreadable, over a bound, or holding a member that is not a plain file."""


@dataclass(frozen=True)
class Limits:
    """What a bundle may hold: decompressed bytes in all (headers included), per member, members."""

    total_bytes: int = 256 * 1024 * 1024
    member_bytes: int = 128 * 1024 * 1024
    members: int = 4096


DEFAULT_LIMITS = Limits()


def printable(text: str) -> str:
    """`text` with every control or otherwise unprintable character written as an escape
    (`\\x1b`, `\\u202e`), so a name in a bundle cannot move the cursor, recolour or hide the
    words printed around it (`BROKEN`)."""
    if text.isprintable():
        return text
    out = []
    for char in text:
        if char.isprintable() and unicodedata.category(char) not in ("Cf", "Co", "Cs"):
            out.append(char)
        elif ord(char) < 0x100:
            out.append(f"\\x{ord(char):02x}")
        else:
            out.append(f"\\u{ord(char):04x}" if ord(char) < 0x10000 else f"\\U{ord(char):08x}")
    return "".join(out)


class _Capped(io.RawIOBase):
    """A readable stream that refuses to hand out more than `limit` bytes in all."""

    def __init__(self, inner: io.BufferedIOBase, limit: int) -> None:
        self._inner = inner
        self._limit = limit
        self.count = 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        if size is None or size < 0 or self.count + size > self._limit:
            size = self._limit - self.count + 1  # one byte past the bound: enough to know it is passed
        data = self._inner.read(size)
        self.count += len(data)
        if self.count > self._limit:
            raise UnsafeBundle(f"it unpacks to more than {self._limit} bytes (a decompression bomb?)")
        return data


def _check_member(info: tarfile.TarInfo, limits: Limits, seen: set[str]) -> str:
    """The member's name when it may be read; UnsafeBundle naming it (escaped) when not."""
    name = printable(info.name)
    parts = PurePosixPath(info.name).parts
    if info.name.startswith("/") or "\\" in info.name or ".." in parts or not parts:
        raise UnsafeBundle(f"member {name!r} has an absolute or climbing path (path traversal)")
    if not (info.isfile() or info.isdir()):
        kind = "a symlink" if info.issym() else "a hard link" if info.islnk() else "not a plain file"
        raise UnsafeBundle(f"member {name!r} is {kind}")
    if info.size > limits.member_bytes:
        raise UnsafeBundle(
            f"member {name!r} is {info.size} bytes, over the {limits.member_bytes} a member may hold"
        )
    if info.name in seen:
        raise UnsafeBundle(f"member {name!r} appears twice")
    return info.name


def _read_member(tar: tarfile.TarFile, info: tarfile.TarInfo) -> bytes:
    handle = tar.extractfile(info)
    if handle is None:
        return b""
    data = bytearray()
    while chunk := handle.read(_CHUNK):
        data += chunk
    return bytes(data)


def _pass(path: Path, limits: Limits, keep: bool) -> dict[str, bytes]:
    """One pass over the tar: each member checked; its bytes kept only when `keep`."""
    members: dict[str, bytes] = {}
    seen: set[str] = set()
    with open(path, "rb") as raw:
        gzipped = raw.read(2) == _GZIP_MAGIC
        raw.seek(0)
        source: io.BufferedIOBase = gzip.GzipFile(fileobj=raw, mode="rb") if gzipped else raw
        # Unbuffered on purpose: a buffer would allocate what tarfile asks for before the
        # bound could refuse it.
        with tarfile.open(fileobj=_Capped(source, limits.total_bytes), mode="r|") as tar:
            for count, info in enumerate(tar, 1):
                if count > limits.members:
                    raise UnsafeBundle(f"it holds more than {limits.members} members")
                name = _check_member(info, limits, seen)
                seen.add(name)
                if keep and info.isfile():
                    members[name] = _read_member(tar, info)
    return members


def read_members(path: Path, limits: Limits = DEFAULT_LIMITS) -> dict[str, bytes]:
    """Every plain file of the tar (gzip'd or not) at `path`, by name; UnsafeBundle, in one line, when
    the bundle cannot be read, passes a bound, or holds a member that is not a plain file.

    Two passes: the first reads the headers and skips the data, keeping nothing, so a bundle
    past a bound is refused having held none of it; the second keeps the members.
    """
    try:
        _pass(path, limits, keep=False)
        return _pass(path, limits, keep=True)
    except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:
        raise UnsafeBundle(f"it is not a readable bundle (a .tar.gz): {printable(str(exc))}") from None
