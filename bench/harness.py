"""Process plumbing for the benchmark: tools, ports, pinning, CPU and memory readings from /proc."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "RT_LOADGEN_PRIORITY",
    "RT_PROXY_PRIORITY",
    "Cores",
    "Service",
    "cpu_ns",
    "cpu_seconds",
    "ensure_tools",
    "free_port",
    "machine_busy_seconds",
    "realtime",
    "rss_mb",
    "set_fifo",
    "start_service",
    "wait_http",
]

CLK_TCK = os.sysconf("SC_CLK_TCK")


def ensure_tools() -> tuple[str, str]:
    """Paths of nginx and wrk, installed from Debian's packages when absent (needs root)."""

    def find() -> tuple[str | None, str | None]:
        nginx = shutil.which("nginx") or next(
            (p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None
        )
        return nginx, shutil.which("wrk")

    nginx, wrk = find()
    if nginx and wrk:
        return nginx, wrk
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        sys.exit(
            "bench: nginx and wrk are needed: install them (Debian: apt-get install -y nginx wrk) and rerun"
        )
    print("bench: installing nginx and wrk (apt-get install -y nginx wrk) ...", flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # policy-rc.d may or may not stop the package from starting the system nginx; we never use it.
    if (
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "nginx", "wrk"], env=env, stdout=subprocess.DEVNULL
        ).returncode
        != 0
    ):
        subprocess.run(["apt-get", "update", "-q"], env=env, stdout=subprocess.DEVNULL, check=False)
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "nginx", "wrk"], env=env, stdout=subprocess.DEVNULL, check=True
        )
    nginx, wrk = find()
    if not (nginx and wrk):
        sys.exit("bench: nginx/wrk still missing after apt-get install")
    return nginx, wrk


# SCHED_FIFO priorities under --realtime: the load generator above the simulator it shares
# a core with, so that its clocks are read when the answers come; the proxy, alone on its
# core, above both.
RT_PRIORITY = 10
RT_LOADGEN_PRIORITY = 20
RT_PROXY_PRIORITY = 30


def realtime(priority: int = RT_PRIORITY) -> None:
    """This process and every process and thread it starts from now on under SCHED_FIFO (root).

    On a machine shared with other work each measured process then runs as soon as it is
    woken, as it would on a core of its own; a niceness would not do it, as the kernel's
    autogroups weigh each session as a whole. None of the bench's processes spins, and the
    kernel's RT throttle (sched_rt_runtime_us) keeps a share of every core for the others.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(priority))
    except PermissionError:
        sys.exit("bench: --realtime needs root (SCHED_FIFO)")


def set_fifo(pids: list[int], priority: int) -> None:
    """Every thread of these processes under SCHED_FIFO at `priority` (threads they start later inherit it)."""
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.sched_setscheduler(int(tid), os.SCHED_FIFO, os.sched_param(priority))


def free_port() -> int:
    """A free loopback port."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class Cores:
    """Where each role runs: the proxy alone on one core, upstream and load generator on the other."""

    proxy: str | None
    rest: str | None

    @classmethod
    def choose(cls, pin: bool) -> Cores:
        """The two highest-numbered allowed cores (proxy last), or no pinning."""
        allowed = sorted(os.sched_getaffinity(0))
        if not pin or len(allowed) < 2 or not shutil.which("taskset"):
            return cls(None, None)
        return cls(proxy=str(allowed[-1]), rest=str(allowed[-2]))

    @staticmethod
    def prefix(core: str | None) -> list[str]:
        """`taskset -c CORE` or nothing."""
        return ["taskset", "-c", core] if core is not None else []


@dataclass
class Service:
    """A long-running process we started (simulator, sidecar, nginx)."""

    name: str
    proc: subprocess.Popen[bytes]
    url: str

    def pids(self) -> list[int]:
        """The process and its direct children (nginx workers)."""
        pids = [self.proc.pid]
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
            pids += [int(c) for c in children]
        except OSError:
            pass
        return pids

    def stop(self) -> None:
        """Terminate and reap, killing after a grace period."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_service(
    name: str, argv: list[str], url: str, log_dir: Path, probe: str, cwd: Path | None = None
) -> Service:
    """Start a service (in `cwd`) with its output in log_dir/name.log, and wait until `probe` answers."""
    log = (log_dir / f"{name}.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd)
    service = Service(name, proc, url)
    if not wait_http(url + probe, proc, 30.0):
        service.stop()
        sys.exit(f"bench: {name} did not come up; see {log_dir / (name + '.log')}")
    return service


def start_simulator(core: str | None, log_dir: Path, *, decode_rate: float = 0, name: str = "sim") -> Service:
    """The vLLM-dialect simulator on a free loopback port, prefill instant, pinned to `core` (None: not pinned)."""
    port = free_port()
    return start_service(
        name,
        [
            *Cores.prefix(core),
            sys.executable,
            *("-m", "proxy", "sim", "--dialect", "vllm", "--listen", f"127.0.0.1:{port}"),
            *("--decode-rate", f"{decode_rate:g}", "--prefill-rate", "0"),
        ],
        f"http://127.0.0.1:{port}",
        log_dir,
        "/health",
    )


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Poll `url` until it answers 200 (False if the process died or time ran out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return True
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.1)
    return False


def cpu_ns(pids: list[int]) -> int:
    """CPU nanoseconds the live threads of these processes have run (/proc/PID/task/TID/schedstat).

    Precise to the nanosecond, where /proc/PID/stat counts clock ticks (10 ms); a thread that
    exits inside the window loses its time, which `cpu_seconds` cross-checks.
    """
    total = 0
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                total += int(Path(f"/proc/{pid}/task/{tid}/schedstat").read_text().split()[0])
            except (OSError, IndexError, ValueError):
                continue
    return total


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (all their threads)."""
    return sum(cpu_split(pids))


def cpu_split(pids: list[int]) -> tuple[float, float]:
    """(user, system) CPU seconds of these processes (all their threads)."""
    user = system = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        user += int(fields[11])  # utime, stime (fields 14 and 15 of stat)
        system += int(fields[12])
    return user / CLK_TCK, system / CLK_TCK


def read_calls(pids: list[int]) -> int:
    """read()-type system calls (read, readv, ...) these processes have made: /proc/PID/io `syscr`.

    recv() and recvmsg() are not counted there: nginx's reads do not show.
    """
    total = 0
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/io").read_text().splitlines()
        except OSError:
            continue
        total += sum(int(line.split()[1]) for line in lines if line.startswith("syscr:"))
    return total


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent busy so far (all cores, all processes)."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)
    return (sum(values[:8]) - idle) / CLK_TCK


def rss_mb(pids: list[int]) -> float:
    """Resident memory of these processes together, in MB (10^6 bytes)."""
    total_kb = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total_kb += int(line.split()[1])
        except OSError:
            continue
    return total_kb * 1024 / 1e6
