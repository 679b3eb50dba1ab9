"""A checkpoint's signatures, checked: its line's Ed25519 signature and its C2SP signed note.

Shared by the chain check (whole files, proxy/evidence/verify.py) and the Merkle proof check
(bundles, proxy/evidence/proof_check.py). A checkpoint of an older format has no note: its line's
signature is all it has.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass

from proxy.evidence.keys import PublicKey
from proxy.evidence.note import Checkpoint, parse_note

__all__ = ["Signed", "check_checkpoint_signature"]


@dataclass(frozen=True)
class Signed:
    """A checkpoint whose signatures hold, and the key that made them."""

    key: PublicKey


def _note_problem(record: dict[str, object], key: PublicKey, seq: int) -> str | None:
    """What is wrong with its signed note (None: nothing, or it has none)."""
    if "note" not in record:
        return None  # a checkpoint of an older format
    note = parse_note(record.get("note"), key)
    if not isinstance(note, Checkpoint):
        return f"checkpoint seq {seq}: its note is {note}"
    if not note.signed:
        return f"checkpoint seq {seq}: bad note signature"
    stated = (note.tree_size, base64.b64encode(note.root).decode())
    if stated != (record.get("tree_size"), record.get("root")) or not note.origin.endswith(
        f"/{record.get('writer_id')}"
    ):
        return f"checkpoint seq {seq}: its note does not state its tree size, root and writer"
    return None


def check_checkpoint_signature(
    record: dict[str, object], line: bytes, seq: int, pinned: PublicKey | None
) -> Signed | str:
    """The signature over the line without it, by the key it names (the pinned one, if given),
    and its note's: `Signed`, or the problem in words."""
    key = PublicKey.from_text(record.get("public_key"))
    signature = record.get("signature")
    if key is None or not isinstance(signature, str):
        return f"checkpoint seq {seq} says signed but has no key or signature"
    if record.get("key_fingerprint") != key.fingerprint:
        return f"checkpoint seq {seq}: key_fingerprint is not its public key's"
    if pinned is not None and key.raw != pinned.raw:
        return (
            f"checkpoint seq {seq} is signed by {key.fingerprint}, not by the given key {pinned.fingerprint}"
        )
    suffix = b',"signature":"' + signature.encode() + b'"}\n'
    if not line.endswith(suffix) or not key.verifies(signature, line[: -len(suffix)] + b"}"):
        return f"checkpoint seq {seq}: bad signature"
    return _note_problem(record, key, seq) or Signed(key)
