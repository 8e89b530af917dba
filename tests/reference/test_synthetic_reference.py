"""Every weight type and architecture against the NumPy/gguf reference.

`qkvshare make-model` writes small random-weight files of each architecture
(tiny-llama, tiny-qwen2, tiny-qwen3 with heads wider than d_model / n_heads,
tiny-phi3 with fused tensors, tiny-gemma3 with its 8-token sliding window
crossed by the 16 test tokens and RoPE scaling on its global layer) in each
weight type; the engine's logits
(`--exact-matmul`: float activations) must match numpy_llama's float64
forward pass over the gguf package's dequantization at the f32 profile of
test_logits_reference.py, in one batched pass and token by token.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy_llama  # noqa: E402
from test_logits_reference import PROFILES, compare_logits  # noqa: E402

IDS = [3, 141, 59, 265, 35, 89, 79, 323, 84, 62, 64, 338, 327, 95, 2, 88]
NEW_TYPES = ["Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "IQ4_NL", "IQ4_XS"]
CASES = ([("tiny-qwen3", t) for t in NEW_TYPES + ["Q6_K", "Q8_0", "F16"]]
         + [("tiny-llama", t) for t in ["Q5_0", "IQ4_NL", "Q4_K"]]  # 64 wide: k-quants fall back to 32-blocks
         + [("tiny-qwen2", "Q5_1"), ("tiny-phi3", "Q4_K"), ("tiny-phi3", "Q8_0")]
         + [("tiny-gemma3", t) for t in ["F16", "Q8_0", "Q4_K"]])


@pytest.fixture(scope="module")
def made(tmp_path_factory, cli):
    out = {}

    def make(shape, qtype):
        if (shape, qtype) not in out:
            path = tmp_path_factory.mktemp("synthetic") / f"{shape}-{qtype}.gguf"
            subprocess.run([str(cli), "make-model", "--shape", shape, "--type", qtype, "-o", str(path),
                            "--seed", "5"], check=True, capture_output=True, timeout=120)
            out[(shape, qtype)] = path
        return out[(shape, qtype)]

    return make


@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("shape,qtype", CASES, ids=[f"{s}-{t}" for s, t in CASES])
def test_synthetic_logits_match_reference(made, cli_json, metrics_log, shape, qtype, mode):
    tol = PROFILES["f32"]
    path = made(shape, qtype)
    ref = numpy_llama.load_model(path).logits(IDS)
    args = ["logits", "-m", path, "--ids", ",".join(map(str, IDS)), *tol["flags"]]
    if mode == "decode":
        args.append("--decode")
    ours = np.asarray(cli_json(*args)["logits"], dtype=np.float64)
    assert ours.shape == ref.shape
    r = compare_logits(ref, ours, tol)
    line = (f"[f32] synthetic {shape} {qtype} {mode}: max rel {r['rel'].max():.2e}, "
            f"max KL {r['kl'].max():.2e}, argmax equal {r['argmax_equal']:.2f}")
    metrics_log.append(line)
    assert r["finite"], line
    assert r["rel"].max() <= tol["max_rel"], line
    assert r["kl"].max() <= tol["kl_max"], line
    assert not r["bad_argmax"], line
