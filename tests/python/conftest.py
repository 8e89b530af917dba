"""Fixtures for the Python package tests (tests/python/).

The package must be installed (`pip install .`; scripts/test.sh does it in a fresh
venv, build-python/venv). Paths come from the environment, as for tests/reference:
  QKVSHARE_CLI     the built `qkvshare` binary (tests comparing with the CLI);
  QKVSHARE_MODEL   SmolLM2-135M-Instruct GGUF (else the default cache path);
  QKVSHARE_SHARED  the shared folder with models/stories260K.bin and tok512.bin.
A missing resource skips the tests that need it with the reason printed at once
and again at the end of the run, never silently.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
_MISSING: list[str] = []


def _loud_skip(request, what: str, hint: str):
    msg = f"{what} not found: {hint}"
    if msg not in _MISSING:
        _MISSING.append(msg)
        capman = request.config.pluginmanager.getplugin("capturemanager")
        if capman is not None:
            with capman.global_and_fixture_disabled():
                sys.stderr.write(f"\n*** SKIPPED: {msg} ***\n")
    pytest.skip(msg)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _MISSING:
        terminalreporter.section("MISSING RESOURCES (tests skipped)", sep="!", red=True, bold=True)
        for line in _MISSING:
            terminalreporter.write_line("*** " + line, red=True, bold=True)


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    env = os.environ.get("QKVSHARE_SHARED")
    return Path(env) if env else REPO_ROOT.parent / "shared"


@pytest.fixture(scope="session")
def stories_paths(request, shared_dir):
    m, t = shared_dir / "models" / "stories260K.bin", shared_dir / "models" / "tok512.bin"
    if not (m.is_file() and t.is_file()):
        _loud_skip(request, f"stories260K ({m})", "set QKVSHARE_SHARED to the shared folder")
    return m, t


@pytest.fixture(scope="session")
def stories(stories_paths):
    import qkvshare

    m, t = stories_paths
    return qkvshare.Model.load(str(m), str(t))


@pytest.fixture(scope="session")
def engine(stories):
    import qkvshare

    return qkvshare.Engine(stories, threads=1)


@pytest.fixture(scope="session")
def smollm2_path(request) -> Path:
    env = os.environ.get("QKVSHARE_MODEL")
    if env:
        p = Path(env)
    else:
        cache = os.environ.get("QKVSHARE_CACHE")
        p = (Path(cache) if cache else Path.home() / ".cache" / "qkvshare" / "models") / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not p.is_file():
        _loud_skip(request, f"SmolLM2-135M GGUF ({p})", "run scripts/fetch_model.sh or set QKVSHARE_MODEL")
    return p


@pytest.fixture(scope="session")
def cli(request) -> Path:
    env = os.environ.get("QKVSHARE_CLI")
    if not env:
        _loud_skip(request, "qkvshare CLI", "set QKVSHARE_CLI to the built binary (e.g. build/src/cli/qkvshare)")
    p = Path(env)
    if not (p.is_file() and os.access(p, os.X_OK)):
        pytest.fail(f"QKVSHARE_CLI={env} is not an executable file")
    return p
