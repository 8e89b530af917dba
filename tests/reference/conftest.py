"""Shared pytest fixtures for the Python reference tests (tests/reference/).

Paths come from the environment, mirroring tests/test_paths.cpp:
  QKVSHARE_CLI     the built `qkvshare` binary (required for tests that run it;
                   e.g. build/src/cli/qkvshare). Unset: those tests are skipped, loudly.
  QKVSHARE_DEQUANT_TOOL  the built tests/reference/dequant_tool.cpp (dequantization tests).
  QKVSHARE_MODEL   SmolLM2-135M-Instruct GGUF; else $QKVSHARE_CACHE/SmolLM2-135M-Instruct.Q4_1.gguf,
                   else ~/.cache/qkvshare/models/SmolLM2-135M-Instruct.Q4_1.gguf.
  QKVSHARE_SHARED  the read-only shared folder (models/, data/); default <repo>/../shared.

A missing resource skips the tests that need it with a reason, prints a banner to
stderr at once, and is listed again in a "MISSING RESOURCES" section at the end of
the run, so a skip is never silent. Tests may log measured values through the
`metrics_log` fixture; they are printed in a summary section at the end.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# Single-threaded BLAS for the NumPy reference, set before anything imports
# NumPy: on the 2-core machines, multi-threaded OpenBLAS competing with the
# engine, a build or other tests spin-waits and ran a 69-token SmolLM2 pass
# 10x slower (21 s vs 1.9 s measured under load); on an idle machine one
# thread costs < 2x. Override by exporting OPENBLAS_NUM_THREADS.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

_MISSING: list[str] = []
_METRICS: list[str] = []


def _loud_skip(request, what: str, hint: str):
    msg = f"{what} not found: {hint}"
    if msg not in _MISSING:
        _MISSING.append(msg)
        banner = f"\n*** SKIPPED: {msg} ***\n"
        capman = request.config.pluginmanager.getplugin("capturemanager")
        if capman is not None:
            with capman.global_and_fixture_disabled():
                sys.stderr.write(banner)
                sys.stderr.flush()
        else:
            sys.stderr.write(banner)
    pytest.skip(msg)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if _METRICS:
        terminalreporter.section("reference comparison: measured values")
        for line in _METRICS:
            terminalreporter.write_line(line)
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
    return Path(env) if env else (REPO_ROOT.parent / "shared")


@pytest.fixture(scope="session")
def cli(request) -> Path:
    env = os.environ.get("QKVSHARE_CLI")
    if not env:
        _loud_skip(request, "qkvshare CLI",
                   "set QKVSHARE_CLI to the built binary (e.g. build/src/cli/qkvshare)")
    p = Path(env)
    if not (p.is_file() and os.access(p, os.X_OK)):
        # The variable was set on purpose: a wrong path is an error, not a skip.
        pytest.fail(f"QKVSHARE_CLI={env} is not an executable file")
    return p


@pytest.fixture(scope="session")
def dequant_tool(request) -> Path:
    """tests/reference/dequant_tool.cpp: the scalar reference dequantization of raw blocks."""
    env = os.environ.get("QKVSHARE_DEQUANT_TOOL")
    if not env:
        _loud_skip(request, "qkvshare_dequant_tool",
                   "set QKVSHARE_DEQUANT_TOOL to the built helper (e.g. build/tests/qkvshare_dequant_tool)")
    p = Path(env)
    if not (p.is_file() and os.access(p, os.X_OK)):
        pytest.fail(f"QKVSHARE_DEQUANT_TOOL={env} is not an executable file")
    return p


@pytest.fixture(scope="session")
def smollm2_model(request) -> Path:
    env = os.environ.get("QKVSHARE_MODEL")
    if env:
        p = Path(env)
    else:
        cache = os.environ.get("QKVSHARE_CACHE")
        d = Path(cache) if cache else Path.home() / ".cache" / "qkvshare" / "models"
        p = d / SMOLLM2_FILE
    if not p.is_file():
        _loud_skip(request, f"SmolLM2-135M GGUF ({p})",
                   "run scripts/fetch_model.sh or set QKVSHARE_MODEL")
    return p


@pytest.fixture(scope="session")
def stories260k_model(request, shared_dir) -> Path:
    p = shared_dir / "models" / "stories260K.bin"
    if not p.is_file():
        _loud_skip(request, f"stories260K ({p})", "set QKVSHARE_SHARED to the shared folder")
    return p


@pytest.fixture(scope="session")
def tok512(request, shared_dir) -> Path:
    p = shared_dir / "models" / "tok512.bin"
    if not p.is_file():
        _loud_skip(request, f"tok512 tokenizer ({p})", "set QKVSHARE_SHARED to the shared folder")
    return p


@pytest.fixture(scope="session")
def cli_json(cli):
    """run(*args, timeout=...) -> parsed JSON from `qkvshare ARGS` stdout; fails with stderr."""

    def run(*args, timeout: float = 300):
        cmd = [str(cli), *[str(a) for a in args]]
        r = subprocess.run(cmd, capture_output=True, timeout=timeout)
        if r.returncode != 0:
            pytest.fail(f"{' '.join(cmd)[:300]} exited {r.returncode}:\n"
                        f"{r.stderr.decode(errors='replace')[-4000:]}")
        try:
            return json.loads(r.stdout)
        except json.JSONDecodeError as e:
            pytest.fail(f"{' '.join(cmd)[:300]}: stdout is not JSON ({e}): {r.stdout[:500]!r}")

    return run


@pytest.fixture(scope="session")
def metrics_log():
    """A list; lines appended to it are printed in the terminal summary."""
    return _METRICS
