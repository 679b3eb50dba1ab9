"""`cachewitness keygen` and `cachewitness evidence verify PATH…`; `bundle` and `attest` are registered
here, and live in proxy/cli/bundle.py and proxy/cli/attest.py (docs/cli.md).

verify exits 0 when every chain is whole and unedited and every proof holds, 1 when one is not (or
a bundle's summary disagrees with its records), 2 on bad input (a path that is not there, not
readable, a hostile bundle, or no evidence at all).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

from proxy.cli.attest import add_attest_command
from proxy.cli.bundle import add_bundle_command
from proxy.cli.http import EXIT_BAD_INPUT
from proxy.cli.proof_fetch import EXIT_BROKEN, print_report
from proxy.evidence.bundle import BundleError, read_bundle, verify_bundle
from proxy.evidence.keys import KeyFileError, PublicKey, generate_key_files, load_public_key
from proxy.evidence.proof_check import ProofReport
from proxy.evidence.tar_read import printable
from proxy.evidence.verify import ChainCheck, ChainReport

__all__ = ["EXIT_BROKEN", "EXIT_WHOLE", "add_proof_commands"]

EXIT_WHOLE = 0
_ROTATION = re.compile(r"(?P<base>.+)\.(?P<index>[0-9]+)")
_READ_BYTES = 256 * 1024


class _BadInput(Exception):
    """A path verify cannot read as evidence: exit 2."""


def add_proof_commands(
    sub: argparse._SubParsersAction[argparse.ArgumentParser], evidence: argparse.ArgumentParser
) -> None:
    """`keygen` beside the other commands; `verify` and `bundle` under `evidence`."""
    keygen = sub.add_parser(
        "keygen",
        help="write an Ed25519 key pair that signs the evidence checkpoints",
        description="Writes KEY (the private key, mode 0600: give it to serve as "
        "--evidence-signing-key-file, or to the chart as a Secret) and KEY.pub (the public key: "
        "publish it, and give it to evidence verify --public-key). Never overwrites a file.",
    )
    keygen.add_argument(
        "-o", "--out", default="cachewitness-signing-key.pem", metavar="KEY", help="default %(default)s"
    )
    keygen.set_defaults(run=run_keygen)
    commands = evidence.add_subparsers(dest="evidence_command", metavar="{verify,bundle,attest}")
    verify = commands.add_parser(
        "verify",
        help="check evidence files or a run bundle: every link, seq, count and signature",
        description="Exit 0: every chain whole and unedited; 1: one is not; 2: bad input.",
    )
    verify.add_argument(
        "paths",
        nargs="+",
        metavar="PATH",
        help="evidence files (a file's rotations .1 .2 … come with it), folders of them, run bundles (.tar.gz)",
    )
    verify.add_argument(
        "--public-key",
        metavar="F",
        help="the key (PEM) every checkpoint must be signed by; without it each checkpoint is checked "
        "against the key it names, and the keys are printed",
    )
    verify.set_defaults(run=run_verify)
    add_bundle_command(commands)
    add_attest_command(commands)


def run_keygen(ns: argparse.Namespace) -> int:
    """Write KEY and KEY.pub; print the fingerprint."""
    private = Path(ns.out)
    public = private.with_name(private.name + ".pub")
    try:
        key = generate_key_files(private, public)
    except (KeyFileError, OSError) as exc:
        print(f"cachewitness keygen: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(f"wrote {private} (private, keep it secret) and {public} (public)")
    print(f"fingerprint {key.fingerprint}")
    return 0


def _rotation_of(path: Path) -> tuple[Path, int]:
    """The file a path rotates from, and its place: `ev.jsonl.3` is (ev.jsonl, 3), `ev.jsonl` (ev.jsonl, 0)."""
    match = _ROTATION.fullmatch(path.name)
    if match is None:
        return path, 0
    return path.with_name(match["base"]), int(match["index"])


def _chains(paths: list[Path]) -> tuple[dict[Path, dict[int, Path]], list[Path]]:
    """The files given, grouped by the file they rotate from (each a chain), and the bundles."""
    chains: dict[Path, dict[int, Path]] = {}
    bundles: list[Path] = []

    def add(file: Path) -> None:
        base, index = _rotation_of(file)
        chains.setdefault(base, {})[index] = file

    for path in paths:
        if path.is_dir():
            found = [f for f in sorted(path.rglob("*")) if f.is_file() and ".jsonl" in f.name]
            if not found:
                raise _BadInput(f"{path}: no evidence files (*.jsonl*) in it")
            for file in found:
                add(file)
        elif path.is_file() and path.name.endswith((".tar.gz", ".tgz", ".tar")):
            bundles.append(path)
        elif path.is_file():
            add(path)
            if _rotation_of(path)[1] == 0:  # its rotations come with it
                for file in path.parent.glob(f"{path.name}.*"):
                    if _rotation_of(file)[0] == path:
                        add(file)
        else:
            raise _BadInput(f"{path}: no such file or folder")
    return chains, bundles


def _lines(path: Path) -> Iterator[bytes]:
    """A file's lines, exactly (a last line without its newline too), read in chunks."""
    try:
        with open(path, "rb") as handle:
            carry = b""
            while chunk := handle.read(_READ_BYTES):
                data = carry + chunk
                start = 0
                while (newline := data.find(b"\n", start)) != -1:
                    yield data[start : newline + 1]
                    start = newline + 1
                carry = data[start:]
            if carry:
                yield carry
    except OSError as exc:
        raise _BadInput(f"{path} cannot be read: {exc.strerror or exc}") from None


def _check_chain(name: Path, files: Mapping[int, Path], pinned: PublicKey | None) -> ChainReport:
    """One chain: its files oldest first (`.N` … `.1`, then the file itself)."""
    check = ChainCheck(str(name), pinned=pinned)
    for index in sorted(files, reverse=True):
        for number, line in enumerate(_lines(files[index]), 1):
            check.feed(line, str(files[index]), number)
    return check.finish()


def run_verify(ns: argparse.Namespace) -> int:
    """Check each chain and bundle given; one line per chain, its problems below it."""
    try:
        pinned = load_public_key(ns.public_key) if ns.public_key else None
        chains, bundles = _chains([Path(p) for p in ns.paths])
        reports: list[ChainReport | ProofReport] = [
            _check_chain(name, files, pinned) for name, files in sorted(chains.items())
        ]
        problems: list[str] = []
        for path in bundles:
            try:
                bundle_reports, bundle_problems = verify_bundle(read_bundle(path), pinned)
            except BundleError as exc:
                raise BundleError(str(exc) if str(exc).startswith(str(path)) else f"{path}: {exc}") from None
            reports += bundle_reports
            problems += [f"{path}: {problem}" for problem in bundle_problems]
    except (_BadInput, KeyFileError, BundleError) as exc:
        print(f"cachewitness evidence verify: {printable(str(exc))}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if not any(report.records for report in reports):
        print("cachewitness evidence verify: no evidence records in what was given", file=sys.stderr)
        return EXIT_BAD_INPUT
    for report in reports:
        print_report(report)
    for problem in problems:
        print(f"broken: {printable(problem)}")
    if pinned is None and any(report.signed for report in reports):
        print(
            "note: each signature was checked against the key its checkpoint names; pass --public-key to pin it"
        )
    return EXIT_BROKEN if problems or not all(report.whole for report in reports) else EXIT_WHOLE
