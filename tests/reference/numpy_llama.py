#!/usr/bin/env python3
"""Independent NumPy reference forward pass for Llama-architecture models
(llama, and the qwen2 / qwen3 / phi3 / gemma3 variants).

Shares no code with the C++ engine: GGUF files are parsed with the PyPI
`gguf` package (`gguf.GGUFReader`) and tensors are dequantized with
`gguf.quants.dequantize`; llama2.c checkpoints are read with plain NumPy.
The forward pass is written from the model definition, not from our C++.

Computation is in float64 (weights are dequantized to float32 by `gguf`,
which is exact, then widened to float64 losslessly). float64 makes the
reference's own rounding error ~1e-13 relative, so every measured difference
against the float32 C++ engine is the engine's, not the reference's, and a
greedy continuation is decided by the model's maths rather than by rounding
in the reference. Cost is ~1.1 GB of float64 weights for SmolLM2-135M and
roughly twice the float32 matmul time, which is still fast at test sizes.

Python API:
    m = load_model(path)              # GGUF (arch "llama") or llama2.c .bin
    m.logits(token_ids) -> np.ndarray [n, vocab]  (all positions, one pass)
    m.greedy(prompt_ids, n_new) -> list[int]      (KV-cached, argmax)
    m.act_q8 = True   # simulate 8-bit (Q8_0, block 32) matmul inputs, to size
                      # tolerances for engines that quantize activations

CLI:
    python3 numpy_llama.py MODEL --ids 1,2,3 [--greedy N] [--json]
    python3 numpy_llama.py stories260K.bin -t tok512.bin --prompt "Once upon a time" --greedy 50
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path

# One BLAS thread unless told otherwise (no effect if NumPy is already loaded):
# multi-threaded OpenBLAS on a busy 2-core machine spin-waits and runs ~10x slower.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

DTYPE = np.float64


@dataclass
class Config:
    dim: int
    hidden_dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    head_dim: int
    rope_dim: int  # number of leading dims of each head that RoPE rotates
    rope_theta: float
    rms_eps: float
    max_seq_len: int
    # Architecture variants (GGUF general.architecture), from the model
    # definitions: qwen2 adds q/k/v biases; qwen2, qwen3 and phi3 rotate the
    # two halves of a head (NeoX RoPE) instead of adjacent pairs; qwen3
    # RMS-normalises each head of q and k (own weights) before RoPE.
    arch: str = "llama"
    neox_rope: bool = False
    # gemma3 (Gemma 3 model definition): embeddings times sqrt(dim); RMSNorm
    # of the attention and FFN outputs before each residual add; GELU (tanh
    # approximation) gating; layers i with i % 6 != 5 attend only to the last
    # `sliding_window` positions and rotate with base 10000, unscaled; the
    # others use rope_theta with linear scaling (positions / rope_scale).
    embed_scale: bool = False
    post_norms: bool = False
    gelu: bool = False
    layer_window: tuple = ()
    rope_theta_local: float = 10000.0
    rope_scale: float = 1.0
    rope_scale_local: float = 1.0
    final_softcap: float = 0.0


@dataclass
class Layer:
    attn_norm: np.ndarray  # [dim]
    wq: np.ndarray  # [n_heads*head_dim, dim]
    wk: np.ndarray  # [n_kv_heads*head_dim, dim]
    wv: np.ndarray  # [n_kv_heads*head_dim, dim]
    wo: np.ndarray  # [dim, n_heads*head_dim]
    ffn_norm: np.ndarray  # [dim]
    w_gate: np.ndarray  # [hidden, dim]  (llama2.c w1)
    w_down: np.ndarray  # [dim, hidden]  (llama2.c w2)
    w_up: np.ndarray  # [hidden, dim]    (llama2.c w3)
    bq: np.ndarray | None = None  # qwen2 biases
    bk: np.ndarray | None = None
    bv: np.ndarray | None = None
    q_norm: np.ndarray | None = None  # qwen3 per-head RMSNorm weights [head_dim]
    k_norm: np.ndarray | None = None
    attn_post_norm: np.ndarray | None = None  # gemma3 [dim]
    ffn_post_norm: np.ndarray | None = None


class KVCache:
    """Per-layer post-RoPE keys and values, [T, n_kv_heads, head_dim]."""

    def __init__(self, n_layers: int):
        self.k: list[np.ndarray | None] = [None] * n_layers
        self.v: list[np.ndarray | None] = [None] * n_layers
        self.length = 0


class Model:
    def __init__(self, cfg: Config, tok_embd, layers, output_norm, output, tied: bool):
        self.cfg = cfg
        # When True, every matmul input is first rounded to 8 bits per block of
        # 32 (ggml Q8_0: scale = absmax/127), the way llama.cpp feeds quantized
        # weights. Off by default; used to size test tolerances for engines
        # that quantize activations.
        self.act_q8 = False
        self.dtype = np.dtype(tok_embd.dtype)
        self.tok_embd = tok_embd  # [vocab, dim]
        self.layers: list[Layer] = layers
        self.output_norm = output_norm  # [dim]
        self.output = output  # [vocab, dim]
        self.tied = tied
        self._check_shapes()
        rd = cfg.rope_dim
        # pair i rotates dims (2i, 2i+1) by pos * theta^(-2i/head_dim)
        # (llama2.c run.c and ggml's "normal" rope mode, which GGUF llama
        # checkpoints are permuted for).
        self._inv_freq = (cfg.rope_theta ** (-np.arange(0, rd, 2, dtype=np.float64) / rd)
                          / cfg.rope_scale).astype(self.dtype)
        self._inv_freq_local = (cfg.rope_theta_local ** (-np.arange(0, rd, 2, dtype=np.float64) / rd)
                                / cfg.rope_scale_local).astype(self.dtype)

    # ---- checks -----------------------------------------------------------
    def _check_shapes(self):
        c = self.cfg
        q_dim, kv_dim = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
        if c.n_heads % c.n_kv_heads:
            raise ValueError(f"n_heads {c.n_heads} not a multiple of n_kv_heads {c.n_kv_heads}")
        if c.rope_dim % 2 or c.rope_dim > c.head_dim:
            raise ValueError(f"bad rope_dim {c.rope_dim} for head_dim {c.head_dim}")

        def want(name, arr, shape):
            if tuple(arr.shape) != tuple(shape):
                raise ValueError(f"{name}: shape {arr.shape}, expected {shape}")

        want("tok_embd", self.tok_embd, (c.vocab_size, c.dim))
        want("output_norm", self.output_norm, (c.dim,))
        want("output", self.output, (c.vocab_size, c.dim))
        for i, L in enumerate(self.layers):
            want(f"{i}.attn_norm", L.attn_norm, (c.dim,))
            want(f"{i}.wq", L.wq, (q_dim, c.dim))
            want(f"{i}.wk", L.wk, (kv_dim, c.dim))
            want(f"{i}.wv", L.wv, (kv_dim, c.dim))
            want(f"{i}.wo", L.wo, (c.dim, q_dim))
            want(f"{i}.ffn_norm", L.ffn_norm, (c.dim,))
            want(f"{i}.w_gate", L.w_gate, (c.hidden_dim, c.dim))
            want(f"{i}.w_up", L.w_up, (c.hidden_dim, c.dim))
            want(f"{i}.w_down", L.w_down, (c.dim, c.hidden_dim))

    # ---- building blocks --------------------------------------------------
    def _rmsnorm(self, x, w):
        # x: [n, dim]
        ms = np.mean(x * x, axis=-1, keepdims=True)
        return x / np.sqrt(ms + self.cfg.rms_eps) * w

    def _rope(self, x, positions, inv_freq=None):
        # x: [n, heads, head_dim]; rotate pairs of the first rope_dim dims:
        # adjacent (2i, 2i+1), or (i, i + rope_dim/2) for NeoX-style models.
        rd = self.cfg.rope_dim
        inv_freq = self._inv_freq if inv_freq is None else inv_freq
        ang = positions.astype(self.dtype)[:, None] * inv_freq[None, :]  # [n, rd/2]
        cos = np.cos(ang)[:, None, :]
        sin = np.sin(ang)[:, None, :]
        out = x.copy()
        if self.cfg.neox_rope:
            i0, i1 = slice(0, rd // 2), slice(rd // 2, rd)
        else:
            i0, i1 = slice(0, rd, 2), slice(1, rd, 2)
        x0 = x[..., i0]
        x1 = x[..., i1]
        out[..., i0] = x0 * cos - x1 * sin
        out[..., i1] = x0 * sin + x1 * cos
        return out

    def _mm(self, x, w):
        """x [n, in] @ w[out, in].T, optionally with Q8_0-rounded activations."""
        if self.act_q8:
            n, k = x.shape
            if k % 32 == 0:
                b = x.reshape(n, k // 32, 32)
                d = np.max(np.abs(b), axis=-1, keepdims=True) / 127.0
                safe = np.where(d == 0, 1.0, d)
                x = (np.round(b / safe) * d).astype(np.float32).reshape(n, k).astype(self.dtype)
        return x @ w.T

    @staticmethod
    def _softmax(s, axis=-1):
        s = s - np.max(s, axis=axis, keepdims=True)
        e = np.exp(s)
        return e / np.sum(e, axis=axis, keepdims=True)

    # ---- forward ----------------------------------------------------------
    def forward(self, token_ids, cache: KVCache | None = None, last_only: bool = False):
        """Run `token_ids` after whatever `cache` holds; returns logits [n, vocab]
        (or [1, vocab] for the last position when last_only)."""
        c = self.cfg
        ids = np.asarray(token_ids, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError("token_ids must be a non-empty 1-D sequence")
        if ids.min() < 0 or ids.max() >= c.vocab_size:
            raise ValueError(f"token id out of range [0, {c.vocab_size})")
        if cache is None:
            cache = KVCache(c.n_layers)
        n = ids.size
        p0 = cache.length
        positions = np.arange(p0, p0 + n)
        hd, H, Hkv = c.head_dim, c.n_heads, c.n_kv_heads
        group = H // Hkv
        scale = self.dtype.type(1.0 / np.sqrt(hd))
        T = p0 + n
        # causal mask: query at position p0+i may see keys 0..p0+i
        mask = np.arange(T)[None, :] > positions[:, None]  # [n, T]

        x = self.tok_embd[ids].astype(self.dtype, copy=True)  # [n, dim]
        if c.embed_scale:
            x = x * np.sqrt(c.dim)
        for li, L in enumerate(self.layers):
            window = c.layer_window[li] if c.layer_window else 0
            inv_freq = self._inv_freq_local if window > 0 else self._inv_freq
            h = self._rmsnorm(x, L.attn_norm)
            q, k, v = self._mm(h, L.wq), self._mm(h, L.wk), self._mm(h, L.wv)
            if L.bq is not None:
                q, k, v = q + L.bq, k + L.bk, v + L.bv
            q, k, v = q.reshape(n, H, hd), k.reshape(n, Hkv, hd), v.reshape(n, Hkv, hd)
            if L.q_norm is not None:
                q, k = self._rmsnorm(q, L.q_norm), self._rmsnorm(k, L.k_norm)
            q = self._rope(q, positions, inv_freq)
            k = self._rope(k, positions, inv_freq)
            if cache.k[li] is None:
                cache.k[li], cache.v[li] = k, v
            else:
                cache.k[li] = np.concatenate([cache.k[li], k], axis=0)
                cache.v[li] = np.concatenate([cache.v[li], v], axis=0)
            K = np.repeat(cache.k[li], group, axis=1)  # [T, H, hd]; head h -> kv head h // group
            V = np.repeat(cache.v[li], group, axis=1)
            scores = np.einsum("nhd,thd->hnt", q, K) * scale  # [H, n, T]
            layer_mask = mask
            if window > 0:  # sliding window: keys at most window - 1 positions back
                layer_mask = mask | (positions[:, None] - np.arange(T)[None, :] >= window)
            scores[:, layer_mask] = -np.inf
            probs = self._softmax(scores, axis=-1)
            attn = np.einsum("hnt,thd->nhd", probs, V).reshape(n, H * hd)
            o = self._mm(attn, L.wo)
            if L.attn_post_norm is not None:
                o = self._rmsnorm(o, L.attn_post_norm)
            x = x + o
            h = self._rmsnorm(x, L.ffn_norm)
            g = self._mm(h, L.w_gate)
            u = self._mm(h, L.w_up)
            if c.gelu:
                act = 0.5 * g * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (g + 0.044715 * g ** 3)))
            else:
                act = g / (1.0 + np.exp(-g))
            o = self._mm(act * u, L.w_down)
            if L.ffn_post_norm is not None:
                o = self._rmsnorm(o, L.ffn_post_norm)
            x = x + o
        cache.length = T
        if last_only:
            x = x[-1:]
        x = self._rmsnorm(x, self.output_norm)
        logits = self._mm(x, self.output)
        if c.final_softcap > 0:
            logits = c.final_softcap * np.tanh(logits / c.final_softcap)
        return logits

    def logits(self, token_ids) -> np.ndarray:
        """Logits at every position of `token_ids`, one batched pass: [n, vocab]."""
        return self.forward(token_ids)

    def greedy(self, prompt_ids, n_new: int, return_logits: bool = False):
        """Argmax continuation of `prompt_ids` (no BOS added; no EOS stop).

        Returns the n_new generated ids; with return_logits, also the
        [n_new, vocab] logits each id was chosen from."""
        cache = KVCache(self.cfg.n_layers)
        out: list[int] = []
        steps: list[np.ndarray] = []
        if n_new > 0:
            lg = self.forward(prompt_ids, cache, last_only=True)
            while True:
                steps.append(lg[-1])
                out.append(int(np.argmax(lg[-1])))
                if len(out) == n_new:
                    break
                lg = self.forward([out[-1]], cache, last_only=True)
        if return_logits:
            return out, (np.stack(steps) if steps else np.zeros((0, self.cfg.vocab_size)))
        return out


# ---- loaders ------------------------------------------------------------------

def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        if default is None:
            raise KeyError(f"GGUF metadata key missing: {key}")
        return default
    return f.contents()


def load_gguf(path, dtype=DTYPE) -> Model:
    import gguf  # PyPI package; imported here so llama2.c use needs only NumPy
    from gguf.quants import dequantize

    r = gguf.GGUFReader(str(path))
    arch = _field(r, "general.architecture")
    if arch not in ("llama", "qwen2", "qwen3", "phi3", "gemma3"):
        raise ValueError(f"{path}: architecture {arch!r}, only llama, qwen2, qwen3, phi3, gemma3 supported")
    tensors = {t.name: t for t in r.tensors}
    if "rope_freqs.weight" in tensors:
        raise NotImplementedError("rope_freqs (Llama-3.1 rope scaling) not supported")

    def get(name):
        t = tensors[name]
        a = dequantize(t.data, t.tensor_type)
        # GGUF lists dims innermost first (ne0 = in-features); NumPy is row-major.
        shape = tuple(int(d) for d in reversed(t.shape))
        a = np.asarray(a).reshape(shape)
        return a.astype(dtype)

    a = arch + "."
    n_heads = int(_field(r, a + "attention.head_count"))
    dim = int(_field(r, a + "embedding_length"))
    head_dim = int(_field(r, a + "attention.key_length", dim // n_heads))
    tok_embd = get("token_embd.weight")
    n_kv_heads = int(_field(r, a + "attention.head_count_kv", n_heads))
    hidden = int(_field(r, a + "feed_forward_length"))
    cfg = Config(
        dim=dim,
        hidden_dim=hidden,
        n_layers=int(_field(r, a + "block_count")),
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        vocab_size=int(tok_embd.shape[0]),
        head_dim=head_dim,
        rope_dim=int(_field(r, a + "rope.dimension_count", head_dim)),
        rope_theta=float(_field(r, a + "rope.freq_base", 10000.0)),
        rms_eps=float(_field(r, a + "attention.layer_norm_rms_epsilon")),
        max_seq_len=int(_field(r, a + "context_length", 2048)),
        arch=arch,
        neox_rope=arch in ("qwen2", "qwen3", "phi3", "gemma3"),
    )
    scaling = _field(r, a + "rope.scaling.type", "none")
    if scaling == "linear":
        cfg.rope_scale = cfg.rope_scale_local = float(_field(r, a + "rope.scaling.factor"))
    elif scaling != "none":
        raise NotImplementedError(f"rope scaling {scaling!r}")
    window = int(_field(r, a + "attention.sliding_window", 0))
    if window > 0:
        if arch == "gemma3":  # five local layers, then a global one
            cfg.layer_window = tuple(0 if i % 6 == 5 else window for i in range(cfg.n_layers))
            cfg.rope_theta_local, cfg.rope_scale_local = 10000.0, 1.0
        else:
            cfg.layer_window = (window,) * cfg.n_layers
            cfg.rope_theta_local = cfg.rope_theta
        if (a + "rope.freq_base_swa") in r.fields:
            cfg.rope_theta_local = float(_field(r, a + "rope.freq_base_swa"))
    if arch == "gemma3":
        cfg.embed_scale = cfg.post_norms = cfg.gelu = True
    if (a + "final_logit_softcapping") in r.fields:
        cfg.final_softcap = float(_field(r, a + "final_logit_softcapping"))
    layers = []
    for i in range(cfg.n_layers):
        p = f"blk.{i}."
        if arch == "phi3":  # one fused Q|K|V matrix; ffn_up holds gate then up
            qkv = get(p + "attn_qkv.weight")
            qd, kvd = n_heads * head_dim, n_kv_heads * head_dim
            wq, wk, wv = qkv[:qd], qkv[qd:qd + kvd], qkv[qd + kvd:]
            gate_up = get(p + "ffn_up.weight")
            w_gate, w_up = gate_up[:hidden], gate_up[hidden:]
        else:
            wq, wk, wv = get(p + "attn_q.weight"), get(p + "attn_k.weight"), get(p + "attn_v.weight")
            w_gate, w_up = get(p + "ffn_gate.weight"), get(p + "ffn_up.weight")
        layer = Layer(
            attn_norm=get(p + "attn_norm.weight"),
            wq=wq, wk=wk, wv=wv,
            wo=get(p + "attn_output.weight"),
            ffn_norm=get(p + "ffn_norm.weight"),
            w_gate=w_gate,
            w_down=get(p + "ffn_down.weight"),
            w_up=w_up,
        )
        if arch == "qwen2":
            layer.bq, layer.bk, layer.bv = (get(p + f"attn_{x}.bias") for x in "qkv")
        if arch in ("qwen3", "gemma3"):
            layer.q_norm, layer.k_norm = get(p + "attn_q_norm.weight"), get(p + "attn_k_norm.weight")
        if arch == "gemma3":
            layer.attn_post_norm = get(p + "post_attention_norm.weight")
            layer.ffn_post_norm = get(p + "post_ffw_norm.weight")
        layers.append(layer)
    tied = "output.weight" not in tensors
    output = tok_embd if tied else get("output.weight")
    return Model(cfg, tok_embd, layers, get("output_norm.weight"), output, tied)


def load_llama2c(path, dtype=DTYPE) -> Model:
    raw = Path(path).read_bytes()
    if len(raw) < 28:
        raise ValueError(f"{path}: too short for a llama2.c header")
    dim, hidden, n_layers, n_heads, n_kv_heads, vocab, seq_len = struct.unpack("<7i", raw[:28])
    shared = vocab > 0
    vocab = abs(vocab)
    head = dim // n_heads
    kv_dim = n_kv_heads * head
    data = np.frombuffer(raw, dtype="<f4", offset=28)
    pos = 0

    def take(*shape):
        nonlocal pos
        cnt = int(np.prod(shape))
        if pos + cnt > data.size:
            raise ValueError(f"{path}: truncated checkpoint")
        a = data[pos:pos + cnt].reshape(shape).astype(dtype)
        pos += cnt
        return a

    emb = take(vocab, dim)
    rms_att = take(n_layers, dim)
    wq = take(n_layers, dim, dim)
    wk = take(n_layers, kv_dim, dim)
    wv = take(n_layers, kv_dim, dim)
    wo = take(n_layers, dim, dim)
    rms_ffn = take(n_layers, dim)
    w1 = take(n_layers, hidden, dim)
    w2 = take(n_layers, dim, hidden)
    w3 = take(n_layers, hidden, dim)
    rms_final = take(dim)
    take(seq_len, head // 2)  # freq_cis_real (unused; recomputed)
    take(seq_len, head // 2)  # freq_cis_imag
    wcls = emb if shared else take(vocab, dim)
    if pos != data.size:
        raise ValueError(f"{path}: {data.size - pos} trailing floats")
    cfg = Config(dim=dim, hidden_dim=hidden, n_layers=n_layers, n_heads=n_heads,
                 n_kv_heads=n_kv_heads, vocab_size=vocab, head_dim=head, rope_dim=head,
                 rope_theta=10000.0, rms_eps=1e-5, max_seq_len=seq_len)
    layers = [Layer(attn_norm=rms_att[i], wq=wq[i], wk=wk[i], wv=wv[i], wo=wo[i],
                    ffn_norm=rms_ffn[i], w_gate=w1[i], w_down=w2[i], w_up=w3[i])
              for i in range(n_layers)]
    return Model(cfg, emb, layers, rms_final, wcls, shared)


def load_model(path, dtype=DTYPE) -> Model:
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic == b"GGUF":
        return load_gguf(path, dtype)
    return load_llama2c(path, dtype)


# ---- minimal llama2.c tokenizer (port of run.c), for the self-check / CLI only --

class Llama2cTokenizer:
    """Naive port of llama2.c run.c encode/decode (BOS=1, EOS=2, dummy prefix)."""

    def __init__(self, path):
        raw = Path(path).read_bytes()
        (self.max_len,) = struct.unpack_from("<i", raw, 0)
        off = 4
        self.vocab: list[bytes] = []
        self.scores: list[float] = []
        while off < len(raw):
            score, n = struct.unpack_from("<fi", raw, off)
            off += 8
            self.vocab.append(raw[off:off + n])
            self.scores.append(score)
            off += n
        self.lookup = {}
        for i, piece in enumerate(self.vocab):
            self.lookup.setdefault(piece, i)

    def encode(self, text: str, bos: bool = True, eos: bool = False) -> list[int]:
        toks = [1] if bos else []
        if text:
            toks.append(self.lookup[b" "])
        for ch in text:
            b = ch.encode("utf-8")
            if b in self.lookup:
                toks.append(self.lookup[b])
            else:
                toks.extend(x + 3 for x in b)  # byte fallback: <0x00> is id 3
        while True:
            best_score, best_id, best_idx = -1e10, -1, -1
            for i in range(len(toks) - 1):
                tid = self.lookup.get(self.vocab[toks[i]] + self.vocab[toks[i + 1]], -1)
                if tid != -1 and self.scores[tid] > best_score:
                    best_score, best_id, best_idx = self.scores[tid], tid, i
            if best_idx == -1:
                break
            toks[best_idx:best_idx + 2] = [best_id]
        if eos:
            toks.append(2)
        return toks

    def decode_piece(self, prev: int, tok: int) -> bytes:
        piece = self.vocab[tok]
        if prev == 1 and piece.startswith(b" "):
            piece = piece[1:]
        if len(piece) == 6 and piece.startswith(b"<0x") and piece.endswith(b">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece

    def decode(self, tokens, prev: int = 1) -> str:
        out = bytearray()
        for t in tokens:
            out += self.decode_piece(prev, t)
            prev = t
        return out.decode("utf-8", errors="replace")


# ---- CLI ---------------------------------------------------------------------

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="GGUF (llama) or llama2.c .bin checkpoint")
    ap.add_argument("--ids", help="comma-separated token ids (used as is: no BOS added)")
    ap.add_argument("-t", "--tokenizer", help="llama2.c tokenizer .bin (for --prompt)")
    ap.add_argument("-p", "--prompt", help="text prompt (llama2.c models only; BOS prepended)")
    ap.add_argument("--greedy", type=int, metavar="N", help="generate N tokens greedily")
    ap.add_argument("--json", action="store_true", help="print JSON")
    ap.add_argument("--act-q8", action="store_true",
                    help="round matmul inputs to 8 bits (Q8_0 blocks of 32), llama.cpp style")
    a = ap.parse_args(argv)

    model = load_model(a.model)
    model.act_q8 = a.act_q8
    tok = Llama2cTokenizer(a.tokenizer) if a.tokenizer else None
    if a.ids:
        ids = [int(s) for s in a.ids.split(",") if s.strip()]
    elif a.prompt is not None:
        if tok is None:
            ap.error("--prompt needs -t TOKENIZER (llama2.c)")
        ids = tok.encode(a.prompt, bos=True)
    else:
        ap.error("give --ids or --prompt")

    if a.greedy is not None:
        gen = model.greedy(ids, a.greedy)
        res = {"prompt_ids": ids, "generated_ids": gen}
        if tok:
            res["text"] = tok.decode(ids[1:] + gen) if ids and ids[0] == 1 else tok.decode(ids + gen, prev=0)
        if a.json:
            print(json.dumps(res))
        else:
            print("prompt_ids:", ids)
            print("generated_ids:", gen)
            if "text" in res:
                print(res["text"])
        return 0

    lg = model.logits(ids)
    if a.json:
        print(json.dumps({"ids": ids, "logits": lg.tolist()}))
    else:
        for i, row in enumerate(lg):
            top = np.argsort(-row)[:5]
            print(f"pos {i} id {ids[i]}: top5 " + " ".join(f"{t}:{row[t]:.4f}" for t in top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
