"""examples/langgraph_team.py against a live server: the later agents' requests report cached tokens."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import smollm2_path

ROOT = Path(__file__).resolve().parents[2]


def test_langgraph_team_reuses_kv(make_server):
    pytest.importorskip("langgraph")
    pytest.importorskip("langchain_openai")
    model = smollm2_path()
    if model is None:
        print("*** SmolLM2 not found: running the LangGraph team on stories260K ***", file=sys.stderr)
        s = make_server("--kv", "int8")
    else:
        s = make_server("--kv", "int8", "--ctx", "2048", model=[model])
    out = subprocess.run([sys.executable, str(ROOT / "examples/langgraph_team.py"), "--base-url", s.url + "/v1",
                          "--max-tokens", "32"], capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["agent"] for r in records] == ["researcher", "writer", "reviewer"]
    assert records[0]["cached_tokens"] == 0
    for earlier, later in zip(records, records[1:]):
        # the later agent's prompt begins with the earlier one's prompt and reply: at least the prompt is reused
        assert later["cached_tokens"] >= earlier["prompt_tokens"] // 32 * 32 > 0, records
        assert later["cached_tokens"] < later["prompt_tokens"]
