"""The layer rules (import-linter contracts in pyproject.toml) hold on the tree and catch a new break, and the
offline commands reach `lockgate` through the `lockgate.commands` entry points, not through imports."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from gateway import cli

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "policy", "registry", "routing", "engines", "guard", "ops")
LINT = "from importlinter.cli import lint_imports_command; lint_imports_command()"


def _pyproject() -> dict[str, object]:
    with (ROOT / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", LINT, "--config", str(tree / "pyproject.toml"), "--no-cache"],
        cwd=tree,
        # The copy first: it is what grimp reads.
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the first-party packages and pyproject.toml, to break on purpose."""
    root = tmp_path_factory.mktemp("tree")
    for package in PACKAGES:
        shutil.copytree(ROOT / package, root / package, ignore=shutil.ignore_patterns("__pycache__", "data"))
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    return root


def test_the_contracts_hold_on_the_tree(tree: Path) -> None:
    result = _lint(tree)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "line", "broken"),
    [
        ("gateway/config.py", "import ops.commands", "Nothing imports ops"),
        ("routing/router.py", "import guard.base", "routing and guard do not import each other"),
        ("guard/cascade.py", "import routing.replicas", "routing and guard do not import each other"),
        ("engines/base.py", "import registry.models", "engines imports no other first-party package"),
        ("registry/view.py", "import policy.auth", "registry imports no other first-party package"),
        ("policy/auth.py", "import gateway.errors", "Top-level layers"),
        ("gateway/workers.py", "import gateway.cli", "neither workers nor the server settings"),
        ("registry/errors.py", "import registry.view", "No import cycles"),
        ("gateway/generation/admission.py", "import gateway.services", "does not import the assembly"),
        ("gateway/generation/constraints.py", "import gateway.generation.planning", "No import cycles"),
    ],
)
def test_a_new_break_fails_the_lint(tree: Path, module: str, line: str, broken: str) -> None:
    path = tree / module
    kept = path.read_text()
    path.write_text(f"{kept}\n{line}  # a deliberate break\n")
    try:
        result = _lint(tree)
    finally:
        path.write_text(kept)
    assert result.returncode == 1, result.stdout + result.stderr
    failed = result.stdout.split("Broken contracts", 1)[1]
    assert broken in " ".join(failed.split()), result.stdout


def _declared_commands() -> list[cli.Command]:
    project = _pyproject()["project"]
    assert isinstance(project, dict)
    group = project["entry-points"][cli.COMMANDS_GROUP]
    points = [EntryPoint(name, value, cli.COMMANDS_GROUP) for name, value in sorted(group.items())]
    return [point.load() for point in points]


@pytest.mark.parametrize(
    "argv", [["models", "prepare", "--help"], ["guard", "train", "--help"], ["bench", "--help"]]
)
def test_offline_commands_come_from_the_entry_points(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(argv, commands=[])  # gateway.cli alone does not know them
    assert done.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit) as done:
        cli.main(argv, commands=_declared_commands())
    assert done.value.code == 0
    assert f"usage: lockgate {' '.join(argv[:-1])}" in capsys.readouterr().out


def test_a_bad_configuration_of_an_entry_point_command_is_a_configuration_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nport = -1\n")
    assert cli.main(["models", "prepare", "--config", str(bad)], commands=_declared_commands()) == 2
    assert "lockgate: configuration error" in capsys.readouterr().err


def test_the_entry_point_commands_load_without_the_training_stack() -> None:
    """`lockgate` loads them on every run, `serve` included: torch and transformers wait for the command."""
    code = "import sys, ops.commands; sys.exit(sorted({'torch', 'transformers'} & set(sys.modules)) or 0)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def test_an_entry_point_command_cannot_take_over_a_built_in_one() -> None:
    """Any installed distribution may add to the group: one that names `serve` stops `lockgate` instead of
    running in its place."""

    def impostor(commands: cli.Subcommands) -> None:
        commands.add_parser("serve").set_defaults(run=lambda args: 0)

    with pytest.raises(argparse.ArgumentError, match="conflicting subparser: serve"):
        cli.main(["serve"], commands=[impostor])
