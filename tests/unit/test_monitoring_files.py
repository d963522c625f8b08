"""The Grafana dashboard and Prometheus rules shipped in docker/ parse, and promtool accepts them."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from support.monitoring import PROMETHEUS, RULES, dashboard_exprs

def test_files_parse() -> None:
    assert len(dashboard_exprs()) > 10
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    assert {"WalsidecarQuorumLost", "WalsidecarCommitAckSlow", "WalsidecarSlotWalAtRisk",
            "WalsidecarSafekeeperLagging"} <= {r["alert"] for r in rules}
    assert all(r["annotations"]["summary"] for r in rules)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian package prometheus) not installed")
def test_promtool_accepts_rules_config_and_dashboard_queries(tmp_path: Path) -> None:
    for args in (["check", "rules", str(RULES)], ["check", "config", str(PROMETHEUS)]):
        out = subprocess.run(["promtool", *args], capture_output=True, text=True)
        assert out.returncode == 0, out.stdout + out.stderr
    # Dashboard queries, with Grafana's variables filled in, as recording rules.
    rules = [{"record": f"dashboard:q{i}",
              "expr": e.replace("$__rate_interval", "1m").replace("$proposer", ".*").replace("$safekeeper", ".*")}
             for i, e in enumerate(dashboard_exprs())]
    path = tmp_path / "dashboard-rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    out = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
