"""What ships: a wheel installed without extras runs the services and operator commands, and the systemd units."""

from __future__ import annotations

import configparser
import importlib.util
import json
import os
import pwd
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import click
import pytest

from sidecar.cli import main
from sidecar.config import SafekeeperSettings, StartSettings, load
from support.helpers import walsidecar
from support.installed import files, installed_package_dir

ROOT = Path(__file__).resolve().parents[2]
UNITS = ROOT / "scripts" / "systemd"
# The analytics extra's imports (and numba's llvmlite); the core install must not bring any of them.
ANALYTICS_IMPORTS = {"pyspark", "numba", "llvmlite", "numpy", "pyarrow", "pandas", "matplotlib"}
# Modules that decode WAL in bulk (numpy, numba) or run Spark: only the analytics commands import them.
ANALYTICS_MODULES = {"sidecar.wal.archive", "sidecar.wal.crc32c", "sidecar.wal.kernel", "sidecar.wal.recordscan"}

IMPORT_ALL = """
import importlib, json, pkgutil, sidecar
failed = {}
for m in pkgutil.walk_packages(sidecar.__path__, "sidecar."):
    if not m.name.endswith(".__main__"):
        try:
            importlib.import_module(m.name)
        except ImportError as e:
            failed[m.name] = e.name
print(json.dumps(failed))
"""


def command_paths(group: click.Group = main, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command and subcommand of `walsidecar`, as argument tuples."""
    out = [prefix]
    for name, cmd in sorted(group.commands.items()):
        out += command_paths(cmd, prefix + (name,)) if isinstance(cmd, click.Group) else [prefix + (name,)]
    return out


@pytest.fixture(scope="session")
def core_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with `pip install walsidecar-*.whl` (no extras), the wheel built once from this checkout."""
    tmp = tmp_path_factory.mktemp("packaging")
    src = tmp / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for part in ("sidecar", "sql"):
        shutil.copytree(ROOT / part, src / part, ignore=skip)
    shutil.copy(ROOT / "pyproject.toml", src)
    pip = ["-m", "pip", "-q", "--disable-pip-version-check"]
    checked(sys.executable, *pip, "wheel", "--no-deps", "-w", str(tmp / "dist"), str(src), cwd=tmp)
    (wheel,) = (tmp / "dist").glob("walsidecar-*.whl")
    venv = tmp / "venv"
    checked(sys.executable, "-m", "venv", str(venv), cwd=tmp)
    # The suite may run without a network (scripts/with-docker.sh): the core dependencies are copied from
    # this interpreter's, the way the container image gets them, and pip checks that they satisfy the wheel.
    site = Path(checked(str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))",
                        cwd=tmp).strip())
    for dist in rootfs().runtime_distributions(ROOT / "pyproject.toml"):
        if dist.metadata["Name"] != "pip":
            location = Path(dist.locate_file(""))
            for f in dist.files or []:
                if f.parts[0] != ".." and "__pycache__" not in f.parts and (location / f).is_file():
                    (site / f).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(location / f, site / f)
    checked(str(venv / "bin" / "python"), *pip, "install", "--no-index", str(wheel), cwd=tmp)
    return venv


def rootfs() -> ModuleType:
    """docker/rootfs.py, which knows the installed distributions walsidecar's dependencies need."""
    spec = importlib.util.spec_from_file_location("rootfs", ROOT / "docker" / "rootfs.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def outside(cwd: Path) -> dict[str, Any]:
    """subprocess.run arguments that keep the checkout (PYTHONPATH, the current directory) out of sys.path."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {"cwd": cwd, "env": env, "capture_output": True, "text": True, "stdin": subprocess.DEVNULL}


def checked(*argv: str, cwd: Path) -> str:
    """Run argv; its stdout, or a failure that shows its stderr."""
    out = subprocess.run(argv, timeout=600, **outside(cwd))
    assert out.returncode == 0, f"{argv} exited {out.returncode}:\n{out.stderr}"
    return out.stdout


def run(venv: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(venv / "bin" / "walsidecar"), *args], timeout=60, **outside(cwd))


@pytest.mark.slow
def test_core_install_leaves_out_the_analytics(core_venv: Path, tmp_path: Path) -> None:
    code = "import importlib.util, sys; print(*[m for m in sys.argv[1:] if importlib.util.find_spec(m)])"
    assert checked(str(core_venv / "bin" / "python"), "-c", code, *sorted(ANALYTICS_IMPORTS), cwd=tmp_path).split() == []


@pytest.mark.slow
def test_every_module_but_the_analytics_imports_without_the_extra(core_venv: Path, tmp_path: Path) -> None:
    failed: dict[str, str] = json.loads(checked(str(core_venv / "bin" / "python"), "-c", IMPORT_ALL, cwd=tmp_path))
    core = {m: missing for m, missing in failed.items()
            if not (m.startswith("sidecar.analytics.") or m in ANALYTICS_MODULES)}
    assert core == {}
    assert {missing.split(".")[0] for missing in failed.values()} <= ANALYTICS_IMPORTS


@pytest.mark.slow
def test_every_command_runs_its_help_from_the_wheel(core_venv: Path, tmp_path: Path) -> None:
    for cmd in command_paths():
        out = run(core_venv, *cmd, "--help", cwd=tmp_path)
        assert out.returncode == 0 and "Usage: walsidecar" in out.stdout, (cmd, out.stderr)


@pytest.mark.slow
def test_certs_and_sql_work_from_the_wheel(core_venv: Path, tmp_path: Path) -> None:
    out = run(core_venv, "certs", "create-ca", "--ca-dir", str(tmp_path / "ca"), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    out = run(core_venv, "certs", "create-node", "--ca-dir", str(tmp_path / "ca"), "--certs-dir",
              str(tmp_path / "sk1"), "--role", "safekeeper", "--id", "1", "--host", "sk1.example.net", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert {p.name for p in (tmp_path / "sk1").iterdir()} >= {"ca.crt", "node.crt", "node.key"}
    # init-postgres finds its SQL in the installed package's share/ directory, not in a checkout.
    code = "from sidecar.ops.initpg import find_sql_dir; print(find_sql_dir(None))"
    assert Path(checked(str(core_venv / "bin" / "python"), "-c", code, cwd=tmp_path).strip()) == \
        core_venv / "share" / "walsidecar" / "sql"


@pytest.mark.slow
@pytest.mark.parametrize("command", ["analyze", "verify-archive"])
def test_analytics_commands_name_the_extra(core_venv: Path, tmp_path: Path, command: str) -> None:
    assert "walsidecar[analytics]" in run(core_venv, command, "--help", cwd=tmp_path).stdout
    args = [command, str(tmp_path)] + (["--stats"] if command == "analyze" else [])
    out = run(core_venv, *args, cwd=tmp_path)
    assert out.returncode == 1
    assert "pip install 'walsidecar[analytics]'" in out.stderr and "Traceback" not in out.stderr, out.stderr


def as_postgres() -> None:
    """The installed command is run by the postgres OS user: only root can become it here."""
    if os.geteuid() != 0:
        pytest.skip("runs commands as the postgres OS user: needs root")
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        pytest.skip("no postgres OS user (scripts/install.sh makes it)")


def test_the_installed_package_is_read_from_the_venv_not_the_checkout() -> None:
    """What PostgreSQL's restore_command runs, as the postgres user from /, reads nothing from the checkout
    (which that user may not be able to read, e.g. under /root): it is installed, not editable."""
    as_postgres()
    installed = installed_package_dir(user="postgres")
    assert not installed.is_relative_to(ROOT), f"{installed} is in the checkout: an editable install"
    readable = subprocess.run(["runuser", "-u", "postgres", "--", "test", "-r", str(installed / "__init__.py")],
                              timeout=60)
    assert readable.returncode == 0
    venv = Path(sys.executable).parent.parent
    assert installed.is_relative_to(venv)
    out = subprocess.run(["runuser", "-u", "postgres", "--", str(venv / "bin" / "walsidecar"), "restore-wal", "--help"],
                         timeout=60, **outside(Path("/")))
    assert out.returncode == 0 and "Usage: walsidecar restore-wal" in out.stdout, out.stderr
    # init-postgres finds its SQL in the venv's share/, not in the checkout.
    code = "from sidecar.ops.initpg import find_sql_dir; print(find_sql_dir(None))"
    out = subprocess.run(["runuser", "-u", "postgres", "--", sys.executable, "-P", "-c", code], timeout=60,
                         **outside(Path("/")))
    assert out.returncode == 0 and Path(out.stdout.strip()) == venv / "share" / "walsidecar" / "sql", out.stderr
    # scripts/install.sh reinstalls after any change: the installed copy is this checkout's code.
    assert files(installed) == files(ROOT / "sidecar")


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment,method-assign]   # systemd keys are case-sensitive
    parser.read(UNITS / name)
    return parser


@pytest.mark.parametrize("name, command, config", [
    ("walsidecar-safekeeper@.service", "safekeeper", "/etc/walsidecar/safekeeper-%i.toml"),
    ("walsidecar-sidecar@.service", "start", "/etc/walsidecar/sidecar-%i.toml"),
])
def test_unit_runs_an_existing_command_hardened(name: str, command: str, config: str) -> None:
    service = unit(name)["Service"]
    argv = shlex.split(service["ExecStart"])
    assert argv[:2] == ["/usr/local/bin/walsidecar", command]   # scripts/install.sh makes the link
    assert argv[2:] == ["--config", config]
    helptext = walsidecar(command, "--help").stdout
    assert all(a in helptext for a in argv[2:] if a.startswith("--"))
    assert service["User"] == "walsidecar" and service["Restart"] == "on-failure"
    for key, value in {"ProtectSystem": "strict", "NoNewPrivileges": "yes", "PrivateTmp": "yes",
                       "ProtectHome": "yes", "CapabilityBoundingSet": "",
                       "RestrictAddressFamilies": "AF_INET AF_INET6 AF_UNIX"}.items():
        assert service.get(key) == value, key


def test_safekeeper_unit_writes_only_its_data_dir() -> None:
    service = unit("walsidecar-safekeeper@.service")["Service"]
    assert service["ReadWritePaths"] == "/var/lib/" + service["StateDirectory"]
    settings = load(SafekeeperSettings, {}, UNITS / "safekeeper.toml.example")
    assert str(settings.data_dir) == service["ReadWritePaths"].replace("%i", str(settings.id))


def test_example_configs_are_valid() -> None:
    assert load(StartSettings, {}, UNITS / "sidecar.toml.example").quorum == 2


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_accepts_the_units(tmp_path: Path) -> None:
    # Templates are verified as instances; verify reads the unit files only, it starts nothing.
    names = []
    for template, instance in (("walsidecar-safekeeper@.service", "1"), ("walsidecar-sidecar@.service", "main")):
        names.append(str(tmp_path / template.replace("@", f"@{instance}")))
        shutil.copy(UNITS / template, names[-1])
    out = subprocess.run(["systemd-analyze", "verify", *names], capture_output=True, text=True, timeout=60)
    # A missing /usr/local/bin/walsidecar (not installed here) is the only complaint allowed.
    complaints = [line for line in out.stderr.splitlines() if "/usr/local/bin/walsidecar" not in line]
    assert complaints == [], out.stderr
