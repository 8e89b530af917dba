"""Workflow.load(...).run(...) gives the report of `qkvshare run --json`."""
import json
import subprocess

import pytest

import qkvshare as q


def test_run_matches_cli(repo_root, stories, stories_paths, cli, tmp_path):
    path = repo_root / "examples" / "w1_two_agents.yaml"
    wf = q.Workflow.load(str(path))
    assert wf.name == "w1-two-agents" and wf.steps == ["intro", "body"]
    report = wf.run(stories, mode="qkvshare", kv="int8", threads=1, context=512, max_tokens_cap=16)
    out = tmp_path / "run.json"
    subprocess.run([str(cli), "run", str(path), "-m", str(stories_paths[0]), "-t", str(stories_paths[1]),
                    "--threads", "1", "--ctx", "512", "--max-tokens", "16", "--kv", "int8", "-q", "--json",
                    str(out)], check=True, capture_output=True, timeout=180)
    want = json.loads(out.read_text())
    got = report.to_dict()
    assert set(got) == set(want)
    for key in ("workflow", "mode", "kv", "prefill_computed", "prefill_reused", "peak_kv_bytes",
                "contexts_alive_at_end"):
        assert got[key] == want[key], key
    assert [s["output_tokens"] for s in got["steps"]] == [s["output_tokens"] for s in want["steps"]]
    assert report.steps[1].handoff == "continue" and report.steps[1].prefill_reused > 0
    assert report.mode == "qkvshare" and report.prefill_computed == got["prefill_computed"]
    assert json.loads(report.json()) == got


def test_workflow_errors(tmp_path, stories):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nsteps: [{id: a, agent: nobody}]\n")
    with pytest.raises(q.BadWorkflow, match="bad.yaml") as e:
        q.Workflow.load(str(bad))
    assert e.value.code == "bad_workflow"
    with pytest.raises(q.Error, match="missing.yaml"):
        q.Workflow.load(str(tmp_path / "missing.yaml"))
    wf = q.Workflow.parse("name: x\nagents: {a: {prompt: hi, max_tokens: 2}}\nsteps: [{id: s, agent: a}]\n")
    with pytest.raises(q.InvalidArgument, match="sideways"):
        wf.run(stories, mode="sideways")
    with pytest.raises(q.InvalidArgument, match="int9"):
        wf.run(stories, kv="int9")
    with pytest.raises(TypeError):
        wf.run(42)
