"""RFC 6962 Merkle trees over evidence lines: roots, audit paths, consistency proofs (docs/evidence.md).

A leaf is `SHA-256(0x00 || line)`, the line's exact bytes with its newline (the bytes the
chain's `prev` hashes); a node is `SHA-256(0x01 || left || right)`; the tree of n leaves splits
at the largest power of two below n (RFC 6962 §2.1). `CompactTree` is the writer's: it keeps only
the roots of the full subtrees on the right edge, O(log n), to give the root of every prefix.
`Levels` is the prover's: every full subtree of a life's leaves, so any path costs O(log² n).
The two `verify_*` functions are RFC 9162's §2.1.3.2 and §2.1.4.2, step for step.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

__all__ = [
    "EMPTY_ROOT",
    "CompactTree",
    "Levels",
    "leaf_hash",
    "node_hash",
    "verify_consistency",
    "verify_inclusion",
]

EMPTY_ROOT = hashlib.sha256(b"").digest()
_SIZE = 32


def leaf_hash(line: bytes) -> bytes:
    """`SHA-256(0x00 || line)`."""
    return hashlib.sha256(b"\x00" + line).digest()


def node_hash(left: bytes, right: bytes) -> bytes:
    """`SHA-256(0x01 || left || right)`."""
    return hashlib.sha256(b"\x01" + left + right).digest()


def _split(n: int) -> int:
    """The largest power of two smaller than n (n >= 2)."""
    return 1 << ((n - 1).bit_length() - 1)


class CompactTree:
    """A tree grown one leaf at a time, holding the full subtrees on its right edge."""

    def __init__(self) -> None:
        """An empty tree."""
        self.size = 0
        self._edge: list[bytes] = []  # full subtrees' roots, largest first

    def append(self, leaf: bytes) -> None:
        """Add a leaf hash."""
        self._edge.append(leaf)
        size = self.size
        while size & 1:  # merge the subtrees of equal size, as a binary counter carries
            right = self._edge.pop()
            self._edge[-1] = node_hash(self._edge[-1], right)
            size >>= 1
        self.size += 1

    def root(self) -> bytes:
        """The root of the tree of every leaf so far."""
        if not self._edge:
            return EMPTY_ROOT
        root = self._edge[-1]
        for left in reversed(self._edge[:-1]):
            root = node_hash(left, root)
        return root


class Levels:
    """Every full, aligned subtree of a sequence of leaf hashes: level j holds the roots of the
    subtrees of 2^j leaves, concatenated (32 bytes each)."""

    def __init__(self, leaves: Sequence[bytes]) -> None:
        """Hash every level up from the leaves."""
        self.size = len(leaves)
        self._levels = [b"".join(leaves)]
        while len(self._levels[-1]) >= 2 * _SIZE:
            below = self._levels[-1]
            self._levels.append(
                b"".join(
                    node_hash(below[i : i + _SIZE], below[i + _SIZE : i + 2 * _SIZE])
                    for i in range(0, len(below) - _SIZE, 2 * _SIZE)
                )
            )

    def root(self, lo: int, hi: int) -> bytes:
        """MTH(D[lo:hi]); `lo` must start a subtree of the tree it is part of (as every RFC 6962
        subtree does)."""
        n = hi - lo
        if n == 0:
            return EMPTY_ROOT
        if n & (n - 1) == 0:  # a full subtree: stored
            j = n.bit_length() - 1
            return self._levels[j][(lo >> j) * _SIZE : ((lo >> j) + 1) * _SIZE]
        k = _split(n)
        return node_hash(self.root(lo, lo + k), self.root(lo + k, hi))

    def inclusion(self, index: int, size: int) -> list[bytes]:
        """PATH(index, D[0:size]) (RFC 6962 §2.1.1), bottom-up."""
        path: list[bytes] = []
        lo, hi, m = 0, size, index
        while hi - lo > 1:
            k = _split(hi - lo)
            if m < k:
                path.append(self.root(lo + k, hi))
                hi = lo + k
            else:
                path.append(self.root(lo, lo + k))
                lo, m = lo + k, m - k
        return path[::-1]

    def consistency(self, first: int, second: int) -> list[bytes]:
        """PROOF(first, D[0:second]) (RFC 6962 §2.1.2)."""
        if not 0 < first <= second <= self.size:
            raise ValueError(f"no consistency proof from {first} to {second} of {self.size} leaves")
        return self._subproof(first, 0, second, True)

    def _subproof(self, m: int, lo: int, hi: int, whole: bool) -> list[bytes]:
        n = hi - lo
        if m == n:
            return [] if whole else [self.root(lo, hi)]
        k = _split(n)
        if m <= k:
            return [*self._subproof(m, lo, lo + k, whole), self.root(lo + k, hi)]
        return [*self._subproof(m - k, lo + k, hi, False), self.root(lo, lo + k)]


def verify_inclusion(leaf: bytes, index: int, size: int, path: Sequence[bytes], root: bytes) -> bool:
    """Whether `path` proves `leaf` at `index` in the tree of `size` leaves whose root is `root`."""
    if not 0 <= index < size:
        return False
    fn, sn, r = index, size - 1, leaf
    for p in path:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            r = node_hash(p, r)
            while not (fn & 1 or fn == 0):
                fn, sn = fn >> 1, sn >> 1
        else:
            r = node_hash(r, p)
        fn, sn = fn >> 1, sn >> 1
    return sn == 0 and r == root


def verify_consistency(
    first: int, second: int, first_root: bytes, second_root: bytes, proof: Sequence[bytes]
) -> bool:
    """Whether `proof` shows the tree of `first` leaves (root `first_root`) is a prefix of the
    tree of `second` leaves (root `second_root`)."""
    if first == second:
        return not proof and first_root == second_root
    if not 0 < first < second or not proof:
        return False
    path = [first_root, *proof] if first & (first - 1) == 0 else list(proof)
    fn, sn = first - 1, second - 1
    while fn & 1:
        fn, sn = fn >> 1, sn >> 1
    fr = sr = path[0]
    for c in path[1:]:
        if sn == 0:
            return False
        if fn & 1 or fn == sn:
            fr, sr = node_hash(c, fr), node_hash(c, sr)
            while not (fn & 1 or fn == 0):
                fn, sn = fn >> 1, sn >> 1
        else:
            sr = node_hash(sr, c)
        fn, sn = fn >> 1, sn >> 1
    return sn == 0 and fr == first_root and sr == second_root
