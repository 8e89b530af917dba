"""Independent checks of the C++ tokenizers through the CLI
(`qkvshare tokenize -m MODEL [-t TOKENIZER] --prompt=TEXT [--parse-special]`,
which prints {"ids": [...]}):

- SmolLM2's GPT-2 byte-level BPE against HuggingFace `tokenizers` built from
  the GGUF's own vocabulary and merges (tokenizer_hf.py);
- llama2.c's tok512 against a line-by-line Python port of run.c's encode
  (tokenizer_llama2c.py).

Paths come from the conftest.py fixtures (QKVSHARE_CLI, QKVSHARE_MODEL,
QKVSHARE_SHARED); a missing one skips loudly.
"""

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tokenizer_hf import build_hf_tokenizers  # noqa: E402
from tokenizer_llama2c import Llama2cTokenizer  # noqa: E402


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))


def assert_same(ours, ref, text):
    if ours != ref:
        i = first_difference(ours, ref)
        pytest.fail(f"ids differ at {i} for {text[:120]!r}:\n ours {ours[max(0, i - 5):i + 10]}\n"
                    f"  ref {ref[max(0, i - 5):i + 10]}")


def tokenize(cli_json, model_args, text, special=False):
    # "--prompt=TEXT" keeps texts that start with "-" from being read as options.
    args = ["tokenize", *model_args, f"--prompt={text}"] + (["--parse-special"] if special else [])
    return cli_json(*args)["ids"]


PLAIN_TEXTS = [
    "Hello world",
    "Once upon a time, there was a little girl named Lily.",
    "The quick brown fox jumps over the lazy dog. THE END!",
    "12345",
    "Call 555-0199 or pay $1,234.56 (3.5% off) on 2024-03-14.",
    "it's don't you're we've I'm they'll she'd IT'S DON'T",
    "a  b",
    "a   b    c",
    "line one\nline two\n\nline four\n",
    "\ttabbed\t\tthing\t",
    "trailing spaces   ",
    "   leading spaces",
    "\n\n\n",
    "  \n \t \r\n ",
    "mixed \r\n windows\r\nnewlines",
    "def add(a, b):\n    return a + b  # sum\n\nprint(add(2, 3))\n",
    "for (int i = 0; i < n; ++i) { x[i] = y[i] * 2; }",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "café naïve résumé Straße façade",
    "日本語のテキストと中文文本",
    "Привет, мир! Γειά σου κόσμε",
    "emoji 🙂🚀👩‍👩‍👧 and flags 🇫🇷",
    "math: x² + y² = z², ½ ¾ ∑ ∞ ≠ ≤",
    "Arabic digits ١٢٣ and fullwidth １２３",
    "nbsp\u00a0here, ideographic\u3000space, nel\u0085x, line\u2028sep",
    "<|im_start|> is plain text here <|im_end|>",
    "<|endoftext|>",
    "Ġ Ċ ĉ",
    "'s 'S ''s",
    "!!!??? ... --- ***",
]

CHAT_TEXTS = [
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello! How can I help?<|im_end|>\n",
    "<|im_start|><|im_start|>x<|im_end|><|endoftext|>",
    "text <|im_star not special <|im_end|>tail",
    "<repo_name>qkvshare<file_sep>main.cpp<|endoftext|>",
]


def random_texts(seed, count):
    rng = random.Random(seed)
    pieces = list("abcXYZ  \n\t.,'\"0123éü你🙂") + ["'s", "'ll", "  ", "\n\n", "\u00a0", "\u3000"]
    out = []
    for _ in range(count):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 40)))
        out.append("x" + text)  # never empty, never starts with '-'
    return out


def wikitext_prefix(shared_dir, chars):
    return (shared_dir / "data" / "wikitext-2-test.raw").read_text(encoding="utf-8")[:chars]


@pytest.fixture(scope="module")
def hf(smollm2_model):
    return build_hf_tokenizers(str(smollm2_model))


@pytest.fixture(scope="module")
def run_c(tok512):
    return Llama2cTokenizer(str(tok512))


def test_hf_reference_round_trips(hf):
    plain, _ = hf
    for text in PLAIN_TEXTS:
        assert plain.decode(plain.encode(text, add_special_tokens=False).ids) == text


def test_smollm2_plain_text_matches_hf(hf, cli_json, smollm2_model, shared_dir, metrics_log):
    plain, _ = hf
    texts = PLAIN_TEXTS + random_texts(1, 40) + [wikitext_prefix(shared_dir, 20000)]
    for text in texts:
        assert_same(tokenize(cli_json, ["-m", smollm2_model], text),
                    plain.encode(text, add_special_tokens=False).ids, text)
    metrics_log.append(f"tokenizer: SmolLM2 BPE ids equal HuggingFace tokenizers on {len(texts)} texts")


def test_smollm2_special_tokens_match_hf(hf, cli_json, smollm2_model):
    _, special = hf
    for text in CHAT_TEXTS + PLAIN_TEXTS[:8]:
        assert_same(tokenize(cli_json, ["-m", smollm2_model], text, special=True),
                    special.encode(text, add_special_tokens=False).ids, text)


def test_llama2c_port_self_check(run_c):
    assert run_c.encode(b"Once upon a time") == [403, 407, 261, 378]
    for text in PLAIN_TEXTS:
        data = text.encode("utf-8")
        ids = run_c.encode(data)
        # With BOS before the first token, run.c's decode drops the dummy prefix.
        assert b"".join(run_c.decode_piece(prev, t) for prev, t in zip([1] + ids, ids)) == data, text


def test_tok512_matches_run_c_port(run_c, cli_json, stories260k_model, tok512, shared_dir, metrics_log):
    story = (shared_dir / "data" / "tinystories-valid-sample.txt").read_text(encoding="utf-8")
    # The port is naive O(n^2): long texts stay at a couple of thousand characters.
    texts = PLAIN_TEXTS + random_texts(2, 30) + [story[:2000], wikitext_prefix(shared_dir, 1500)]
    for text in texts:
        assert_same(tokenize(cli_json, ["-m", stories260k_model, "-t", tok512], text),
                    run_c.encode(text.encode("utf-8")), text)
    metrics_log.append(f"tokenizer: tok512 ids equal the run.c port on {len(texts)} texts")
