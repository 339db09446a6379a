"""Configuration: defaults, the documented example file, TOML files, `LOCKGATE_*` overrides, clear errors."""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

import msgspec
import pytest

from engines.simulated import SimulatorConfig
from gateway import cli
from gateway.config import Config, ConfigError, EngineConfig, ModelConfig, ServerConfig, load_config
from policy.quota.lease import LeasePolicy

EXAMPLE = Path(__file__).resolve().parents[1] / "ops/deploy/lockgate.example.toml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "lockgate.toml"
    path.write_text(text, encoding="utf-8")
    return path


def config_error(path: Path | None, env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, env={} if env is None else env)
    return str(info.value)


def test_no_file_no_env_is_the_embedded_default() -> None:
    config = load_config(None, env={})
    assert config == Config()
    assert config.engine.kind == "vllm_local"
    assert config.model.name == "SmolLM2-135M-Instruct"
    assert config.server.port == 8080
    assert config.server.host == "127.0.0.1"
    assert config.model.model_dir() == Path("~/.cache/lockgate/models/SmolLM2-135M-Instruct").expanduser()


def test_non_lockgate_environment_is_ignored() -> None:
    env = {"PORT": "1", "LOCKGATE_PORT": "2", "LOCKGATE_SERVER__": "3", "OTHER_SERVER__PORT": "4"}
    assert load_config(None, env=env) == Config()


def test_example_file_decodes_to_exactly_the_defaults() -> None:
    assert load_config(EXAMPLE, env={}) == Config()


def _field_paths(struct_type: type[msgspec.Struct], prefix: str = "") -> dict[str, object]:
    """Every leaf field of a config struct as dotted path -> default value."""
    paths: dict[str, object] = {}
    for field in msgspec.structs.fields(struct_type):
        default = field.default_factory() if field.default_factory is not msgspec.NODEFAULT else field.default
        if isinstance(default, msgspec.Struct):
            paths.update(_field_paths(type(default), f"{prefix}{field.name}."))
        else:
            paths[f"{prefix}{field.name}"] = default
    return paths


def _toml_paths(table: dict[str, Any], prefix: str = "") -> set[str]:
    paths: set[str] = set()
    for key, value in table.items():
        if isinstance(value, dict):
            paths |= _toml_paths(value, f"{prefix}{key}.")
        else:
            paths.add(f"{prefix}{key}")
    return paths


def test_example_file_documents_every_field() -> None:
    text = EXAMPLE.read_text(encoding="utf-8")
    fields = _field_paths(Config)
    # TOML has no null: fields whose default is None appear commented out.
    nullable = {path for path, default in fields.items() if default is None}
    assert nullable == {"engine.simulator.fail_after_tokens", "engine.simulator.skill", "quota.lease"}
    assert _toml_paths(tomllib.loads(text)) == set(fields) - nullable
    lines = text.splitlines()
    assert "# [quota.lease]" in lines  # an optional table: commented out, with its fields
    for name in _field_paths(LeasePolicy):
        assert f"# {name} = " in text
    for path in nullable - {"quota.lease"}:
        assert f"# {path.rsplit('.', 1)[1]} = " in text
    # Each field line (set or commented out) has a comment line directly above it.
    leaf_names = {path.rsplit(".", 1)[-1] for path in fields}
    for index, line in enumerate(lines):
        name = line.lstrip("# ").split(" = ", 1)[0]
        if " = " in line and name in leaf_names:
            assert lines[index - 1].startswith("#"), f"no comment above {line!r}"
    for section in ("[server]", "[model]", "[engine]", "[engine.simulator]"):
        assert section in lines


def test_file_overrides_are_honoured(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        [server]
        port = 9000
        log_level = "debug"

        [model]
        name = "tiny"
        path = "/srv/models/tiny"

        [engine]
        kind = "simulated"

        [engine.simulator]
        decode_step_s = 0.25
        fail_after_tokens = 7
        """,
    )
    config = load_config(path, env={})
    assert config.server == ServerConfig(port=9000, log_level="debug")
    assert config.model == ModelConfig(name="tiny", path="/srv/models/tiny")
    assert config.model.model_dir() == Path("/srv/models/tiny")
    assert config.engine == EngineConfig(
        kind="simulated", simulator=SimulatorConfig(decode_step_s=0.25, fail_after_tokens=7)
    )


def test_env_overrides_win_over_the_file(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        [server]
        port = 9000
        host = "0.0.0.0"

        [engine]
        kind = "vllm_local"

        [engine.simulator]
        decode_step_s = 0.25
        max_batch = 8
        """,
    )
    env = {
        "LOCKGATE_SERVER__PORT": "9001",
        "LOCKGATE_ENGINE__KIND": "simulated",
        "LOCKGATE_ENGINE__SIMULATOR__DECODE_STEP_S": "0.5",
        "LOCKGATE_MODEL__NAME": "foo",
    }
    config = load_config(path, env=env)
    assert config.server.port == 9001
    assert config.server.host == "0.0.0.0"  # from the file, not overridden
    assert config.engine.kind == "simulated"
    assert config.engine.simulator.decode_step_s == 0.5
    assert config.engine.simulator.max_batch == 8  # from the file
    assert config.model.name == "foo"
    assert config.model.data_dir == ModelConfig().data_dir  # default, untouched


def test_env_values_take_the_field_type() -> None:
    env = {
        "LOCKGATE_MODEL__NAME": "2024",  # looks like a number, but the field is a string
        "LOCKGATE_SERVER__HOST": "0.0.0.0",
        "LOCKGATE_ENGINE__ENFORCE_EAGER": "false",
        "LOCKGATE_ENGINE__SIMULATOR__FAIL_AFTER_TOKENS": "12",
        "LOCKGATE_SERVER__DRAIN_TIMEOUT": "5",
    }
    config = load_config(None, env=env)
    assert config.model.name == "2024"
    assert config.server.host == "0.0.0.0"
    assert config.engine.enforce_eager is False
    assert config.engine.simulator.fail_after_tokens == 12
    assert config.server.drain_timeout == 5.0
    assert load_config(None, env={"LOCKGATE_ENGINE__SIMULATOR__FAIL_AFTER_TOKENS": "null"}) == Config()


def test_wrong_type_in_file_names_the_field(tmp_path: Path) -> None:
    message = config_error(write(tmp_path, '[server]\nport = "abc"\n'))
    assert "server.port" in message


def test_wrong_type_in_nested_section_names_the_field(tmp_path: Path) -> None:
    message = config_error(write(tmp_path, '[engine.simulator]\ndecode_step_s = "fast"\n'))
    assert "engine.simulator.decode_step_s" in message


def test_wrong_type_from_env_names_field_and_variable() -> None:
    message = config_error(None, {"LOCKGATE_SERVER__PORT": "abc"})
    assert "server.port" in message
    assert "LOCKGATE_SERVER__PORT" in message


def test_unknown_field_names_it(tmp_path: Path) -> None:
    message = config_error(write(tmp_path, "[server]\nprot = 1\n"))
    assert "server.prot" in message
    assert "unknown" in message


def test_unknown_nested_field_names_it(tmp_path: Path) -> None:
    message = config_error(write(tmp_path, "[engine.simulator]\nbatch = 1\n"))
    assert "engine.simulator.batch" in message


def test_unknown_field_from_env_names_it() -> None:
    message = config_error(None, {"LOCKGATE_MODEL__NAEM": "x"})
    assert "model.naem" in message
    assert "LOCKGATE_MODEL__NAEM" in message


def test_unknown_section_names_it(tmp_path: Path) -> None:
    message = config_error(write(tmp_path, "[srv]\nport = 1\n"))
    assert "srv" in message
    assert "unknown" in message


def test_section_given_as_a_value_names_it(tmp_path: Path) -> None:
    message = config_error(write(tmp_path, "server = 3\n"))
    assert "`server`" in message


def test_bad_literal_names_the_field(tmp_path: Path) -> None:
    message = config_error(write(tmp_path, '[engine]\nkind = "nope"\n'))
    assert "engine.kind" in message
    message = config_error(None, {"LOCKGATE_SERVER__LOG_LEVEL": "loud"})
    assert "server.log_level" in message


@pytest.mark.parametrize("value", ["0", "-1.5"])
def test_non_positive_stall_timeout_names_the_field(tmp_path: Path, value: str) -> None:
    message = config_error(write(tmp_path, f"[server]\nstream_stall_timeout = {value}\n"))
    assert "server.stream_stall_timeout" in message


def test_stream_buffer_may_be_zero_not_negative(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "[server]\nstream_buffer = 0\n"), env={}).server.stream_buffer == 0
    message = config_error(write(tmp_path, "[server]\nstream_buffer = -1\n"))
    assert "server.stream_buffer" in message


@pytest.mark.parametrize("value", ["0", "-0.01"])
def test_non_positive_lag_probe_interval_names_the_field(value: str) -> None:
    message = config_error(None, {"LOCKGATE_OVERLOAD__LAG_PROBE_INTERVAL": value})
    assert "overload.lag_probe_interval" in message


@pytest.mark.parametrize("port", [0, -1, 65536, 70000])
def test_port_out_of_range_names_the_field(tmp_path: Path, port: int) -> None:
    message = config_error(write(tmp_path, f"[server]\nport = {port}\n"))
    assert "server.port" in message
    assert str(port) in message


def test_valid_port_bounds_are_accepted() -> None:
    assert load_config(None, env={"LOCKGATE_SERVER__PORT": "1"}).server.port == 1
    assert load_config(None, env={"LOCKGATE_SERVER__PORT": "65535"}).server.port == 65535


def test_negative_max_logprobs_names_the_field() -> None:
    assert "engine.max_logprobs" in config_error(None, {"LOCKGATE_ENGINE__MAX_LOGPROBS": "-1"})
    assert load_config(None, env={"LOCKGATE_ENGINE__MAX_LOGPROBS": "0"}).engine.max_logprobs == 0


def test_invalid_toml_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "[server\nport = 1\n")
    message = config_error(path)
    assert str(path) in message
    assert "TOML" in message


def test_missing_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    message = config_error(path)
    assert str(path) in message


def test_env_through_a_non_section_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "[server]\nport = 9000\n")
    message = config_error(path, {"LOCKGATE_SERVER__PORT__X": "1"})
    assert "LOCKGATE_SERVER__PORT__X" in message


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """No `LOCKGATE_*` variable from the outer environment leaks into the CLI's config."""
    for key in list(os.environ):
        if key.startswith("LOCKGATE_"):
            monkeypatch.delenv(key)


@pytest.mark.usefixtures("clean_env")
@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('[server]\nport = "abc"\n', "server.port"),
        ('[engine]\nkind = "nope"\n', "engine.kind"),
        ("[server]\nprot = 1\n", "server.prot"),
        ("[server]\nstream_stall_timeout = 0\n", "server.stream_stall_timeout"),
    ],
)
def test_cli_serve_with_bad_config_exits_2_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, field: str
) -> None:
    bad = write(tmp_path, text)
    assert cli.main(["--config", str(bad), "serve"]) == 2
    captured = capsys.readouterr()
    assert field in captured.err
    assert "configuration error" in captured.err
    assert captured.out == ""


@pytest.mark.usefixtures("clean_env")
def test_cli_config_after_subcommand_is_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = write(tmp_path, "[server]\nport = 70000\n")
    assert cli.main(["serve", "--config", str(bad)]) == 2
    assert "server.port" in capsys.readouterr().err


def test_cli_bad_env_exits_2_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("LOCKGATE_ENGINE__KIND", "nope")
    assert cli.main(["serve"]) == 2
    err = capsys.readouterr().err
    assert "engine.kind" in err
    assert "LOCKGATE_ENGINE__KIND" in err


def test_quota_leases_are_off_unless_their_table_is_given(tmp_path: Path) -> None:
    assert load_config(None, env={}).quota.lease is None
    config = load_config(
        write(tmp_path, '[quota]\nbackend = "redis"\n[quota.lease]\nseconds = 0.5\n'), env={}
    )
    assert config.quota.lease == LeasePolicy(seconds=0.5)
    assert load_config(None, env={"LOCKGATE_QUOTA__LEASE__REQUESTS": "8"}).quota.lease == LeasePolicy(
        requests=8
    )


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("seconds", "0", "quota.lease.seconds"),
        ("requests", "0", "quota.lease.requests"),
        ("fraction", "1.5", "quota.lease.fraction"),
        ("floor", "-0.1", "quota.lease.floor"),
    ],
)
def test_bad_lease_settings_name_the_field(field: str, value: str, named: str) -> None:
    assert named in config_error(None, {f"LOCKGATE_QUOTA__LEASE__{field.upper()}": value})


@pytest.mark.parametrize("days", ["0", "-1"])
def test_non_positive_evidence_retention_names_the_field(days: str) -> None:
    error = config_error(None, {"LOCKGATE_APPEALS__EVIDENCE_RETENTION_DAYS": days})
    assert "appeals.evidence_retention_days" in error


@pytest.mark.parametrize(
    ("reasons", "named"),
    [
        # Only an upheld reason: an overturn could not be decided.
        (
            '[[appeals.reasons]]\ncode = "a"\noutcome = "upheld"\nground = "illegal_content"\ntext = "t"\n',
            "overturned",
        ),
        # A code twice.
        (
            '[[appeals.reasons]]\ncode = "a"\noutcome = "upheld"\nground = "illegal_content"\ntext = "t"\n'
            '[[appeals.reasons]]\ncode = "a"\noutcome = "overturned"\nground = "none"\ntext = "t"\n',
            "unique",
        ),
        # An overturn on an illegal-content ground.
        (
            '[[appeals.reasons]]\ncode = "a"\noutcome = "upheld"\nground = "illegal_content"\ntext = "t"\n'
            '[[appeals.reasons]]\ncode = "b"\noutcome = "overturned"\n'
            'ground = "illegal_content"\ntext = "t"\n',
            "ground none",
        ),
        (
            '[[appeals.reasons]]\ncode = "Not A Code"\noutcome = "upheld"\nground = "none"\ntext = "t"\n',
            "code",
        ),
    ],
)
def test_bad_reason_lists_are_refused_naming_the_section(tmp_path: Path, reasons: str, named: str) -> None:
    error = config_error(write(tmp_path, reasons), {})
    assert "appeals" in error
    assert named in error
