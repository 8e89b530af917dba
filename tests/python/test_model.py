"""Model loading, tokenizer, chat template, engine construction and their errors."""
import pytest

import qkvshare as q


def test_version_and_exports():
    assert q.__version__.count(".") == 2
    for name in ("Model", "Engine", "Session", "Pool", "Context", "Descriptor", "Workflow", "Error"):
        assert hasattr(q, name)


def test_model_properties(stories, stories_paths):
    assert stories.format == "llama2c"
    assert stories.vocab_size == 512
    assert stories.context_length == 512
    assert stories.n_layers > 0 and stories.d_model > 0
    assert stories.path == str(stories_paths[0])
    assert stories.tokenizer_path == str(stories_paths[1])
    assert len(stories.fingerprint) == 32 and int(stories.fingerprint, 16) >= 0
    assert "stories260K" in repr(stories)


def test_tokenize_round_trip(stories):
    ids = stories.tokenize("Once upon a time")
    assert ids and all(isinstance(i, int) for i in ids)
    assert stories.detokenize(ids) == "Once upon a time"
    with_bos = stories.tokenize("Once upon a time", add_bos=True)
    assert with_bos[0] == stories.bos_id and with_bos[1:] == ids


def test_chat_template(stories):
    text = stories.chat_template([{"role": "system", "content": "S"}, ("user", "Hi")])
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert not stories.chat_template([("user", "Hi")], add_generation_prompt=False).endswith("assistant\n")
    with pytest.raises(q.InvalidArgument, match="role"):
        stories.chat_template([{"content": "no role"}])
    with pytest.raises(q.InvalidArgument):
        stories.chat_template(["just a string"])


def test_detokenize_bad_ids(stories):
    with pytest.raises(q.InvalidArgument, match="outside the vocabulary") as e:
        stories.detokenize([1, 99999])
    assert e.value.code == "invalid_argument"
    assert isinstance(e.value, ValueError) and isinstance(e.value, q.Error)
    with pytest.raises(TypeError):
        stories.detokenize("not ids")


def test_load_errors(tmp_path, stories_paths):
    with pytest.raises(q.IOFailure) as e:
        q.Model.load(str(tmp_path / "missing.gguf"))
    assert e.value.code == "io" and "missing.gguf" in str(e.value)
    assert isinstance(e.value, OSError)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 60)
    with pytest.raises(q.BadModelFile) as e:
        q.Model.load(str(bad))
    assert e.value.code == "bad_model_file" and "bad.gguf" in str(e.value)
    with pytest.raises(q.Error, match="tokenizer"):
        q.Model.load(str(stories_paths[0]))  # a llama2.c checkpoint needs its tokenizer
    with pytest.raises(TypeError):
        q.Model.load(42)


def test_engine_arguments(stories):
    assert q.Engine(stories, threads=1).threads == 1
    with pytest.raises(q.InvalidArgument, match="threads"):
        q.Engine(stories, threads=-1)
    with pytest.raises(q.InvalidArgument, match="max_batch"):
        q.Engine(stories, max_batch=0)
    with pytest.raises(TypeError):
        q.Engine("not a model")
    with pytest.raises(TypeError):
        q.Engine(None)


def test_engine_keeps_model_alive(stories_paths):
    m = q.Model.load(str(stories_paths[0]), str(stories_paths[1]))
    e = q.Engine(m, threads=1)
    del m  # the engine holds the model
    s = e.session(kv="f16")
    assert s.generate("Once", max_tokens=4, temperature=0).tokens
    assert e.model.vocab_size == 512


def test_float_activations(stories, smollm2_path):
    """The SIMD kernels with float activations: f32 copies of the quantized weights (none for a
    model of f32 weights), logits close to the float reference's, the flags exclusive."""
    import numpy as np

    assert q.Engine(stories, threads=1, float_activations=True).float_copy_bytes == 0
    with pytest.raises(q.InvalidArgument, match="choose one"):
        q.Engine(stories, exact_matmul=True, float_activations=True)
    m = q.Model.load(str(smollm2_path))
    fast, exact, plain = (q.Engine(m, threads=2, float_activations=True), q.Engine(m, threads=2, exact_matmul=True),
                          q.Engine(m, threads=2))
    assert fast.float_copy_bytes > 400_000_000 and plain.float_copy_bytes == 0  # ~135M weights x 4 bytes
    prompt = "The quick brown fox jumps over the lazy dog."
    lf = fast.session(kv="f32").prefill(prompt)
    le = exact.session(kv="f32").prefill(prompt)
    assert np.max(np.abs(lf - le)) <= 1e-3 * np.max(np.abs(le))
