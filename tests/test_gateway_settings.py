"""The gateway's one settings object: sources and their precedence, validation, generated --help.

Pure logic: no engine, no image (the flags are parsed by the real ``sandkernel`` parser).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sandkernel.cli import build_parser
from sandkernel.errors import ConfigError
from sandkernel.gateway.auth import TokenAuth
from sandkernel.gateway.budget import OutputBudget
from sandkernel.gateway.settings import GatewaySettings, env_name, flag_name


def settings_from(argv: list[str], environ: dict[str, str] | None = None) -> GatewaySettings:
    return GatewaySettings.from_args(build_parser().parse_args(["serve", *argv]), environ or {})


def test_defaults_are_the_documented_ones():
    settings = settings_from([])
    assert settings == GatewaySettings()
    assert (settings.ip, settings.port, settings.pool_size) == ("127.0.0.1", 8888, 2)  # README: pool default 2
    assert (settings.max_sessions, settings.max_sessions_total) == (20, 100)
    assert (settings.idle_timeout, settings.max_lifetime) == (3600.0, 86400.0)
    assert settings.budget == OutputBudget(64 * 1024, 8, 2 * 1024 * 1024)
    assert settings.allow_origins == () and settings.max_connections_per_kernel == 16


def test_precedence_is_flags_then_environment_then_file_then_defaults(tmp_path):
    config = tmp_path / "gateway.json"
    config.write_text(json.dumps({"pool_size": 5, "max_sessions": 7, "port": 9001, "allow_origins": ["https://a"]}))
    environ = {"SANDKERNEL_CONFIG": str(config), "SANDKERNEL_MAX_SESSIONS": "8", "SANDKERNEL_PORT": "9002"}
    settings = settings_from(["--port", "9003"], environ)
    assert settings.port == 9003  # flag over environment and file
    assert settings.max_sessions == 8  # environment over file
    assert settings.pool_size == 5 and settings.allow_origins == ("https://a",)  # file over defaults
    assert settings.max_sessions_total == 100  # default
    # --config names the file too, and beats $SANDKERNEL_CONFIG
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"pool_size": 1}))
    assert settings_from(["--config", str(other)], environ).pool_size == 1


def test_toml_config_file_and_every_kind_of_value(tmp_path):
    config = tmp_path / "gateway.toml"
    config.write_text(
        '# the operator\'s gateway\nip = "0.0.0.0"\nallow_token_in_url = true\nidle_timeout = 0\n'
        'header_timeout = 5\nprofiles_file = "/etc/sandkernel/profiles.json"\nallow_origins = ["https://lab"]\n'
    )
    settings = settings_from(["--config", str(config)])
    assert settings.ip == "0.0.0.0" and settings.allow_token_in_url is True
    assert settings.idle_timeout is None  # 0 means never, as the flag always said
    assert settings.header_timeout == 5.0 and isinstance(settings.header_timeout, float)
    assert settings.profiles_file == Path("/etc/sandkernel/profiles.json")
    # a flag can switch a boolean off again, and repeatable flags build the tuple
    flags = ["--config", str(config), "--no-allow-token-in-url", "--allow-origin", "x", "--allow-origin", "y"]
    settings = settings_from(flags)
    assert settings.allow_token_in_url is False and settings.allow_origins == ("x", "y")


def test_environment_values_are_parsed_by_type():
    settings = settings_from(
        [],
        {
            "SANDKERNEL_ALLOW_TOKEN_IN_URL": "yes",
            "SANDKERNEL_ALLOW_ORIGINS": "https://a, https://b",
            "SANDKERNEL_MAX_LIFETIME": "0",
            "SANDKERNEL_RUNTIME": "runc",
            "SANDKERNEL_TOKEN": "from-the-environment",
            "SANDKERNEL_NOTEBOOK_DIR": "/srv/notebooks",
        },
    )
    assert settings.allow_token_in_url is True and settings.allow_origins == ("https://a", "https://b")
    assert settings.max_lifetime is None and settings.default_runtime == "runc"
    assert settings.token == "from-the-environment" and settings.notebook_dir == Path("/srv/notebooks")
    assert "from-the-environment" not in repr(settings)  # a token never reaches a log line through repr


@pytest.mark.parametrize(
    ("source", "words"),
    [
        ({"SANDKERNEL_POOL_SIZE": "many"}, "$SANDKERNEL_POOL_SIZE must be a whole number, not 'many'"),
        ({"SANDKERNEL_ALLOW_TOKEN_IN_URL": "maybe"}, "$SANDKERNEL_ALLOW_TOKEN_IN_URL must be true or false"),
        ({"SANDKERNEL_PORT": "70000"}, "port must be 0..65535"),
        ({"SANDKERNEL_MAX_SESSIONS": "-1"}, "max_sessions must not be negative"),
        ({"SANDKERNEL_CULL_INTERVAL": "0"}, "cull_interval must be more than 0"),
        ({"SANDKERNEL_RUNTIME": "kvm"}, "default_runtime must be one of auto, runc, runsc"),
    ],
)
def test_bad_environment_values_are_refused_with_what_to_fix(source, words):
    with pytest.raises(ConfigError) as err:
        settings_from([], source)
    assert words in str(err.value)


@pytest.mark.parametrize(
    ("name", "text", "words"),
    [
        ("bad.json", '{"pool_sise": 3}', "unknown settings ['pool_sise']; known:"),
        ("bad.json", "[1, 2]", "must hold an object of settings"),
        ("bad.json", "{not json", "is not valid JSON"),
        ("bad.toml", "pool_size = ", "is not valid TOML"),
        ("bad.json", '{"pool_size": "2"}', "pool_size must be a whole number, not '2'"),
        ("bad.json", '{"allow_origins": "https://a"}', "allow_origins must be a list of strings"),
        ("bad.json", '{"idle_timeout": true}', "idle_timeout must be a number, not True"),
    ],
)
def test_bad_config_files_are_refused_naming_the_file_and_setting(tmp_path, name, text, words):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        settings_from(["--config", str(path)])
    assert words in str(err.value) and str(path) in str(err.value)


def test_missing_config_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the config file"):
        settings_from(["--config", str(tmp_path / "absent.toml")])


def test_settings_are_frozen_and_validated_when_built_in_python():
    settings = GatewaySettings(profiles_file="p.json", idle_timeout=60)  # type: ignore[arg-type]
    assert settings.profiles_file == Path("p.json") and settings.idle_timeout == 60.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.port = 1  # type: ignore[misc]
    with pytest.raises(ConfigError, match="pool_size must be a whole number"):
        GatewaySettings(pool_size="2")  # type: ignore[arg-type]
    assert settings.replace(pool_size=0).pool_size == 0


def test_serve_help_is_generated_from_every_field():
    """Every field has a flag whose help gives its default and its environment variable; the
    flags README examples use keep working."""
    proc = subprocess.run(
        [sys.executable, "-m", "sandkernel.cli", "serve", "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    help_text = " ".join(proc.stdout.split())  # argparse wraps lines
    for field in dataclasses.fields(GatewaySettings):
        assert flag_name(field) in help_text, field.name
        assert f"${env_name(field)})" in help_text, field.name
    assert "--config FILE" in help_text and "flags > environment > config file > defaults" in help_text
    for example in (
        "--pool-size N",
        "--tokens-file FILE",
        "--profiles FILE",
        "--allow-origin ORIGIN",
        "--egress-policy FILE",
        "--default-runtime {auto,runc,runsc}",
        "--allow-token-in-url",
    ):
        assert example in help_text, example
    assert "(default: 2; $SANDKERNEL_POOL_SIZE)" in help_text
    assert "(default: 65536; $SANDKERNEL_OUTPUT_BUDGET)" in help_text


def test_serve_with_a_bad_config_says_so_in_one_line(tmp_path):
    path = tmp_path / "gateway.json"
    path.write_text('{"max_sesions": 3}')
    proc = subprocess.run(
        [sys.executable, "-m", "sandkernel.cli", "serve", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"sandkernel: config file {path}: unknown settings ['max_sesions']")


def test_a_generated_token_can_be_given_back_on_a_command_line():
    """The token ``serve`` prints goes back as ``--token $TOKEN`` (attach, a second gateway). A
    urlsafe token starts with ``-`` once in 64, and argparse then reads it as an option."""
    for _ in range(1000):
        _, printed = TokenAuth.from_sources()
        assert printed is not None and len(printed) >= 32
        assert settings_from(["--token", printed]).token == printed
