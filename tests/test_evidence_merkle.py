"""RFC 6962 Merkle trees over evidence lines, checked against pymerkle (an implementation not ours).

pymerkle 7 (pinned in pyproject.toml) hashes leaves and nodes with RFC 6962's 0x00/0x01 prefixes
and shapes its tree the same way: its roots must equal ours, its verifier must accept our audit
paths, and ours must refuse a path, a size or a root changed by one bit. Its consistency proofs
have another layout (a path with a parenthesisation rule), so for those it checks that the two
roots it computes itself are the ones our proof links, and that it can prove them consistent.
"""

from __future__ import annotations

import base64
import hashlib
import time
from pathlib import Path

import orjson
import pytest
from pymerkle import InmemoryTree, verify_consistency, verify_inclusion  # type: ignore[import-untyped]  # no type hints
from pymerkle.proof import InclusionProof  # type: ignore[import-untyped]

from proxy.evidence import merkle
from proxy.evidence.keys import SigningKey
from proxy.evidence.writer import EvidenceWriter

SIZES = [*range(1, 34), 63, 64, 65, 100]


def their_tree(lines: list[bytes]) -> InmemoryTree:
    tree = InmemoryTree(algorithm="sha256")
    for line in lines:
        tree.append_entry(line)
    return tree


@pytest.mark.parametrize("n", SIZES)
def test_roots_and_audit_paths_match_pymerkle(n: int) -> None:
    lines = [b'{"n":%d}\n' % i for i in range(n)]
    theirs = their_tree(lines)
    leaves = [merkle.leaf_hash(line) for line in lines]
    compact = merkle.CompactTree()
    for size, leaf in enumerate(leaves, 1):
        compact.append(leaf)
        assert compact.root() == theirs.get_root(size)
    levels = merkle.Levels(leaves)
    root = compact.root()
    for index in range(n):
        path = levels.inclusion(index, n)
        rule = theirs.prove_inclusion(index + 1, n).rule
        verify_inclusion(
            leaves[index], root, InclusionProof("sha256", True, n, index + 1, rule, [leaves[index], *path])
        )
        assert merkle.verify_inclusion(leaves[index], index, n, path, root)
        assert len(path) <= max(1, (n - 1).bit_length())
        assert not merkle.verify_inclusion(leaves[index], index, n, path, flip(root))
        assert not merkle.verify_inclusion(flip(leaves[index]), index, n, path, root)
        if path:
            assert not merkle.verify_inclusion(leaves[index], index, n, [flip(path[0]), *path[1:]], root)


@pytest.mark.parametrize("n", SIZES)
def test_consistency_proofs_link_the_roots_pymerkle_computes(n: int) -> None:
    lines = [b'{"n":%d}\n' % i for i in range(n)]
    theirs = their_tree(lines)
    levels = merkle.Levels([merkle.leaf_hash(line) for line in lines])
    for m in range(1, n + 1):
        old, new = theirs.get_root(m), theirs.get_root(n)
        verify_consistency(old, new, theirs.prove_consistency(m, n))
        proof = levels.consistency(m, n)
        assert merkle.verify_consistency(m, n, old, new, proof)
        if m < n:
            assert not merkle.verify_consistency(m, n, flip(old), new, proof)
            assert not merkle.verify_consistency(m, n, old, flip(new), proof)
            assert not merkle.verify_consistency(m, n, old, new, [flip(proof[0]), *proof[1:]])


def flip(digest: bytes) -> bytes:
    return bytes([digest[0] ^ 1]) + digest[1:]


def note_signature_holds(note: str, public: bytes) -> bool:
    """A C2SP signed note's Ed25519 signature line, checked from the spec with cryptography alone."""
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    text, _, signatures = note.partition("\n\n")
    [line] = signatures.strip("\n").split("\n")
    dash, name, blob = line.split(" ")
    raw = base64.b64decode(blob)
    assert dash == "\u2014" and raw[:4] == hashlib.sha256(name.encode() + b"\n\x01" + public).digest()[:4]
    try:
        Ed25519PublicKey.from_public_bytes(public).verify(raw[4:], (text + "\n").encode())
    except InvalidSignature:
        return False
    return True


async def test_each_checkpoint_states_the_tree_of_its_life_as_a_signed_note(tmp_path: Path) -> None:
    """Two lives over one file, rotated: each checkpoint's tree_size, root and note are pymerkle's
    tree of that life's lines before it, signed by the evidence key in C2SP's format."""
    key = SigningKey.generate()
    for _life in range(2):
        writer = EvidenceWriter(
            tmp_path / "ev.jsonl", max_bytes=3000, keep=20, checkpoint_interval_s=3600.0, signer=key
        )
        await writer.start()
        for n in range(12):
            writer.write(
                {
                    "schema_version": 1,
                    "event_type": "infer.cache_observation",
                    "at_ns": time.time_ns(),
                    "n": n,
                }
            )
            if n % 4 == 3:
                await writer.checkpoint_now()
        await writer.close()
    files = [*sorted(tmp_path.glob("ev.jsonl.*"), key=lambda p: -int(p.suffix[1:])), tmp_path / "ev.jsonl"]
    assert len(files) > 3
    lines = [line for f in files for line in f.read_bytes().splitlines(keepends=True)]
    lives: list[list[bytes]] = []
    checked = 0
    for line in lines:
        record = orjson.loads(line)
        if record["event_type"] == "infer.evidence_opened":
            lives.append([])
        life = lives[-1]
        if record["event_type"] == "infer.evidence_checkpoint":
            root = their_tree(life).get_root(len(life)) if life else hashlib.sha256(b"").digest()
            assert (record["tree_size"], record["root"]) == (len(life), base64.b64encode(root).decode())
            origin = f"cachewitness/{record['note'].split('/')[1]}/ev.jsonl/{record['writer_id']}"
            assert record["note"].startswith(f"{origin}\n{len(life)}\n{record['root']}\n\n\u2014 {origin} ")
            assert note_signature_holds(record["note"], key.public.raw)
            assert not note_signature_holds(
                record["note"].replace(f"\n{len(life)}\n", f"\n{len(life) + 1}\n"), key.public.raw
            )
            checked += 1
        life.append(line)
    assert len(lives) == 2 and checked == 8


async def test_verify_names_a_checkpoint_whose_root_is_not_its_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The final checkpoint re-signed (line and note) over another root: every signature holds, the
    tree does not."""
    from proxy.cli import main
    from proxy.evidence.note import signed_note

    key = SigningKey.generate()
    writer = EvidenceWriter(tmp_path / "ev.jsonl", checkpoint_interval_s=3600.0, signer=key)
    await writer.start()
    for n in range(5):
        writer.write(
            {"schema_version": 1, "event_type": "infer.cache_observation", "at_ns": time.time_ns(), "n": n}
        )
    await writer.close()
    lines = (tmp_path / "ev.jsonl").read_bytes().splitlines(keepends=True)
    record = orjson.loads(lines[-1])
    del record["signature"]
    wrong = merkle.leaf_hash(b"another line\n")
    record["root"] = base64.b64encode(wrong).decode()
    record["note"] = signed_note(record["note"].split("\n")[0], record["tree_size"], wrong, key)
    body = orjson.dumps(record)
    lines[-1] = body[:-1] + b',"signature":"%s"}\n' % key.sign(body).encode()
    (tmp_path / "ev.jsonl").write_bytes(b"".join(lines))
    assert main(["evidence", "verify", str(tmp_path / "ev.jsonl")]) == 1
    out = capsys.readouterr().out
    assert (
        f"ev.jsonl:{len(lines)}: checkpoint seq {record['seq']} states tree size {record['tree_size']} root {record['root']}, but this life's lines before it make {len(lines) - 1} "
        in out
    )
