"""Configuration: flags over the TOML file over WALSIDECAR_* variables, with clear refusals."""

from __future__ import annotations

import fcntl
from pathlib import Path

import pytest

from sidecar.config import CheckSettings, ConfigError, SafekeeperSettings, StartSettings, StatusSettings, load
from support.helpers import walsidecar

SKS = "127.0.0.1:7601,127.0.0.1:7602,127.0.0.1:7603"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    for k in list(os.environ):
        if k.startswith("WALSIDECAR_"):
            monkeypatch.delenv(k)
    # The TLS choice is tested on its own below; elsewhere it is made the short way.
    monkeypatch.setenv("WALSIDECAR_INSECURE", "1")


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_flags_win_over_file_which_wins_over_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = write(tmp_path / "w.toml", f'pg_dsn = "host=file"\nsafekeepers = "{SKS}"\nslot = "fileslot"\n'
                                      "[start]\nwal_buffer = 8\n")
    monkeypatch.setenv("WALSIDECAR_WAL_BUFFER", "3")
    monkeypatch.setenv("WALSIDECAR_APPLICATION_NAME", "from_env")
    monkeypatch.setenv("WALSIDECAR_SLOT", "envslot")
    s = load(StartSettings, {"slot": "flagslot"}, cfg)
    assert isinstance(s, StartSettings)
    assert s.slot == "flagslot"  # flag over file over env
    assert s.wal_buffer == 8  # [start] table over env
    assert s.application_name == "from_env"  # env over default
    assert s.pg_dsn == "host=file"
    assert s.safekeepers == tuple(SKS.split(",")) and s.quorum == 2


def test_environment_alone_is_enough(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WALSIDECAR_PG_DSN", "host=env")
    monkeypatch.setenv("WALSIDECAR_SAFEKEEPERS", SKS)
    monkeypatch.setenv("WALSIDECAR_ALLOW_PRIMARY_MISMATCH", "true")
    monkeypatch.setenv("WALSIDECAR_QUORUM_WAIT_ALERT", "2.5")
    s = load(StartSettings, {}, None)
    assert isinstance(s, StartSettings)
    assert s.allow_primary_mismatch is True and s.quorum_wait_alert == 2.5 and len(s.safekeepers) == 3


def test_toml_list_of_safekeepers_and_shared_keys(tmp_path: Path) -> None:
    cfg = write(tmp_path / "w.toml", 'pg_dsn = "host=x"\nsafekeepers = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]\n'
                                      'proposer_metrics = "127.0.0.1:9187"\ndata_dir = "/unused/by/check"\n')
    s = load(CheckSettings, {}, cfg)
    assert isinstance(s, CheckSettings) and s.proposer_metrics == "127.0.0.1:9187" and len(s.safekeepers) == 3
    st = load(StatusSettings, {}, cfg)
    assert isinstance(st, StatusSettings) and st.pg_dsn == "host=x"


@pytest.mark.parametrize("text, message", [
    ('pg_dsn = "x"\nsafekeepers = "127.0.0.1:1"\nwal_bufer = 3\n', "unknown option 'wal_bufer'"),
    ('[start]\nlisten = "127.0.0.1:1"\n', "`walsidecar start` has no such option"),
    ('pg_dsn = "x\n', "is not valid TOML"),
    ('pg_dsn = "x"\nsafekeepers = "127.0.0.1:1,127.0.0.1:1"\n', "listed twice"),
    ('pg_dsn = "x"\nsafekeepers = "127.0.0.1:1,127.0.0.1:2,127.0.0.1:3"\n[start]\nquorum = 1\n',
     "two quorums must intersect"),
    ('pg_dsn = "x"\nsafekeepers = "127.0.0.1:1"\n[start]\nmetrics = "nowhere"\n', "expected HOST:PORT"),
])
def test_bad_files_are_refused_with_the_reason(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load(StartSettings, {}, write(tmp_path / "w.toml", text))


def test_errors_name_the_source_of_the_bad_value(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WALSIDECAR_ID", "zero")
    with pytest.raises(ConfigError) as e:
        load(SafekeeperSettings, {"data_dir": str(tmp_path)}, None)
    assert "WALSIDECAR_ID = 'zero'" in str(e.value)
    cfg = write(tmp_path / "w.toml", "[safekeeper]\nid = 0\n")
    with pytest.raises(ConfigError) as e:
        load(SafekeeperSettings, {"data_dir": str(tmp_path)}, cfg)
    assert f"id in {cfg}" in str(e.value) and "greater than or equal to 1" in str(e.value)
    with pytest.raises(ConfigError, match="data_dir is required: give --data-dir"):
        load(SafekeeperSettings, {"id": 1}, None)


def test_command_line_uses_config_file_and_environment(tmp_path: Path) -> None:
    cfg = write(tmp_path / "w.toml", f'pg_dsn = "host=127.0.0.1"\nsafekeepers = "{SKS}"\n[start]\nquorum = 1\n')
    out = walsidecar("start", "--config", str(cfg), "--insecure")
    assert out.returncode == 2 and "quorum in" in out.stderr and "two quorums must intersect" in out.stderr
    out = walsidecar("start", "--config", str(cfg), "--quorum", "9", "--insecure")
    assert out.returncode == 2 and "--quorum = 9" in out.stderr
    out = walsidecar("safekeeper", env={"WALSIDECAR_ID": "1", "WALSIDECAR_DATA_DIR": str(tmp_path / "sk"),
                                        "WALSIDECAR_LISTEN": "nowhere", "WALSIDECAR_INSECURE": "1"})
    assert out.returncode == 2 and "WALSIDECAR_LISTEN = 'nowhere'" in out.stderr
    out = walsidecar("status", env={"WALSIDECAR_INSECURE": "1", "WALSIDECAR_DIR": str(tmp_path / "no-up")})
    assert out.returncode == 2 and "nothing to ask" in out.stderr


def test_every_command_and_option_has_help() -> None:
    import click

    from sidecar.cli import main
    for name, cmd in main.commands.items():
        assert cmd.help, name
        for param in cmd.params:
            if isinstance(param, click.Option):
                assert param.help, f"walsidecar {name} {param.opts[0]} has no help text"
    for cmd in ("check", "status", "init-postgres"):
        out = walsidecar(cmd, "--help")
        assert out.returncode == 0 and "--config" in out.stdout, (cmd, out.stderr)


def test_certificates_or_insecure_must_be_chosen(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WALSIDECAR_INSECURE")
    base = {"pg_dsn": "host=x", "safekeepers": SKS}
    for cls, flags in ((StartSettings, base), (CheckSettings, base), (StatusSettings, base),
                       (SafekeeperSettings, {"id": 1, "data_dir": str(tmp_path)})):
        with pytest.raises(ConfigError) as e:
            load(cls, flags, None)
        assert "walsidecar certs create-ca --ca-dir CA" in str(e.value) and "--insecure" in str(e.value)
        with pytest.raises(ConfigError, match="not both"):
            load(cls, {**flags, "insecure": True, "certs_dir": str(tmp_path)}, None)
        assert load(cls, {**flags, "certs_dir": str(tmp_path)}, None).certs_dir == tmp_path  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match="--role safekeeper --id N"):
        load(SafekeeperSettings, {"id": 1, "data_dir": str(tmp_path)}, None)
    # The TOML file and the environment say it too.
    cfg = write(tmp_path / "w.toml", f'pg_dsn = "x"\nsafekeepers = "{SKS}"\ninsecure = true\n')
    assert load(StartSettings, {}, cfg).insecure is True  # type: ignore[attr-defined]
    cfg = write(tmp_path / "c.toml", f'pg_dsn = "x"\nsafekeepers = "{SKS}"\n[check]\ncerts_dir = "{tmp_path}"\n')
    assert load(CheckSettings, {}, cfg).certs_dir == tmp_path  # type: ignore[attr-defined]
    monkeypatch.setenv("WALSIDECAR_INSECURE", "1")
    assert load(StatusSettings, base, None).insecure is True  # type: ignore[attr-defined]


@pytest.mark.parametrize("given, line", [
    ("", "--safekeepers = '': empty: give --safekeepers HOST:PORT,..."),
    ("x", "--safekeepers = 'x': 'x' is not an address: no port (expected HOST:PORT, e.g. 127.0.0.1:7601 or "
          "[::1]:7601)"),
    ("127.0.0.1:1,,127.0.0.1:2", "--safekeepers = '127.0.0.1:1,,127.0.0.1:2': an empty item between commas (or at "
                                 "an end): separate the items with single commas"),
    ("127.0.0.1:1,", "--safekeepers = '127.0.0.1:1,': an empty item between commas (or at an end): separate the "
                     "items with single commas"),
])
def test_a_malformed_safekeepers_list_gets_one_line(given: str, line: str) -> None:
    with pytest.raises(ConfigError) as e:
        load(CheckSettings, {"pg_dsn": "host=x", "safekeepers": given}, None)
    assert str(e.value).splitlines() == ["invalid configuration for `walsidecar check`:", "  " + line]


def test_an_empty_required_value_says_what_to_give(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WALSIDECAR_SAFEKEEPERS", "")
    with pytest.raises(ConfigError) as e:
        load(StartSettings, {"pg_dsn": ""}, None)
    assert sorted(str(e.value).splitlines()[1:]) == ["  --pg-dsn = '': empty: give --pg-dsn DSN",
                                                     "  WALSIDECAR_SAFEKEEPERS = '': empty: give --safekeepers "
                                                     "HOST:PORT,..."]


def test_certs_dir_with_insecure_names_where_each_came_from(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WALSIDECAR_INSECURE")
    cfg = write(tmp_path / "w.toml", f'proposer_metrics = "127.0.0.1:7610"\ncerts_dir = "{tmp_path}/certs"\n')
    with pytest.raises(ConfigError) as e:
        load(StatusSettings, {"insecure": True}, cfg)
    assert str(e.value).splitlines()[1] == (f"  certs_dir in {cfg} = '{tmp_path}/certs': cannot be used with --insecure: "
                                            "give either --certs-dir or --insecure, not both")
    monkeypatch.setenv("WALSIDECAR_INSECURE", "1")
    with pytest.raises(ConfigError, match=f"certs_dir in {cfg} = .*: cannot be used with WALSIDECAR_INSECURE:"):
        load(StatusSettings, {}, cfg)


def test_bare_status_and_check_point_at_a_running_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    up = tmp_path / "up"
    up.mkdir()
    (up / "walsidecar.toml").write_text("")
    monkeypatch.setenv("WALSIDECAR_DIR", str(up))
    with open(up / "up.pid", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running `up` holds it
        for cls, command in ((StatusSettings, "status"), (CheckSettings, "check")):
            with pytest.raises(ConfigError) as e:
                load(cls, {}, None)
            assert str(e.value) == (f"no --config given: a running `walsidecar up` has one: "
                                    f"walsidecar {command} --config {up}/walsidecar.toml")
        # Options given: they are what is wrong, not the missing --config.
        with pytest.raises(ConfigError, match="nothing to ask"):
            load(StatusSettings, {"insecure": True}, None)
    # The `up` has stopped: its file is no pointer any more.
    with pytest.raises(ConfigError, match="nothing to ask"):
        load(StatusSettings, {}, None)


def test_one_node_file_configures_the_sidecar_the_gate_and_the_follower(tmp_path: Path) -> None:
    """`up --ha` writes one walsidecar.toml per node: start reads its top level, failover-gate and follow-leader
    their tables as well; the gate's standby is its own node, and it must be named."""
    from sidecar.config import FailoverGateSettings, FollowLeaderSettings
    cfg = write(tmp_path / "node1.toml", 'pg_dsn = "host=127.0.0.1 port=5432"\nsafekeepers = "a:1,b:2,c:3"\n'
                "insecure = true\n[failover-gate]\nstandby_dsn = \"host=127.0.0.1 port=5432\"\n"
                'safekeeper_readers = "a:11,b:12,c:13"\ntimeout = 5\n'
                f'[follow-leader]\npatroni_url = "http://127.0.0.1:8008"\nsidecar_config = "{tmp_path}/node1.toml"\n')
    start = load(StartSettings, {}, cfg)
    gate = load(FailoverGateSettings, {}, cfg)
    follow = load(FollowLeaderSettings, {}, cfg)
    assert start.pg_dsn == gate.standby_dsn and gate.quorum == 2 and gate.timeout == 5  # type: ignore[attr-defined]
    assert [str(a) for a in gate.safekeeper_readers] == ["a:11", "b:12", "c:13"]  # type: ignore[attr-defined]
    assert follow.sidecar_config == cfg  # type: ignore[attr-defined]
    no_standby = write(tmp_path / "bare.toml", 'safekeepers = "a:1,b:2,c:3"\ninsecure = true\n')
    with pytest.raises(ConfigError, match="standby_dsn"):
        load(FailoverGateSettings, {}, no_standby)
