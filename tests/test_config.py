"""Settings come from flag > env > TOML file > default; a bad value is one clear line, exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from proxy.config import ConfigError, Settings
from proxy.config.load import load_settings


def write_toml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "cw.toml"
    path.write_text(text)
    return str(path)


def test_defaults_match_the_spec() -> None:
    settings = load_settings({}, env={})
    assert settings.upstream == "http://127.0.0.1:8200"
    assert settings.listen == "0.0.0.0:8000"
    assert settings.engine == "auto"
    assert settings.max_body_bytes == 64 * 1024 * 1024
    assert settings.grace_period == 30 and settings.shutdown_delay == 0


def test_flag_beats_env_beats_file_beats_default(tmp_path: Path) -> None:
    config = write_toml(tmp_path, 'upstream = "http://file:1"\nlisten = "127.0.0.1:1"\nengine = "vllm"\n')
    env = {"CACHEWITNESS_UPSTREAM": "http://env:2", "CACHEWITNESS_LISTEN": "127.0.0.1:2"}
    settings = load_settings({"upstream": "http://flag:3"}, env=env, config_file=config)
    assert settings.upstream == "http://flag:3"
    assert settings.listen == "127.0.0.1:2"
    assert settings.engine == "vllm"
    assert settings.retry_seconds == Settings().retry_seconds


def test_table_form_of_the_file_is_read(tmp_path: Path) -> None:
    config = write_toml(tmp_path, "[cachewitness]\ndrain = false\nbusy_statuses = [429]\n")
    settings = load_settings({}, env={}, config_file=config)
    assert settings.drain is False and settings.busy_statuses == (429,)


def test_env_bool_and_number_parse() -> None:
    settings = load_settings({}, env={"CACHEWITNESS_DRAIN": "off", "CACHEWITNESS_DRAIN_TIMEOUT": "2.5"})
    assert settings.drain is False and settings.drain_timeout == 2.5


@pytest.mark.parametrize(
    ("flags", "env", "key"),
    [
        ({"drain_timeout": "abc"}, {}, "drain_timeout"),
        ({}, {"CACHEWITNESS_ENGINE": "tgi"}, "engine"),
        ({"listen": "nonsense"}, {}, "listen"),
        ({"upstream": "ftp://x"}, {}, "upstream"),
        ({"retry_seconds": "500"}, {}, "retry_seconds"),
    ],
)
def test_bad_value_names_the_key(flags: dict[str, Any], env: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        load_settings(flags, env=env)


def test_unknown_file_key_is_rejected(tmp_path: Path) -> None:
    config = write_toml(tmp_path, "upstreem = 'http://x:1'\n")
    with pytest.raises(ConfigError, match="upstreem"):
        load_settings({}, env={}, config_file=config)


def test_token_is_read_from_its_file(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    settings = load_settings({"admin_token_file": str(token_file)}, env={})
    assert settings.admin_token == "s3cret"
    assert "s3cret" not in repr(settings)


def test_serve_with_a_bad_value_exits_2_with_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--drain-timeout", "soon"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "drain_timeout" in lines[0] and "Traceback" not in done.stderr


def test_serve_on_a_taken_port_exits_2_with_one_line(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "proxy",
                "serve",
                "--listen",
                f"127.0.0.1:{port}",
                "--evidence",
                str(tmp_path / "ev.jsonl"),
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    assert f"127.0.0.1:{port}" in done.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize(
    "upstream",
    ["http://user:s3cret@127.0.0.1:8000", "http://s3cret@127.0.0.1:8000", "https://:s3cret@engine"],
)
def test_credentials_in_the_upstream_url_are_refused_naming_upstream_api_key(
    tmp_path: Path, upstream: str
) -> None:
    config = write_toml(tmp_path, f'upstream = "{upstream}"\n')
    for flags, env, file in (
        ({"upstream": upstream}, {}, None),
        ({}, {"CACHEWITNESS_UPSTREAM": upstream}, None),
        ({}, {}, config),
    ):
        with pytest.raises(ConfigError, match="upstream_api_key") as refused:
            load_settings(flags, env=env, config_file=file)
        assert "s3cret" not in str(refused.value) and "upstream = " in str(refused.value)


def test_a_malformed_upstream_url_is_not_echoed_with_its_password() -> None:
    with pytest.raises(ConfigError, match="upstream") as refused:
        load_settings({"upstream": "http://user:s3cret@:notaport"}, env={})
    assert "s3cret" not in str(refused.value)


def test_serve_with_credentials_in_the_upstream_exits_2_with_one_line(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            *(sys.executable, "-m", "proxy", "serve"),
            *("--upstream", "http://user:s3cret@127.0.0.1:8000", "--listen", "127.0.0.1:0"),
            *("--evidence", str(tmp_path / "ev.jsonl")),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    [line] = done.stderr.strip().splitlines()
    assert "upstream_api_key" in line and "s3cret" not in line


def serve_help(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """`cachewitness serve --help`, as {flag: its help text}."""
    from proxy.cli import main

    monkeypatch.setenv("COLUMNS", "300")
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--help"])
    assert exited.value.code == 0
    entries: dict[str, str] = {}
    flag = None
    for line in capsys.readouterr().out.split("options:", 1)[1].splitlines():
        if line.startswith("  -"):
            flag = line.split()[0].rstrip(",")
            entries[flag] = line
        elif flag is not None:
            entries[flag] += " " + line.strip()
    return entries


def test_serve_help_shows_every_options_default(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    entries = serve_help(capsys, monkeypatch)
    entries.pop("-h")
    assert len(entries) > 30
    assert [flag for flag, text in entries.items() if "default: " not in text] == []
    for flag, default in {
        "--upstream": "http://127.0.0.1:8200",
        "--listen": "0.0.0.0:8000",
        "--engine": "auto",
        "--grace-period": "30",
        "--drain": "true",
        "--evidence-stdout": "false",
        "--busy-statuses": "409,429,503",
        "--max-body-bytes": "67108864 (64 MiB)",
        "--health-path": "unset",
    }.items():
        assert f"default: {default})" in entries[flag], entries[flag]


def test_route_policy_defaults_are_safe() -> None:
    settings = load_settings({}, env={})
    assert settings.engine_routes == "admin" and settings.native_resets == "engine"
    assert settings.native_reset_auth == "admin" and settings.extra_admin_paths == ()
    assert settings.trusted_peers == ("127.0.0.1", "::1")


def test_trusted_peers_take_addresses_and_cidrs_from_every_layer(tmp_path: Path) -> None:
    config = write_toml(tmp_path, 'trusted_peers = ["127.0.0.1", "10.0.0.0/8", "fd00::/8"]\n')
    assert load_settings({}, env={}, config_file=config).trusted_peers == (
        "127.0.0.1",
        "10.0.0.0/8",
        "fd00::/8",
    )
    env = {"CACHEWITNESS_TRUSTED_PEERS": "127.0.0.6, ::1"}
    assert load_settings({}, env=env).trusted_peers == ("127.0.0.6", "::1")
    assert load_settings({}, env={"CACHEWITNESS_TRUSTED_PEERS": ""}).trusted_peers == ()  # nobody


@pytest.mark.parametrize(
    ("env", "key"),
    [
        ({"CACHEWITNESS_ENGINE_ROUTES": "closed"}, "engine_routes"),
        ({"CACHEWITNESS_NATIVE_RESETS": "both"}, "native_resets"),
        ({"CACHEWITNESS_NATIVE_RESET_AUTH": "anyone"}, "native_reset_auth"),
        ({"CACHEWITNESS_EXTRA_ADMIN_PATHS": "no-slash"}, "extra_admin_paths"),
        ({"CACHEWITNESS_EXTRA_ADMIN_PATHS": "/a*b"}, "extra_admin_paths"),
        ({"CACHEWITNESS_EXTRA_ADMIN_PATHS": "/%61dmin"}, "extra_admin_paths"),
        ({"CACHEWITNESS_RESET_PATH": "/re%73et"}, "reset_path"),
        ({"CACHEWITNESS_TRUSTED_PEERS": "127.0.0.1,localhost"}, "trusted_peers"),
        ({"CACHEWITNESS_TRUSTED_PEERS": "10.0.0.0/33"}, "trusted_peers"),
        ({"CACHEWITNESS_NATIVE_RESET_AUTH": "upstream_api_key"}, "upstream_api_key"),
        ({"CACHEWITNESS_ADMIN_TOKEN": "same", "CACHEWITNESS_UPSTREAM_API_KEY": "same"}, "upstream_api_key"),
    ],
)
def test_bad_route_policy_config_names_the_key(env: dict[str, str], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        load_settings({}, env=env)


def test_upstream_api_key_is_read_from_its_file_and_the_old_name_still_works(tmp_path: Path) -> None:
    key_file = tmp_path / "engine.key"
    key_file.write_text("k3y\n")
    settings = load_settings({}, env={"CACHEWITNESS_UPSTREAM_API_KEY_FILE": str(key_file)})
    assert settings.engine_key == "k3y" and "k3y" not in repr(settings)
    assert load_settings({}, env={"CACHEWITNESS_ENGINE_API_KEY": "old"}).engine_key == "old"
    settings = load_settings({}, env={"CACHEWITNESS_EXTRA_ADMIN_PATHS": "/a, /b/*"})
    assert settings.extra_admin_paths == ("/a", "/b/*")


def test_overhead_header_is_a_serve_switch_both_ways_and_off_by_default() -> None:
    """`--overhead-header` / `--no-overhead-header` on `cachewitness serve`, as request_id_header is."""
    from proxy.cli import build_parser

    parser = build_parser()
    assert vars(parser.parse_args(["serve", "--overhead-header"]))["overhead_header"] is True
    assert vars(parser.parse_args(["serve", "--no-overhead-header"]))["overhead_header"] is False
    assert load_settings({"overhead_header": True}, env={}).overhead_header
    assert load_settings({}, env={"CACHEWITNESS_OVERHEAD_HEADER": "true"}).overhead_header
    assert not load_settings({}, env={}).overhead_header
