"""The Grafana dashboard and Prometheus rules shipped in docker/, and the metric names they use."""

from __future__ import annotations

import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "docker" / "grafana" / "walsidecar-dashboard.json"
RULES = ROOT / "docker" / "prometheus" / "walsidecar-alerts.yml"
PROMETHEUS = ROOT / "docker" / "prometheus" / "prometheus.yml"



def dashboard_exprs() -> list[str]:
    doc = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in doc["panels"] for t in p["targets"]]


def referenced_metrics() -> set[str]:
    """Every walsidecar_* name the dashboard and the rules use, without histogram/counter suffixes."""
    text = "\n".join(dashboard_exprs()) + RULES.read_text()
    names = set(re.findall(r"\bwalsidecar_[a-z_]+", text))
    return {re.sub(r"_(bucket|count|sum|total)$", "", n) for n in names}
