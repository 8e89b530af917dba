"""The scalar reference dequantization (src/kernels/quant_ref*.cpp) against
the PyPI gguf package's NumPy dequantization, bit for bit, on random blocks.

Every byte of every block is random except the f16 scales, which are drawn
finite (a NaN scale would make the comparison about NaN payloads), over a
wide range of magnitudes including subnormal f16 values and zero.
"""
from __future__ import annotations

import subprocess
import zlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

# Byte offsets of the f16 scales within one block, per type (ggml layouts).
SCALES = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208],
    "IQ4_NL": [0], "IQ4_XS": [0],
}
N_BLOCKS = 4096


def _random_blocks(name: str, rng: np.random.Generator) -> np.ndarray:
    qtype = T[name]
    _, type_size = quants.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(N_BLOCKS, type_size), dtype=np.uint8)
    for off in SCALES[name]:
        # log-uniform magnitudes 2^-26 .. 2^4 (subnormal f16 below 2^-14), random sign, some zeros
        mag = np.exp2(rng.uniform(-26, 4, N_BLOCKS)).astype(np.float16)
        mag[rng.random(N_BLOCKS) < 0.02] = 0
        val = np.where(rng.random(N_BLOCKS) < 0.5, -mag, mag).astype(np.float16)
        blocks[:, off:off + 2] = val.view(np.uint8).reshape(N_BLOCKS, 2)
    return blocks


@pytest.mark.parametrize("name", sorted(SCALES))
def test_dequantize_matches_gguf_bit_for_bit(name, tmp_path, dequant_tool):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    blocks = _random_blocks(name, rng)
    src, dst = tmp_path / "blocks.bin", tmp_path / "values.bin"
    blocks.tofile(src)
    subprocess.run([str(dequant_tool), name, str(src), str(dst)], check=True, timeout=60)
    ours = np.fromfile(dst, dtype=np.float32)
    theirs = quants.dequantize(blocks.reshape(-1), T[name]).astype(np.float32).reshape(-1)
    assert ours.shape == theirs.shape
    diff = np.flatnonzero(ours.view(np.uint32) != theirs.view(np.uint32))
    assert diff.size == 0, (
        f"{name}: {diff.size} of {ours.size} values differ; first at {diff[0]}: "
        f"ours {ours[diff[0]]!r}, gguf {theirs[diff[0]]!r}")
