"""Compare the C++ engine's forward pass with the independent NumPy reference.

For each (model, prompt): token ids come from `qkvshare tokenize` (so this file
tests the forward pass, not the tokenizer); the engine's logits at every
position, from one batched prefill and from token-by-token decode
(`qkvshare logits [--decode]`), are compared with numpy_llama's float64
logits; and a 32-token greedy continuation (`qkvshare generate --temp 0
--ignore-eos --json`) is compared with numpy_llama's greedy on the same
prompt ids.

Metric per position (ref = reference logits row, ours = engine row):
  rel  = max|ours - ref| / std(ref)      (scale-free worst-case error)
  KL   = KL(softmax(ref) || softmax(ours))
  argmax(ours) == argmax(ref) wherever the reference's top-2 margin exceeds
  `tie` * std(ref) (a near-tie may legitimately flip).
Greedy: the id sequences must be identical; the only allowed divergence is at
a step where the reference itself rates the engine's pick within `greedy_gap`
* std of its own pick (a near-tie; in the f32 profile that is 2 * max_rel, what
the logit bound permits); comparison stops there, and the run reports it.

Every check runs under two tolerance profiles (README.md gives the measurements):
  f32   the engine with --exact-matmul: float32 with float activations, so
        it must agree with the float64 reference to rounding, greedy included;
  q8act the engine as it runs by default, rounding matmul inputs to 8 bits
        (llama.cpp style): bounded differences, near-ties may flip.
QKVSHARE_REF_PROFILE=f32|q8act runs one of them only.
Measured values are printed in the terminal summary of every run.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import numpy_llama  # noqa: E402

PROFILES = {
    # Engine today (float32, float activations), measured: rel <= 1.6e-5,
    # KL <= 4e-11 on SmolLM2; rel <= 1.3e-6 on stories260K (README.md). A numpy
    # float32 forward gives the same (rel <= 4e-5). The bounds leave ~100x room
    # for other summation orders / SIMD / fast exp, yet catch subtle bugs: an
    # RMSNorm eps of 1e-6 instead of 1e-5 gives rel 8e-3, a 1% scale error in
    # one layer's ffn_down gives rel 5e-2.
    "f32": dict(max_rel=2e-3, kl_max=1e-5, kl_mean=1e-6, tie=1e-3, greedy_gap=4e-3, flags=["--exact-matmul"]),
    # Engine rounding every matmul input to 8 bits per block of 32 (llama.cpp
    # style). Sized with numpy_llama's act_q8 simulation vs float64 on these
    # prompts: rel <= 0.57, KL <= 0.052 (mean <= 7e-3), argmax flips only at
    # reference margins <= 0.024 std, greedy divergence at gaps <= 0.024 std.
    # SmolLM2 has outlier channels that crush the other 31 values of their
    # block, hence the large rel. This profile still catches a wrong rope theta
    # (rel 2.8, mean KL 0.08) or GQA mapping, but not an eps slip.
    "q8act": dict(max_rel=1.5, kl_max=0.15, kl_mean=0.02, tie=0.25, greedy_gap=0.25, flags=[]),
}
_ONLY = os.environ.get("QKVSHARE_REF_PROFILE", "")
if _ONLY and _ONLY not in PROFILES:
    raise RuntimeError(f"QKVSHARE_REF_PROFILE={_ONLY!r}: expected one of {sorted(PROFILES)}")
PROFILE_NAMES = [_ONLY] if _ONLY else list(PROFILES)

N_GREEDY = 32

SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
USER_Q = "What is the capital of France?"
CHATML = (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
          f"<|im_start|>user\n{USER_Q}<|im_end|>\n<|im_start|>assistant\n")

# (model, case id, prompt text, tokenize with --parse-special, generate args)
CASES = [
    ("smollm2", "plain-fox", "The quick brown fox jumps over the lazy dog.", False, None),
    ("smollm2", "plain-story",
     "Once upon a time, in a small village by the sea, there lived an old fisherman who",
     False, None),
    ("smollm2", "chatml", CHATML, True, ["-p", USER_Q, "--chat"]),
    ("stories260k", "once", "Once upon a time", False, None),
    ("stories260k", "lily", "Lily and her dog went to the park. They played with a ball", False, None),
]
CASE_IDS = [f"{m}-{c}" for m, c, *_ in CASES]

LLAMA2C_REFERENCE = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the "
    "park. One day, she saw a big, red ball. She wanted to play with it, but it was too high.\n"
    "Lily's mom said, \"Lily, let's go to the park.\" Lily was sad and didn't know what to do. "
    "She said, \"I want to play with your ball, but I can't find it.\"\n"
    "Lily was sad and didn't know what to do. She said, \"I'm sorry, Lily. I didn't know what "
    "to do.\"\n"
    "Lily didn't want to help her mom, so she said, \"I'm sorry, mom. I didn't know what to "
    "do.\" Her mom said, \"Don't worry, Lily. We can help you.")


# ---- fixtures / helpers -------------------------------------------------------

@pytest.fixture(scope="module")
def ref_cache():
    """In-process cache: dequantized reference models, ids and reference logits."""
    return {}


def _model_setup(request, name):
    """(cli args, BOS prefix for logits, model path) for a model name; skips if absent."""
    if name == "smollm2":
        path = request.getfixturevalue("smollm2_model")
        return ["-m", path], [], path  # SmolLM2: add_bos_token is false
    path = request.getfixturevalue("stories260k_model")
    tok = request.getfixturevalue("tok512")
    return ["-m", path, "-t", tok], [1], path  # llama2.c: BOS=1 always prepended


def _ref_model(ref_cache, path):
    key = ("model", str(path))
    if key not in ref_cache:
        t0 = time.perf_counter()
        ref_cache[key] = numpy_llama.load_model(path)
        ref_cache[("load_s", str(path))] = time.perf_counter() - t0
    return ref_cache[key]


def _log_softmax(x):
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def compare_logits(ref: np.ndarray, ours: np.ndarray, tol: dict) -> dict:
    ref = np.asarray(ref, dtype=np.float64)
    ours = np.asarray(ours, dtype=np.float64)
    std = ref.std(axis=-1)
    rel = np.abs(ours - ref).max(axis=-1) / std
    lr, lo = _log_softmax(ref), _log_softmax(ours)
    kl = (np.exp(lr) * (lr - lo)).sum(axis=-1)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    margin = (top2[:, 1] - top2[:, 0]) / std
    am_ref, am_ours = ref.argmax(-1), ours.argmax(-1)
    bad_argmax = [int(i) for i in np.nonzero((am_ref != am_ours) & (margin > tol["tie"]))[0]]
    return dict(rel=rel, kl=kl, margin=margin, argmax_equal=float((am_ref == am_ours).mean()),
                bad_argmax=bad_argmax, finite=bool(np.isfinite(ours).all()))


def _case_ids(request, cli_json, ref_cache, model, case, text, special):
    args, bos, path = _model_setup(request, model)
    key = ("ids", model, case)
    if key not in ref_cache:
        out = cli_json("tokenize", *args, "-p", text, *(["--parse-special"] if special else []))
        ids = [int(i) for i in out["ids"]]
        assert ids, "tokenize returned no ids"
        ref_cache[key] = bos + ids
    return args, path, ref_cache[key]


# ---- the reference validates itself -------------------------------------------

def test_reference_reproduces_llama2c(stories260k_model, tok512, metrics_log):
    """numpy_llama + a port of run.c's encode reproduce llama2.c's greedy output
    (shared/models/README.md): 256 tokens counting the prompt, BOS prepended."""
    tok = numpy_llama.Llama2cTokenizer(tok512)
    model = numpy_llama.load_model(stories260k_model)
    ids = tok.encode("Once upon a time", bos=True)
    assert ids == [1, 403, 407, 261, 378]
    gen = model.greedy(ids, 256 - (len(ids) - 1))
    text = tok.decode(ids[1:] + gen)
    assert text == LLAMA2C_REFERENCE
    metrics_log.append(f"[reference] stories260K greedy reproduces llama2.c run.c "
                       f"({len(gen)} tokens)")


# ---- engine vs reference ------------------------------------------------------

@pytest.mark.parametrize("profile", PROFILE_NAMES)
@pytest.mark.parametrize("mode", ["prefill", "decode"])
@pytest.mark.parametrize("model,case,text,special,gen_args", CASES, ids=CASE_IDS)
def test_logits_match_reference(request, cli_json, ref_cache, metrics_log,
                                model, case, text, special, gen_args, mode, profile):
    tol = PROFILES[profile]
    args, path, ids = _case_ids(request, cli_json, ref_cache, model, case, text, special)
    ref_model = _ref_model(ref_cache, path)
    rkey = ("ref_logits", model, case)
    if rkey not in ref_cache:
        ref_cache[rkey] = ref_model.logits(ids)
    ref = ref_cache[rkey]

    t0 = time.perf_counter()
    out = cli_json("logits", *args, *tol["flags"], "--ids", ",".join(map(str, ids)),
                   *(["--decode"] if mode == "decode" else []))
    cli_s = time.perf_counter() - t0
    assert [int(i) for i in out["ids"]] == ids
    ours = np.asarray(out["logits"], dtype=np.float64)
    assert ours.shape == ref.shape, f"logits shape {ours.shape}, reference {ref.shape}"

    m = compare_logits(ref, ours, tol)
    line = (f"[{profile}] {model}-{case} {mode:7s} n={len(ids):2d}: "
            f"max rel={m['rel'].max():.2e} (mean {m['rel'].mean():.2e})  "
            f"KL max={m['kl'].max():.2e} mean={m['kl'].mean():.2e}  "
            f"argmax equal={m['argmax_equal']:.3f}  min ref margin={m['margin'].min():.3f}  "
            f"cli {cli_s:.1f}s")
    metrics_log.append(line)
    print(line)

    assert m["finite"], "engine logits contain NaN/inf"
    worst = int(m["rel"].argmax())
    assert m["rel"].max() <= tol["max_rel"], (
        f"max|diff|/std {m['rel'].max():.3e} at position {worst} > {tol['max_rel']}: {line}")
    assert m["kl"].max() <= tol["kl_max"], f"KL {m['kl'].max():.3e} > {tol['kl_max']}: {line}"
    assert m["kl"].mean() <= tol["kl_mean"], f"mean KL {m['kl'].mean():.3e} > {tol['kl_mean']}: {line}"
    assert not m["bad_argmax"], (
        f"argmax differs at positions {m['bad_argmax']} where the reference margin "
        f"exceeds {tol['tie']} std: {line}")


@pytest.mark.parametrize("profile", PROFILE_NAMES)
@pytest.mark.parametrize("model,case,text,special,gen_args", CASES, ids=CASE_IDS)
def test_greedy_matches_reference(request, cli_json, ref_cache, metrics_log,
                                  model, case, text, special, gen_args, profile):
    tol = PROFILES[profile]
    args, _, path = _model_setup(request, model)
    t0 = time.perf_counter()
    out = cli_json("generate", *args, *tol["flags"], *(gen_args or ["-p", text]), "-n", N_GREEDY,
                   "--temp", 0, "--ignore-eos", "--json")
    cli_s = time.perf_counter() - t0
    prompt = [int(i) for i in out["prompt_ids"]]
    ours = [int(i) for i in out["generated_ids"]]
    assert len(ours) == N_GREEDY, f"generated {len(ours)} ids, asked for {N_GREEDY} with --ignore-eos"

    # Greedy comparison by teacher forcing: one batched reference pass over
    # prompt + engine output gives, at each step, the reference's logits for the
    # same prefix; the two greedy sequences are identical iff the engine's id is
    # the reference argmax at every step (up to the first divergence this is
    # exactly numpy_llama.greedy, without 32 sequential float64 passes).
    ref_model = _ref_model(ref_cache, path)
    t0 = time.perf_counter()
    lg = ref_model.logits(prompt + ours[:-1])[len(prompt) - 1:]
    ref_s = time.perf_counter() - t0
    ref_pick = [int(i) for i in lg.argmax(axis=-1)]

    first = next((i for i, (a, b) in enumerate(zip(ref_pick, ours)) if a != b), None)
    if first is None:
        line = (f"[{profile}] {model}-{case} greedy: {N_GREEDY}/{N_GREEDY} ids identical "
                f"(prompt {len(prompt)} ids; cli {cli_s:.1f}s, numpy {ref_s:.1f}s)")
        metrics_log.append(line)
        print(line)
        return
    row = lg[first]
    gap = (row[ref_pick[first]] - row[ours[first]]) / row.std()
    allowed = tol["greedy_gap"]
    line = (f"[{profile}] {model}-{case} greedy: DIVERGES at step {first}: engine {ours[first]}, "
            f"reference {ref_pick[first]}, reference gap {gap:.2e} std (allowed {allowed:.1e})")
    metrics_log.append(line)
    print(line)
    assert gap <= allowed, (
        f"{line}\n engine: {ours}\n reference greedy: "
        f"{ours[:first] + ref_model.greedy(prompt + ours[:first], N_GREEDY - first)}")


def test_chat_prompt_matches_chatml(request, cli_json):
    """`generate --chat` feeds exactly the ChatML text the checks above tokenize
    (the GGUF chat template with its default system message)."""
    args, _, _ = _model_setup(request, "smollm2")
    chat = cli_json("generate", *args, "-p", USER_Q, "--chat", "-n", 0, "--temp", 0, "--json")
    ids = cli_json("tokenize", *args, "-p", CHATML, "--parse-special")["ids"]
    assert chat["prompt_ids"] == ids
