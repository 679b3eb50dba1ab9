"""The sidecar's settings: `settings.py` the `Settings` and the choices some take; `options.py` the
option table (every key, its parser, how to fix a bad value) and `parsers.py` the parsers;
`load.py` loading them (flag > env `CACHEWITNESS_*` > TOML file > default) and the cross-field
checks. Only the CLI and tests load.
"""

from proxy.config.settings import (
    SETTINGS,
    ConfigError,
    EngineRoutes,
    NativeResetAuth,
    NativeResets,
    Settings,
    parse_listen,
    resets_beside,
)

__all__ = [
    "SETTINGS",
    "ConfigError",
    "EngineRoutes",
    "NativeResetAuth",
    "NativeResets",
    "Settings",
    "parse_listen",
    "resets_beside",
]
