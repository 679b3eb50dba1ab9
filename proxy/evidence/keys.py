"""The Ed25519 key that signs the evidence checkpoints: made, loaded, fingerprinted (docs/evidence.md).

A checkpoint's signature is over `SIGNED_PREFIX` + its line without the signature field, so a
signature made for one purpose is never valid for another. A key's fingerprint is
`sha256:<hex>` of its 32 raw public bytes: what `/cache/state` shows and every checkpoint carries.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

__all__ = [
    "SIGNED_PREFIX",
    "KeyFileError",
    "PublicKey",
    "SigningKey",
    "generate_key_files",
    "load_public_key",
    "load_signing_key",
]

SIGNED_PREFIX = b"cachewitness evidence checkpoint v1\n"


class KeyFileError(Exception):
    """A key file that cannot be used: the message names the file and says what it must hold."""


@dataclass(frozen=True)
class PublicKey:
    """An Ed25519 public key (its 32 raw bytes)."""

    raw: bytes

    @property
    def fingerprint(self) -> str:
        """`sha256:<hex of the SHA-256 of the raw key>`."""
        return "sha256:" + hashlib.sha256(self.raw).hexdigest()

    @property
    def text(self) -> str:
        """The raw key in base64, as checkpoints carry it."""
        return base64.b64encode(self.raw).decode()

    def pem(self) -> bytes:
        """The key as a PEM SubjectPublicKeyInfo (what `cachewitness keygen` writes)."""
        key = Ed25519PublicKey.from_public_bytes(self.raw)
        return key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)

    def verifies(self, signature_text: str, message: bytes) -> bool:
        """Whether `signature_text` (base64) is this key's signature of `message`."""
        try:
            signature = base64.b64decode(signature_text, validate=True)
            Ed25519PublicKey.from_public_bytes(self.raw).verify(signature, SIGNED_PREFIX + message)
        except (InvalidSignature, binascii.Error, ValueError):
            return False
        return True

    def verifies_raw(self, signature: bytes, message: bytes) -> bool:
        """Whether `signature` is this key's Ed25519 signature of `message` itself (no prefix: a
        signed note's or a DSSE envelope's, whose formats fix what is signed)."""
        try:
            Ed25519PublicKey.from_public_bytes(self.raw).verify(signature, message)
        except (InvalidSignature, ValueError):
            return False
        return True

    @classmethod
    def from_text(cls, text: object) -> PublicKey | None:
        """The key a checkpoint carries (base64 of 32 bytes), None when it is not one."""
        if not isinstance(text, str):
            return None
        try:
            raw = base64.b64decode(text, validate=True)
        except (binascii.Error, ValueError):
            return None
        return cls(raw) if len(raw) == 32 else None


class SigningKey:
    """An Ed25519 private key and its public half."""

    def __init__(self, private: Ed25519PrivateKey) -> None:
        """Wrap a loaded key."""
        self._private = private
        self.public = PublicKey(
            private.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        )

    def sign(self, message: bytes) -> str:
        """The base64 signature of `SIGNED_PREFIX` + `message`."""
        return base64.b64encode(self._private.sign(SIGNED_PREFIX + message)).decode()

    def sign_raw(self, message: bytes) -> bytes:
        """The Ed25519 signature of `message` itself: for formats that fix their own signed bytes
        (a signed note's text, DSSE's PAE), never for a checkpoint line."""
        return self._private.sign(message)

    def pem(self) -> bytes:
        """The private key as unencrypted PKCS#8 PEM."""
        return self._private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    @classmethod
    def generate(cls) -> SigningKey:
        """A new random key."""
        return cls(Ed25519PrivateKey.generate())


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise KeyFileError(f"{path} cannot be read ({exc.strerror or exc}); point it at {what}") from None


def load_signing_key(path: str | Path) -> SigningKey:
    """The Ed25519 private key in a PEM file (as `cachewitness keygen` writes it)."""
    path = Path(path)
    what = "an Ed25519 private key in PEM (cachewitness keygen writes one)"
    data = _read(path, what)
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise KeyFileError(f"{path} is not {what} (an unencrypted PEM private key)") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise KeyFileError(f"{path} holds a {type(key).__name__}, not {what}")
    return SigningKey(key)


def load_public_key(path: str | Path) -> PublicKey:
    """The Ed25519 public key in a PEM file (a private key's file gives its public half)."""
    path = Path(path)
    what = "an Ed25519 public key in PEM (cachewitness keygen writes KEY.pub)"
    data = _read(path, what)
    if b"PRIVATE KEY" in data:
        return load_signing_key(path).public
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm):
        raise KeyFileError(f"{path} is not {what}") from None
    if not isinstance(key, Ed25519PublicKey):
        raise KeyFileError(f"{path} holds a {type(key).__name__}, not {what}")
    return PublicKey(key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw))


def generate_key_files(private_path: Path, public_path: Path) -> PublicKey:
    """Write a new key pair: the private key readable by its owner only, neither file overwritten."""
    key = SigningKey.generate()
    for path in (private_path, public_path):
        if path.exists():
            raise KeyFileError(
                f"{path} exists; keygen never overwrites a key (remove it or pick another name)"
            )
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(key.pem())
    public_path.write_bytes(key.public.pem())
    return key.public
