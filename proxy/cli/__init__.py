"""Command line: `cachewitness serve|reset|evidence|report|sim|demo`."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from proxy import __version__
from proxy.config import ConfigError, Settings
from proxy.config.load import load_settings
from proxy.config.options import OPTIONS

__all__ = ["build_parser", "main"]

# Options whose value is a bool get --name/--no-name; the rest take a value.
_BOOL_OPTIONS = frozenset(
    {
        "evidence_stdout",
        "admin_open",
        "admin_token_create",
        "drain",
        "inject_usage",
        "observe",
        "request_id_header",
        "overhead_header",
        "front",
    }
)
# Secrets are never taken as flags (they would show in `ps`): env or file only.
_NOT_FLAGS = frozenset({"admin_token", "engine_api_key", "upstream_api_key"})
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(Settings)}


def _default_text(name: str) -> str:
    """How `serve --help` shows an option's default (as it would be typed)."""
    value = _DEFAULTS.get(name)
    if isinstance(value, bool):
        text = "true" if value else "false"
    elif value is None or value == ():
        text = "unset"
    elif isinstance(value, tuple):
        text = ",".join(str(item) for item in value)
    elif isinstance(value, float) and value.is_integer():
        text = str(int(value))
    else:
        text = str(value)
    if name.endswith("_bytes") and isinstance(value, int) and value >= 1024 * 1024:
        text += f" ({value / (1024 * 1024):g} MiB)"
    # argparse %-formats help text.
    return text.replace("%", "%%")


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "serve",
        help="run the sidecar in front of an engine",
        description="Every option can also come from env CACHEWITNESS_<NAME> or the TOML config "
        "file; precedence is flag > env > file > default.",
    )
    parser.add_argument(
        "--config",
        help="TOML config file, keys as the long options with _ (default: unset; env CACHEWITNESS_CONFIG)",
    )
    for option in OPTIONS:
        if option.name in _NOT_FLAGS:
            continue
        flag = "--" + option.name.replace("_", "-")
        default = f"default: {_default_text(option.name)}"
        if option.name in _BOOL_OPTIONS:
            parser.add_argument(
                flag,
                dest=option.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=f"{option.help} ({default})",
            )
        else:
            parser.add_argument(
                flag,
                dest=option.name,
                default=None,
                metavar=option.name.upper(),
                help=f"{option.help} ({option.fix}; {default})",
            )
    parser.set_defaults(run=_run_serve)


def _run_serve(ns: argparse.Namespace) -> int:
    try:
        settings = load_settings(vars(ns), config_file=ns.config)
    except ConfigError as exc:
        print(f"cachewitness: {exc}", file=sys.stderr)
        return 2
    import logging
    import os

    from proxy.config.load import unknown_env
    from proxy.logs import log_event, setup_logging
    from proxy.serve import run

    setup_logging(settings.log_level)
    for warning in unknown_env(os.environ):
        log_event(
            logging.getLogger("cachewitness.config"), logging.WARNING, warning, event="config_unknown_env"
        )
    return run(settings)


def _add_sim(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from proxy.sim import add_sim_arguments

    parser = sub.add_parser("sim", help="run the engine simulator (vllm, sglang, llamacpp, mindnano, openai)")
    add_sim_arguments(parser)
    parser.set_defaults(run=_run_sim)


def _run_sim(ns: argparse.Namespace) -> int:
    # The simulator's own listen rules (a bare ":PORT" binds every address), not serve's.
    from proxy.sim import parse_listen, run_sim, sim_config_from_args

    try:
        host, port = parse_listen(ns.listen)
        config = sim_config_from_args(ns)
    except ValueError as exc:
        print(f"cachewitness sim: {exc}", file=sys.stderr)
        return 2
    return run_sim(config, host, port)


def _add_client_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from proxy.cli.evidence import add_evidence_arguments, run_evidence
    from proxy.cli.proof import add_proof_commands
    from proxy.cli.reset import add_reset_arguments, run_reset

    reset = sub.add_parser("reset", help="ask a sidecar for a prefix-cache reset (exit code = answer)")
    add_reset_arguments(reset)
    reset.set_defaults(run=run_reset)
    evidence = sub.add_parser("evidence", help="read a sidecar's evidence records; verify or bundle them")
    add_evidence_arguments(evidence)
    evidence.set_defaults(run=run_evidence)
    add_proof_commands(sub, evidence)
    from proxy.cli.report.command import add_report_arguments, run_report

    report = sub.add_parser("report", help="one session's evidence as a self-contained HTML page")
    add_report_arguments(report)
    report.set_defaults(run=run_report)


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = sub.add_parser(
        "demo", help="simulator + sidecar on free loopback ports, a scripted session, a report"
    )
    parser.set_defaults(run=_run_demo)


def _run_demo(ns: argparse.Namespace) -> int:
    from proxy.cli.demo import run_demo

    return run_demo()


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser."""
    parser = argparse.ArgumentParser(
        prog="cachewitness",
        description="A sidecar reverse proxy for LLM inference servers: uniform prefix-cache reset, "
        "cached-token evidence, Prometheus metrics.",
    )
    parser.add_argument("--version", action="version", version=f"cachewitness {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_client_commands(sub)
    _add_sim(sub)
    _add_demo(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `cachewitness` console script and `python -m proxy`."""
    ns = build_parser().parse_args(argv)
    try:
        return int(ns.run(ns))
    except KeyboardInterrupt:
        return 130
