"""Each option is declared once, in the settings: --help, docs/options.md and HOST:PORT parsing follow from it."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from sidecar.address import Address, parse_address, parse_listen
from sidecar.analytics.commands import SPARK_OPTIONS
from sidecar.cli import main
from sidecar.config import ALL_SETTINGS, ConfigError, SafekeeperSettings, Settings, StartSettings, flag, load, \
    options_table

ROOT = Path(__file__).resolve().parents[2]
OPTIONS = ROOT / "docs" / "options.md"
BY_COMMAND = {cls.command: cls for cls in ALL_SETTINGS}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    for k in list(os.environ):
        if k.startswith("WALSIDECAR_"):
            monkeypatch.delenv(k)


def help_text(command: str) -> str:
    out = CliRunner().invoke(main, [*command.split(), "--help"])
    assert out.exit_code == 0, out.output
    return " ".join(out.output.split())


@pytest.mark.parametrize("cls", ALL_SETTINGS, ids=lambda c: c.command)
def test_readme_table_is_the_one_the_settings_make(cls: type[Settings]) -> None:
    tables = dict(re.findall(r"<!-- options (\S+) -->\n(.*?)<!-- end options -->", OPTIONS.read_text(), re.DOTALL))
    assert tables.get(cls.command) == options_table(cls), (
        f"docs/options.md's table for `walsidecar {cls.command}` differs from the settings: run "
        "python3 scripts/readme_options.py; it should be:\n" + options_table(cls))


def test_the_readme_script_rewrites_a_stale_table() -> None:
    spec = importlib.util.spec_from_file_location("readme_options", ROOT / "scripts" / "readme_options.py")
    assert spec is not None and spec.loader is not None
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    text = OPTIONS.read_text()
    stale = text.replace("| `--wal-buffer N` | `64` |", "| `--wal-buffer N` | `32` |")
    assert stale != text
    assert script.rewritten(stale) == text


@pytest.mark.parametrize("cls", ALL_SETTINGS, ids=lambda c: c.command)
def test_every_field_is_an_option_with_help(cls: type[Settings]) -> None:
    command: click.Command = main
    for word in (cls.cli_words or cls.command).split():
        command = command.commands[word]  # type: ignore[attr-defined]
    options = {p.name: p for p in command.params
               if isinstance(p, click.Option) and (p.name in cls.model_fields or p.name not in SPARK_OPTIONS)}
    assert set(options) == set(cls.model_fields) | {"config_file"}
    for name, field in cls.model_fields.items():
        assert field.description, f"{cls.__name__}.{name} has no description"
        assert options[name].opts == [flag(name)] and options[name].help
        assert ("Required." in (options[name].help or "")) == field.is_required(), name


@pytest.mark.parametrize("cls", ALL_SETTINGS, ids=lambda c: c.command)
def test_help_shows_every_flag(cls: type[Settings]) -> None:
    text = help_text(cls.cli_words or cls.command)
    for name in cls.model_fields:
        assert flag(name) + " " in text, f"walsidecar {cls.command} --help lacks {flag(name)}"
    assert "--config FILE" in text


def test_help_shows_the_field_defaults() -> None:
    assert "MiB of WAL kept in memory for lagging safekeepers; beyond it they catch up from the primary. " \
           "[default: 64]" in help_text("start")
    assert "HOST:PORT to accept proposers on. [default: 127.0.0.1:7601]" in help_text("safekeeper")
    assert "[default: /tmp/walsidecar-up]" in help_text("up")
    assert "--timeout SECONDS Seconds to wait for each answer. [default: 3.0]" in help_text("status")


def test_an_ipv6_address_round_trips(tmp_path: Path) -> None:
    address = Address.parse("[::1]:7601")
    assert (address.host, address.port) == ("::1", 7601) and str(address) == "[::1]:7601"
    assert parse_address(" [fe80::1]:65535 ") == ("fe80::1", 65535)
    assert parse_listen("[::1]:0") == ("::1", 0)
    assert str(Address.parse("db1.example:7601")) == "db1.example:7601"
    sk = load(SafekeeperSettings, {"id": 1, "data_dir": str(tmp_path), "listen": "[::1]:7601",
                                   "metrics": "[::1]:9188", "insecure": True}, None)
    assert isinstance(sk, SafekeeperSettings) and (sk.listen, sk.metrics) == ("[::1]:7601", "[::1]:9188")
    start = load(StartSettings, {"pg_dsn": "host=x", "safekeepers": "[::1]:1,127.0.0.1:2,[::1]:3",
                                 "insecure": True}, None)
    assert isinstance(start, StartSettings) and start.safekeepers == ("[::1]:1", "127.0.0.1:2", "[::1]:3")


@pytest.mark.parametrize("text, reason", [
    ("nonsense", "no port"),
    ("127.0.0.1:", "no port"),
    ("[::1]", "no port"),
    (":7601", "no host"),
    ("127.0.0.1:http", "port 'http' is not a number"),
    ("127.0.0.1:65536", "port 65536 is outside 1-65535"),
    ("127.0.0.1:0", "port 0 is outside 1-65535"),
    ("::1:7601", "an IPv6 address goes in brackets"),
    ("::1", "an IPv6 address goes in brackets"),
    ("[::1:7601", "the IPv6 address has no closing ]"),
    ("[db1]:7601", "'db1' in brackets is not an IPv6 address"),
    ("[::1]7601", "'7601' after the ] is not :PORT"),
])
def test_a_bad_address_is_refused_saying_why(text: str, reason: str) -> None:
    with pytest.raises(ValueError) as e:
        Address.parse(text)
    assert str(e.value) == f"{text!r} is not an address: {reason} (expected HOST:PORT, e.g. 127.0.0.1:7601 " \
                           "or [::1]:7601)"
    with pytest.raises(ConfigError) as c:
        load(StartSettings, {"pg_dsn": "host=x", "safekeepers": f"127.0.0.1:1,{text}", "insecure": True}, None)
    assert "--safekeepers" in str(c.value) and reason in str(c.value)


def test_an_endpoint_may_listen_on_any_free_port() -> None:
    assert parse_listen("127.0.0.1:0") == ("127.0.0.1", 0)
    with pytest.raises(ValueError, match="outside 0-65535"):
        parse_listen("127.0.0.1:65536")
