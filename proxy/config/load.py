"""Settings loaded from flag > env `CACHEWITNESS_*` > TOML file > default, and checked across fields.

The option table (every key and its parser) is options.py beside it; this module merges the
layers, reads the secrets from their files, and refuses combinations that cannot work.
"""

from __future__ import annotations

import dataclasses
import difflib
import hmac
import os
import secrets
import ssl
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from yarl import URL

from proxy.config.options import OPTIONS, Option
from proxy.config.parsers import url_option
from proxy.config.settings import ConfigError, NativeResetAuth, Settings
from proxy.redact import redact_url

__all__ = ["load_settings", "unknown_env"]

ENV_PREFIX = "CACHEWITNESS_"
# CACHEWITNESS_* names that are no serve option: the config file, the client commands' URL, and
# the project's own build and test switches (scripts/, tests/).
_OTHER_ENV = frozenset(
    {
        "CONFIG",
        "URL",
        "REAL_CACHE",
        "REAL_REQUIRED",
        "HYPOTHESIS_DB",
        "TOOLS_DIR",
        "CHROMIUM",
        "LLAMA_FROM_SOURCE",
        "DISK_FULL_LOAD_S",
    }
)


def _check_upstream_credentials(upstream: str) -> None:
    """Refuse `user:password@` in the upstream URL (the value shown redacted).

    aiohttp turns URL credentials into an Authorization header and refuses any request
    that carries its own, which every OpenAI SDK request does: each one would fail.
    """
    url = URL(upstream)
    if url.user is None and url.password is None:
        return
    raise ConfigError(
        f"config: upstream = {redact_url(upstream)!r} carries credentials (user:password@), which "
        "would break every request that brings its own Authorization; give the URL without them "
        "and put the engine's key in upstream_api_key (env CACHEWITNESS_UPSTREAM_API_KEY, or upstream_api_key_file)"
    )


_BY_NAME = {option.name: option for option in OPTIONS}


def _did_you_mean(word: str, known: list[str], prefix: str = "") -> str:
    """`; did you mean 'retry_seconds'?` for a close known word, else a pointer to the list."""
    close = difflib.get_close_matches(word, known, n=1, cutoff=0.6)
    if close:
        return f"; did you mean {prefix + close[0]!r}?"
    return "; every key: cachewitness serve --help, or docs/cli.md"


def unknown_env(env: Mapping[str, str]) -> list[str]:
    """One warning per CACHEWITNESS_* variable that names no option (a typo is otherwise silent)."""
    known = [name.upper() for name in _BY_NAME]
    warnings = []
    for variable in sorted(env):
        suffix = variable[len(ENV_PREFIX) :]
        if not variable.startswith(ENV_PREFIX) or suffix in known or suffix in _OTHER_ENV:
            continue
        hint = _did_you_mean(suffix, known, ENV_PREFIX)
        warnings.append(f"{variable} is not a cachewitness setting and is ignored{hint}")
    return warnings


def _coerce(option: Option, raw: Any, origin: str) -> Any:
    """Parse one raw value (text from flags/env, or a TOML value) or raise ConfigError."""
    text = ",".join(str(item) for item in raw) if isinstance(raw, list) else raw
    if isinstance(text, bool):
        text = "true" if text else "false"
    try:
        return option.parse(str(text))
    except ValueError:
        shown = redact_url(str(raw)) if option.parse is url_option else raw  # no password in the message
        raise ConfigError(
            f"config: {option.name} = {shown!r} (from {origin}) is not valid: expected {option.fix}"
        ) from None


def _read_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as handle:
            data = tomllib.load(handle)
    except OSError as exc:
        raise ConfigError(f"config: cannot read config file {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config: config file {path} is not valid TOML: {exc}") from None
    table = data.get("cachewitness", data)
    if not isinstance(table, dict):
        raise ConfigError(f"config: [cachewitness] in {path} must be a table")
    return {key.replace("-", "_"): value for key, value in table.items()}


_ENV_ORIGIN = "environment"


def load_settings(
    flags: Mapping[str, Any], env: Mapping[str, str] | None = None, config_file: str | None = None
) -> Settings:
    """Merge flags (None = not given) over env over the TOML file over defaults."""
    env = os.environ if env is None else env
    config_file = config_file or env.get("CACHEWITNESS_CONFIG")
    layers: list[tuple[str, Mapping[str, Any]]] = []
    if config_file:
        file_values = _read_toml(config_file)
        unknown = sorted(set(file_values) - set(_BY_NAME))
        if unknown:
            raise ConfigError(
                f"config: unknown key {unknown[0]!r} in {config_file}{_did_you_mean(unknown[0], list(_BY_NAME))}"
            )
        layers.append((f"file {config_file}", file_values))
    env_values = {
        name: env[f"{ENV_PREFIX}{name.upper()}"] for name in _BY_NAME if f"{ENV_PREFIX}{name.upper()}" in env
    }
    layers.append((_ENV_ORIGIN, env_values))
    layers.append(("command line", {k: v for k, v in flags.items() if v is not None and k in _BY_NAME}))
    values: dict[str, Any] = {}
    for origin, layer in layers:
        for name, raw in layer.items():
            # A bad value from the environment names its variable: that is what the user set.
            where = f"env {ENV_PREFIX}{name.upper()}" if origin == _ENV_ORIGIN else origin
            values[name] = _coerce(_BY_NAME[name], raw, where)
    settings = Settings(**values)
    return _finish(settings)


def _create_token_file(path: str) -> None:
    """A new random admin token in `path`, readable by its owner only; an existing file is kept."""
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    except OSError as exc:
        raise ConfigError(
            f"config: admin_token_create cannot write {path} ({exc.strerror}); "
            "point admin_token_file at a writable path"
        ) from None
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        handle.write(secrets.token_urlsafe(32) + "\n")


def _secret(value: str | None, path: str | None, key: str, what: str) -> str | None:
    """A secret given inline, or read (stripped) from the file named by `key` when one is set."""
    if not path:
        return value
    try:
        return Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(
            f"config: {key} {path} cannot be read ({exc.strerror}); point it at a file holding {what}"
        ) from None


def _check_peers_tls(settings: Settings) -> None:
    """peers_ca_file only with https, and only a file that holds CA certificates."""
    if settings.peers_ca_file is None:
        return
    if settings.peers_scheme != "https":
        raise ConfigError(
            "config: peers_ca_file is set but peers_scheme is http, so cluster calls would not use it; "
            "set peers_scheme = https"
        )
    try:
        ssl.create_default_context(cafile=settings.peers_ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(
            f"config: peers_ca_file {settings.peers_ca_file} cannot be loaded ({exc}); "
            "point it at a PEM file of the CA that signed the peers' certificates"
        ) from None


def _is_rotation(name: str, of: str) -> bool:
    """Whether `name` is `of` or one of its rotations (`of.1`, `of.2`, …)."""
    return name == of or (name.startswith(of + ".") and name[len(of) + 1 :].isdigit())


def _check_resets_path(settings: Settings) -> None:
    """The reset records' file is not the evidence file, nor any file either rotates into."""
    evidence, resets = Path(settings.evidence).absolute(), Path(settings.resets_evidence).absolute()
    if evidence.parent == resets.parent and (
        _is_rotation(evidence.name, resets.name) or _is_rotation(resets.name, evidence.name)
    ):
        raise ConfigError(
            f"config: evidence_resets_path {settings.resets_evidence} is the evidence file "
            f"{settings.evidence} or one of its rotations; give the reset records a file of their own"
        )


def _finish(settings: Settings) -> Settings:
    """Cross-field checks, and the admin token and engine key read from their files."""
    _check_upstream_credentials(settings.upstream)
    if settings.retry_seconds > 120:
        raise ConfigError("config: retry_seconds must be between 0 and 120")
    if settings.health_interval <= 0:
        raise ConfigError("config: health_interval must be > 0 seconds")
    if settings.reset_attempt_timeout <= 0:
        raise ConfigError("config: reset_attempt_timeout must be > 0 seconds")
    if settings.peers and settings.peers_dns:
        raise ConfigError("config: set peers (a static list) or peers_dns (a headless Service), not both")
    _check_peers_tls(settings)
    _check_resets_path(settings)
    if settings.admin_token_create:
        if not settings.admin_token_file:
            raise ConfigError(
                "config: admin_token_create needs admin_token_file: the file to write the token into"
            )
        _create_token_file(settings.admin_token_file)
    token = _secret(settings.admin_token, settings.admin_token_file, "admin_token_file", "the token")
    if token is not None and not token:
        raise ConfigError("config: the admin token is empty; put a non-empty token in admin_token_file")
    engine_key = _secret(
        settings.upstream_api_key,
        settings.upstream_api_key_file,
        "upstream_api_key_file",
        "the engine's API key",
    )
    if engine_key is not None and not engine_key:
        raise ConfigError(
            "config: upstream_api_key is empty; put the engine's API key in upstream_api_key_file"
        )
    settings = dataclasses.replace(settings, admin_token=token, upstream_api_key=engine_key or None)
    if settings.native_reset_auth == NativeResetAuth.UPSTREAM_API_KEY and settings.engine_key is None:
        raise ConfigError(
            "config: native_reset_auth = upstream_api_key needs the engine's key: set upstream_api_key_file "
            "(or CACHEWITNESS_UPSTREAM_API_KEY), or use native_reset_auth = admin"
        )
    engine_key = settings.engine_key
    if (
        token is not None
        and engine_key is not None
        and hmac.compare_digest(token.encode(), engine_key.encode())
    ):
        # The admin token is stripped from forwarded requests: an equal engine key would be too.
        raise ConfigError(
            "config: the admin token and upstream_api_key are the same: give the sidecar its own admin token"
        )
    return settings
