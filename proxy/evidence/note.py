"""Checkpoints as C2SP signed notes (`tlog-checkpoint` over `signed-note`, Ed25519), docs/evidence.md.

The note's text is the log's origin, the tree size in decimal and the root in base64, one a line;
then a blank line and one signature line: an em dash, the key's name, and the base64 of the
key's 4-byte id followed by the Ed25519 signature of the text. The key's name is the origin (as
tlog-checkpoint recommends), so a writer life's notes are signed under its own name; the id is
the first 4 bytes of SHA-256(name || 0x0A || 0x01 || the 32-byte public key), 0x01 naming
Ed25519. So any verifier of signed notes (Go's golang.org/x/mod/sumdb/note among them) checks
it with `verifier_key(public, origin)`.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from dataclasses import dataclass

from proxy.evidence.keys import PublicKey, SigningKey

__all__ = ["Checkpoint", "key_id", "parse_note", "signed_note", "verifier_key"]

_ED25519 = b"\x01"
_DASH = "\u2014 "


def key_id(name: str, public: PublicKey) -> bytes:
    """The 4-byte key id of a signed note's signature line."""
    return hashlib.sha256(name.encode() + b"\n" + _ED25519 + public.raw).digest()[:4]


def verifier_key(public: PublicKey, name: str) -> str:
    """`name+<hex id>+<base64 of 0x01 || key>`: the verifier key text of C2SP signed notes."""
    return f"{name}+{key_id(name, public).hex()}+{base64.b64encode(_ED25519 + public.raw).decode()}"


def checkpoint_text(origin: str, tree_size: int, root: bytes) -> str:
    """The checkpoint body: origin, size, base64 root, each ending in a newline."""
    return f"{origin}\n{tree_size}\n{base64.b64encode(root).decode()}\n"


def signed_note(origin: str, tree_size: int, root: bytes, signer: SigningKey) -> str:
    """The checkpoint as a signed note."""
    text = checkpoint_text(origin, tree_size, root)
    signature = signer.sign_raw(text.encode())
    blob = base64.b64encode(key_id(origin, signer.public) + signature).decode()
    return f"{text}\n{_DASH}{origin} {blob}\n"


@dataclass(frozen=True)
class Checkpoint:
    """A signed note read back: what it says, and whether `public` signed it."""

    origin: str
    tree_size: int
    root: bytes
    signed: bool


def parse_note(note: object, public: PublicKey | None) -> Checkpoint | str:
    """The checkpoint a note states, with whether one of its signatures is `public`'s (by key
    name and id) and valid; a sentence saying why when it is not a checkpoint note."""
    if not isinstance(note, str) or "\n\n" not in note:
        return "not a signed note (no blank line before the signatures)"
    text, _, signatures = note.partition("\n\n")
    text += "\n"
    lines = text.split("\n")
    if len(lines) < 4 or not lines[1].isdigit() or len(lines[1]) > 20:
        return "its text is not origin, tree size, root"
    try:
        root = base64.b64decode(lines[2], validate=True)
    except (binascii.Error, ValueError):
        return "its root is not base64"
    if len(root) != 32:
        return "its root is not 32 bytes"
    signed = False
    name = lines[0]
    for line in signatures.split("\n"):
        if public is None or not line.startswith(_DASH + name + " "):
            continue
        try:
            blob = base64.b64decode(line[len(_DASH + name) + 1 :], validate=True)
        except (binascii.Error, ValueError):
            continue
        if blob[:4] == key_id(name, public) and public.verifies_raw(blob[4:], text.encode()):
            signed = True
    return Checkpoint(lines[0], int(lines[1]), root, signed)
