"""scripts/fuzz.py: a fixed number of inputs per target finds no crash, and every saved input replays.

tests/fuzz_regressions/ holds inputs the fuzzer saved: crashes (fixed since, or this fails) and, as
audit-*.json, one sequence per rule the audit found broken. A check marked `pending` in CHECKS (a rule
the core does not enforce yet) replays as a strict expected failure, so enforcing it says to clear it.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fuzz.py"
REGRESSIONS = Path(__file__).resolve().parents[1] / "fuzz_regressions"
EXAMPLES = 200  # inputs per target under hypothesis: about 12 s in all
ATHERIS_RUNS = 2000  # libFuzzer runs per byte target


def _load_fuzz():
    spec = importlib.util.spec_from_file_location("walsidecar_fuzz", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


fuzz = _load_fuzz()


def _fuzz(tmp_path: Path, *args: str) -> dict:
    report = tmp_path / "fuzz.json"
    out = subprocess.run([sys.executable, str(SCRIPT), "--seed", "1", "--regressions", str(tmp_path / "found"),
                          "--json", str(report), *args],
                         capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL, check=False)
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr[-4000:]}"
    assert not (tmp_path / "found").exists() or not list((tmp_path / "found").iterdir())
    return json.loads(report.read_text())


def test_fuzzer_finds_no_crash(tmp_path: Path) -> None:
    summary = _fuzz(tmp_path, "--engine", "hypothesis", "--examples", str(EXAMPLES))
    assert summary["crashes"] == 0, summary["crash_errors"]
    assert summary["invalid_input_state_changes_enforced"] == 0, summary["targets"]
    for name in fuzz.TARGETS:
        assert summary["targets"][name]["inputs"] >= EXAMPLES, (name, summary["targets"][name])
    # The sequences got past the greeting into votes, elections and appends.
    assert summary["targets"]["acceptor"]["messages"] > EXAMPLES * 5
    assert summary["targets"]["acceptor"]["messages"] > summary["targets"]["acceptor"]["refused"]


@pytest.mark.skipif(importlib.util.find_spec("atheris") is None, reason="atheris is not installed")
def test_coverage_guided_byte_fuzzing_finds_no_crash(tmp_path: Path) -> None:
    summary = _fuzz(tmp_path, "--engine", "atheris", "--targets", "codec,framing", "--examples", str(ATHERIS_RUNS))
    assert summary["crashes"] == 0, summary["crash_errors"]
    for name in ("codec", "framing"):
        t = summary["targets"][name]
        assert t["engine"] == "atheris" and t["inputs"] >= ATHERIS_RUNS, (name, t)
        assert t["messages"] > 0, "libFuzzer's inputs reach the decoders"


def _saved() -> list[Path]:
    return sorted(REGRESSIONS.glob("*.json"))


@pytest.mark.parametrize("path", _saved(), ids=[p.stem for p in _saved()])
def test_saved_input_replays(path: Path, request: pytest.FixtureRequest) -> None:
    body = json.loads(path.read_text())
    check = fuzz.CHECKS[body["check"]]
    if check.pending:
        request.applymarker(pytest.mark.xfail(reason=f"pending: {check.pending}", strict=True))
    stats = fuzz.replay(path)  # raises on a violation of any enforced check
    assert stats.violations.get(check.name, 0) == 0, f"{check.name}: {stats.examples.get(check.name)}"


def test_pending_checks_all_have_a_saved_example() -> None:
    saved = {json.loads(p.read_text())["check"] for p in _saved()}
    missing = [name for name, c in fuzz.CHECKS.items() if c.pending and name not in saved]
    assert not missing, f"run scripts/fuzz.py --save-pending to save an example of {missing}"


def test_a_crash_is_shrunk_saved_and_replayed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The path a real crash takes, on a core broken on purpose: a vote above term 3 raises KeyError."""
    deliver = fuzz.deliver

    def broken(node, conn, msg, end):  # type: ignore[no-untyped-def]
        if isinstance(msg, fuzz.VoteRequest) and msg.term > 3:
            raise KeyError("broken on purpose")
        return deliver(node, conn, msg, end)

    monkeypatch.setattr(fuzz, "deliver", broken)
    fz = fuzz.Fuzzer(3, regressions=tmp_path)
    try:
        fz.run(("acceptor",), seconds=None, examples=100)
    finally:
        fz.close()
    assert [c.check for c in fz.crashes] == ["only-refusals"]
    saved = sorted(tmp_path.glob("acceptor-*.json"))
    assert len(saved) == 1
    body = json.loads(saved[0].read_text())
    assert "KeyError" in body["error"] and body["check"] == "only-refusals"
    assert len(body["input"]) <= 4, f"shrunk to a greeting and the vote: {body['input']}"
    with pytest.raises(fuzz.Violation, match="only-refusals"):
        fuzz.replay(saved[0])
    monkeypatch.setattr(fuzz, "deliver", deliver)
    assert fuzz.replay(saved[0]).violations == {}, "with the core mended it replays clean"
