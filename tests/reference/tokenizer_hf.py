"""An independent GPT-2 byte-level BPE tokenizer for a GGUF `gpt2` vocabulary,
built with HuggingFace `tokenizers` from the GGUF's own tokenizer.ggml.*
metadata (read with the `gguf` package). Only the pre-tokenizers of the
`smollm` family (individual digits, then GPT-2's ByteLevel regex) and plain
`gpt2` are modelled.
"""

from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

CONTROL = 3
USER_DEFINED = 4
DIGIT_SPLIT_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"}


def _strings(reader, key):
    field = reader.fields[key]
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def _numbers(reader, key):
    field = reader.fields[key]
    return [field.parts[i][0].item() for i in field.data]


def _string(reader, key, default=None):
    field = reader.fields.get(key)
    if field is None:
        return default
    return bytes(field.parts[field.data[0]]).decode("utf-8")


def build_hf_tokenizers(gguf_path):
    """Returns (plain, with_specials): the same BPE, without and with the
    control/user-defined tokens registered as special added tokens."""
    reader = GGUFReader(gguf_path)
    assert _string(reader, "tokenizer.ggml.model") == "gpt2"
    tokens = _strings(reader, "tokenizer.ggml.tokens")
    types = _numbers(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in _strings(reader, "tokenizer.ggml.merges")]
    pre = _string(reader, "tokenizer.ggml.pre", "default")
    vocab = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)

    def make(with_specials):
        tok = Tokenizer(models.BPE(vocab, merges))
        steps = []
        if pre in DIGIT_SPLIT_PRE:
            steps.append(pre_tokenizers.Digits(individual_digits=True))
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
        tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
        tok.decoder = decoders.ByteLevel()
        if with_specials:
            specials = [t for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)]
            tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        return tok

    return make(False), make(True)
