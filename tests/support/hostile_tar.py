"""Hostile run bundles, made cheaply: decompression bombs, links, climbing names (tests and bench).

A bomb is built without compressing its whole size: gzip allows members one after another, and
a tar member of zeros is zeros up to its padding, so the stream is each header gzip'd alone
followed by one gzip'd block of 16 MiB of zeros repeated.
"""

from __future__ import annotations

import gzip
import io
import tarfile
from pathlib import Path

BLOCK = 16 * 1024 * 1024
_ZEROS = gzip.compress(b"\0" * BLOCK, compresslevel=9)


def bomb(path: Path, members: list[tuple[str, int]]) -> int:
    """A .tar.gz of members of zeros, each `size` bytes (a multiple of 16 MiB); its size on disk."""
    with open(path, "wb") as out:
        for name, size in members:
            assert size % BLOCK == 0
            info = tarfile.TarInfo(name)
            info.size = size
            out.write(gzip.compress(info.tobuf(format=tarfile.PAX_FORMAT)))
            for _ in range(size // BLOCK):
                out.write(_ZEROS)
        out.write(gzip.compress(b"\0" * 1024))  # the end of the archive
    return path.stat().st_size


def tar_with(path: Path, members: list[tarfile.TarInfo | tuple[str, bytes]]) -> None:
    """A .tar.gz of the given members: (name, bytes) for a plain file, or a TarInfo as it is."""
    with tarfile.open(path, "w:gz") as tar:
        for member in members:
            if isinstance(member, tarfile.TarInfo):
                tar.addfile(member)
                continue
            name, data = member
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
