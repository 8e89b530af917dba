"""Fixtures for the HTTP tests of `qkvshare serve`: servers on 127.0.0.1 with
a free port (--port 0, read back from the first stdout line), stopped with
SIGTERM and a bounded wait."""
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

CLI = os.environ.get("QKVSHARE_CLI", str(Path(__file__).resolve().parents[2] / "build/src/cli/qkvshare"))
SHARED = Path(os.environ.get("QKVSHARE_SHARED", Path(__file__).resolve().parents[2] / "../shared"))
STORIES = [str(SHARED / "models/stories260K.bin"), "-t", str(SHARED / "models/tok512.bin")]


def smollm2_path():
    p = os.environ.get("QKVSHARE_MODEL") or str(Path.home() / ".cache/qkvshare/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    return p if Path(p).exists() else None


class Server:
    def __init__(self, *args, model=None, env=None):
        model = model or STORIES
        cmd = [CLI, "serve", "-m", *model, "--port", "0", "--threads", "1", *args]
        # stderr (one log line per request) goes to a file: a pipe nobody reads would fill and block the server.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, **(env or {})})
        line = self.proc.stdout.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        if not m:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"server did not start: {line!r} {self.read_log()}")
        self.port = int(m.group(1))
        self.url = f"http://127.0.0.1:{self.port}"
        self.stderr = ""

    def read_log(self):
        self.log.seek(0)
        return self.log.read()

    def metrics(self):
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def wait_idle(self, timeout=20):
        deadline = time.time() + timeout
        while time.time() < deadline:
            m = self.metrics()
            if m.get("qkvshare_sessions_active", 0) == 0 and m.get("qkvshare_queue_depth", 0) == 0:
                return m
            time.sleep(0.05)
        raise AssertionError("the server did not become idle")

    def stop(self, timeout=30):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        self.stderr = self.read_log()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server():
    s = Server("--kv", "int8")
    yield s
    assert s.stop() == 0, s.stderr


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # Keeps each phase's report on the test, so a fixture's teardown can tell whether the test failed.
    outcome = yield
    report = outcome.get_result()
    setattr(item, "report_" + report.when, report)


@pytest.fixture
def make_server(request):
    started = []

    def make(*args, **kw):
        s = Server(*args, **kw)
        started.append(s)
        return s

    yield make
    failed = getattr(request.node, "report_call", None) is not None and request.node.report_call.failed
    for s in started:
        exited = s.proc.poll()  # before stop(): a server that died by itself shows how
        s.stop()
        if failed:
            # A failure that is hard to reproduce (a reset connection, a crash) is diagnosed from here.
            tail = "\n".join(s.stderr.splitlines()[-40:])
            print(f"server on port {s.port}: {'still running' if exited is None else f'had exited with {exited}'}; "
                  f"the last lines of its log:\n{tail}", file=sys.stderr)
