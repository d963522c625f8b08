"""A Spark session bound to 127.0.0.1 with the UI off, and a console progress bar for its stages."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self, TextIO

import sidecar
from sidecar.wal.jit import cache_dir

DEFAULT_MASTER = "local[*]"

# Loopback only, no web UI, no JVM progress bar (ours reports per stage), UTC timestamps.
BASE_CONF: dict[str, str] = {
    "spark.driver.host": "127.0.0.1",
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.shuffle.partitions": "8",
}


def parse_conf(pairs: tuple[str, ...] | list[str]) -> dict[str, str]:
    """KEY=VALUE strings from --conf options."""
    conf: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--conf expects KEY=VALUE, got {pair!r}")
        conf[key.strip()] = value
    return conf


def _prepare_environment() -> None:
    """Environment the JVM and its Python workers inherit; set before the JVM starts."""
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    # Workers must run this interpreter and import this copy of sidecar, not whatever else is installed.
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    # Workers load the compiled WAL decoder from the cache the driver uses (see sidecar/wal/jit.py).
    numba_cache = cache_dir()
    if numba_cache is not None:
        os.environ.setdefault("NUMBA_CACHE_DIR", numba_cache)
    root = str(Path(sidecar.__file__).resolve().parent.parent)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if root not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])


@contextmanager
def spark_session(
    master: str = DEFAULT_MASTER,
    conf: Mapping[str, str] | None = None,
    *,
    ui: bool = False,
    app_name: str = "walsidecar",
) -> Iterator[Any]:
    """A SparkSession for the analytics commands; one already running in this process is reused and left running."""
    _prepare_environment()
    from pyspark.sql import SparkSession

    existing = SparkSession.getActiveSession()
    if existing is not None:
        yield existing
        return
    settings = dict(BASE_CONF)
    if ui:
        settings["spark.ui.enabled"] = "true"
    settings.update(conf or {})
    builder = SparkSession.builder.master(master).appName(app_name)
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    try:
        yield spark
    finally:
        spark.stop()


class StageProgress:
    """Draws a progress bar for the running Spark stages on a stream, from the status tracker, until stopped.

    With stream None it draws nothing.
    """

    def __init__(self, spark: Any, stream: TextIO | None, interval: float = 0.25) -> None:
        self.tracker = spark.sparkContext.statusTracker()
        self.stream = stream
        self.interval = interval
        self.label = "spark"
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="spark-progress", daemon=True)
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._shown = ""
        self._last_print = 0.0

    def __enter__(self) -> Self:
        if self.stream is not None:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        self._finish()

    def step(self, label: str) -> None:
        """Name the work the next stages belong to; closes the bar of the previous step."""
        self._finish()
        self.label = label

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._draw()

    def _bar(self) -> str:
        done = total = 0
        for stage_id in self.tracker.getActiveStageIds():
            info = self.tracker.getStageInfo(stage_id)
            if info is not None:
                done += info.numCompletedTasks
                total += info.numTasks
        if total == 0:
            return ""
        width = 30
        filled = width * done // total
        return f"{self.label}: [{'#' * filled}{'.' * (width - filled)}] {done}/{total} tasks"

    def _draw(self) -> None:
        assert self.stream is not None
        with self._lock:
            line = self._bar()
            if not line or line == self._shown:
                return
            if self._tty:
                self.stream.write("\r" + line.ljust(len(self._shown)))
            elif time.monotonic() - self._last_print >= 2:
                # Not a terminal (a log, CI): a line now and then instead of redrawing one.
                self.stream.write(line + "\n")
                self._last_print = time.monotonic()
            else:
                return
            self.stream.flush()
            self._shown = line

    def _finish(self) -> None:
        with self._lock:
            if self._shown and self.stream is not None:
                done = f"{self.label}: done"
                self.stream.write(("\r" + done.ljust(len(self._shown)) if self._tty else done) + "\n")
                self.stream.flush()
            self._shown = ""
