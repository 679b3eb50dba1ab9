"""NVIDIA Dynamo for tests/real: its frontend and its mocker engine, file discovery, no etcd or NATS."""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from tests.real.engines import (
    ManagedProcess,
    cache_root,
    free_port,
    http_json,
    launch,
    logs_dir,
    stop,
    wait_until_ok,
)

# Seen on 2 cores: the frontend answers /health at once, lists the mocker's model within ~20 s.
DYNAMO_START_TIMEOUT_S = 120.0


def dynamo_python() -> Path:
    """The interpreter of the Dynamo venv (scripts/setup-real-engines.sh dynamo)."""
    return cache_root() / "dynamo-venv" / "bin" / "python"


@dataclass(frozen=True)
class Dynamo:
    """A frontend and the one mocker worker it discovered."""

    frontend: ManagedProcess
    worker: ManagedProcess

    def stop(self) -> None:
        """Stop the worker, then the frontend."""
        stop(self.worker)
        stop(self.frontend)


def start_dynamo(model_dir: Path, served_name: str = "tiny") -> Dynamo:
    """Start `dynamo.frontend` and `dynamo.mocker` sharing a file discovery folder; wait for the model."""
    store = tempfile.mkdtemp(prefix="cw-dynamo-kv-", dir=logs_dir())
    env = {**os.environ, "DYN_FILE_KV": store, "HF_HUB_OFFLINE": "1", "DYN_LOG": "warn"}
    python = str(dynamo_python())
    port = free_port()
    frontend = launch(
        "dynamo-frontend",
        [python, "-m", "dynamo.frontend", "--http-port", str(port), "--discovery-backend", "file"],
        port,
        env,
    )
    mocker = [python, "-m", "dynamo.mocker", "--model-path", str(model_dir), "--model-name", served_name]
    worker = launch("dynamo-mocker", [*mocker, "--discovery-backend", "file"], port, env)
    dynamo = Dynamo(frontend, worker)
    try:
        wait_until_ok(frontend, ["/health", "/v1/models"], DYNAMO_START_TIMEOUT_S)
        _wait_for_model(frontend, served_name)
    except BaseException:
        dynamo.stop()
        raise
    return dynamo


def _wait_for_model(frontend: ManagedProcess, name: str) -> None:
    """Poll /v1/models until the worker's model is listed (a foreign process: polled, bounded)."""
    deadline = time.monotonic() + DYNAMO_START_TIMEOUT_S
    while time.monotonic() < deadline:
        _status, models = http_json("GET", frontend.base_url + "/v1/models")
        listed = models.get("data", []) if isinstance(models, dict) else []
        if any(isinstance(m, dict) and m.get("id") == name for m in listed):
            return
        time.sleep(0.2)
    raise TimeoutError(f"the frontend never listed {name}; log {frontend.log_path}:\n{frontend.log_tail()}")
