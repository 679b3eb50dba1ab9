"""TLS for tests: a private CA and a pod certificate made with the `openssl` CLI, and a TLS front.

The sidecar listens in plain HTTP; a pod reached over https has TLS ended in front of it (a
mesh or a TLS sidecar such as ghostunnel). `tls_front` is that front: it takes TLS on its own
port and pipes the bytes to the sidecar's.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

_OPENSSL_S = 30.0  # one openssl command, at most


@dataclass(frozen=True)
class Certificates:
    """A CA, and one server certificate it signed (with its key)."""

    ca: Path
    cert: Path
    key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=_OPENSSL_S)


def make_certificates(folder: Path, names: list[str], addresses: list[str]) -> Certificates:
    """A fresh CA in `folder` and a server certificate for DNS `names` and IP `addresses`."""
    folder.mkdir(parents=True, exist_ok=True)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl(
        "req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=cachewitness test CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=folder,
    )  # fmt: skip
    _openssl("req", *ec, "-keyout", "pod.key", "-out", "pod.csr", "-subj", "/CN=cachewitness pod", cwd=folder)
    alt = ",".join([f"DNS:{name}" for name in names] + [f"IP:{address}" for address in addresses])
    (folder / "pod.ext").write_text(
        f"subjectAltName={alt}\n"
        "basicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature\n"
        "extendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\n"
        "authorityKeyIdentifier=keyid\n"
    )
    _openssl(
        "x509", "-req", "-in", "pod.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "pod.pem", "-days", "2", "-extfile", "pod.ext",
        cwd=folder,
    )  # fmt: skip
    return Certificates(folder / "ca.pem", folder / "pod.pem", folder / "pod.key")


@dataclass
class TlsFront:
    """A TLS front's counters: connections whose handshake completed and bytes piped to the backend."""

    handshakes: int = 0
    bytes_in: int = 0


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, front: TlsFront | None) -> None:
    """Copy until EOF (or a reset), then close the far side."""
    try:
        while chunk := await reader.read(65536):
            if front is not None:
                front.bytes_in += len(chunk)
            writer.write(chunk)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError, ssl.SSLError):
            await writer.wait_closed()


@contextlib.asynccontextmanager
async def tls_front(certs: Certificates, host: str, port: int, backend: str) -> AsyncIterator[TlsFront]:
    """TLS on host:port (the pod certificate), each connection piped to `backend` (`HOST:PORT`)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(certs.cert, certs.key)
    backend_host, _, backend_port = backend.rpartition(":")
    front = TlsFront()
    tasks: set[asyncio.Task[None]] = set()

    async def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        front.handshakes += 1  # the server's callback runs once the handshake is done
        try:
            up_reader, up_writer = await asyncio.open_connection(backend_host, int(backend_port))
        except OSError:
            writer.close()
            return
        task = asyncio.current_task()
        assert task is not None
        tasks.add(task)
        try:
            await asyncio.gather(_pipe(reader, up_writer, front), _pipe(up_reader, writer, None))
        finally:
            tasks.discard(task)

    server = await asyncio.start_server(accepted, host, port, ssl=context)
    try:
        yield front
    finally:
        server.close()
        for task in list(tasks):
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await server.wait_closed()
