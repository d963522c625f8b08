"""scripts/demo.sh's report of a failed run: the log lines that carry the cause, from every log it keeps."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

DEMO = Path(__file__).resolve().parents[2] / "scripts" / "demo.sh"


def show_causes(directory: Path) -> str:
    """The demo's own show_causes, run on `directory` as the demo's DIR."""
    script = DEMO.read_text()
    function = re.search(r"^CAUSE=.*?^}\n", script, re.S | re.M)
    assert function is not None, "demo.sh has no show_causes"
    out = subprocess.run(["bash", "-c", function.group(0) + "show_causes"], capture_output=True, text=True,
                         timeout=30, env={"DIR": str(directory), "UP_LOG": str(directory / "up.log"),
                                          "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    return out.stderr


def test_a_failed_demo_prints_the_refusals_and_errors_not_the_noise(tmp_path: Path) -> None:
    refusal = ("FATAL:  could not start WAL streaming: ERROR:  requested WAL at 0/3000000 is not stored here "
               "(this safekeeper holds WAL from 0/A000000)")
    (tmp_path / "standby.log").write_text(
        "2026-11-27 04:50:02.463 UTC [6909] [unknown] FATAL:  the database system is starting up\n"
        f"2026-11-27 04:50:04.703 UTC [6998] {refusal}\n"
        "2026-11-27 04:50:04.703 UTC [6998] LOG:  waiting for WAL to become available\n")
    (tmp_path / "safekeeper1.log").write_text(
        "2026-11-27T04:47:43Z [info     ] reader connected\n"
        "2026-11-27T04:47:43Z [warning  ] reader refused  reason='requested WAL at 0/3000000 is not stored here'\n")
    (tmp_path / "failover.out").write_text("3/5 catch up\nfailover stopped: not promoting: the standby stopped\n")
    out = show_causes(tmp_path)
    assert out.startswith("demo: FAILED; the lines of its logs that carry the cause:")
    assert f"  standby.log: 2026-11-27 04:50:04.703 UTC [6998] {refusal}" in out
    assert "safekeeper1.log: " in out and "reader refused" in out
    assert "  failover.out: failover stopped: not promoting" in out
    assert "starting up" not in out and "waiting for WAL" not in out and "reader connected" not in out
