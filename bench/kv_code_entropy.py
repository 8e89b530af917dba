#!/usr/bin/env python3
"""How much an entropy coder could shrink a context's quantized KV codes.

Reads portable context files (`qkvshare context export`, docs/tiers.md "Portable
context format"), unpacks the codes of every full quantized block and reports
their empirical entropy in bits per code under four models: one table for all
codes, one per (layer, KV head, channel), the delta to the previous token's code
of the same channel, and the code given the previous token's code. The lowest of
them bounds what a lossless coder of that model would reach (its tables not
counted). Scales, minimums and block padding are reported as they are stored.

    bench/kv_code_entropy.py int8.qkvctx int4.qkvctx int2.qkvctx [--json OUT]
"""
import argparse
import json
import struct
import sys

import numpy as np

CODE_BITS = {2: 8, 3: 4, 4: 3, 5: 2}  # KvType q8, q4, q3, q2
TILE_ALIGN = 32


def round_up(x, a):
    return (x + a - 1) // a * a


def read_context(path):
    """Header fields and block table of a context file (version 2 or 3)."""
    data = open(path, "rb").read()
    if data[:6] != b"QKVCTX":
        sys.exit(f"{path}: not a portable context file (magic)")
    layers, _, kv_heads, head_dim = struct.unpack_from("<4I", data, 40)
    (block_tokens,) = struct.unpack_from("<I", data, 56)
    (flags,) = struct.unpack_from("<I", data, 12)
    if flags & 1:
        sys.exit(f"{path}: encrypted; export it without --key")
    tokens, text_bytes, segments, n_blocks = struct.unpack_from("<4I", data, 80)
    table = round_up(128 + 4 * tokens + text_bytes, 8) + 8 * segments
    blocks = [struct.unpack_from("<IIIIQ", data, table + 40 * i) for i in range(n_blocks)]
    return data, layers, kv_heads, head_dim, block_tokens, blocks


def tile_layout(codec, block_tokens, head_dim):
    """(bits, code bytes, param bytes as stored, padded tile bytes); tile_layout() in kv_format.cpp."""
    kind, axis, group = codec & 0xFF, (codec >> 8) & 0xFF, codec >> 16
    bits = CODE_BITS[kind]
    code_bytes = block_tokens * head_dim // 8 * bits
    n_params = head_dim if axis == 1 else block_tokens * head_dim // (group or head_dim)
    param_bytes = round_up(n_params, 8) * 4
    tile = round_up(round_up(code_bytes, 4) + param_bytes + 1, TILE_ALIGN)
    return bits, code_bytes, n_params * 4, tile


def unpack_tile(raw, bits, block_tokens, head_dim):
    """Codes of one tile: 8 codes per `bits` bytes, code i at bit i * bits (pack_row)."""
    units = np.frombuffer(raw, np.uint8).reshape(block_tokens, head_dim // 8, bits).astype(np.uint64)
    word = np.zeros(units.shape[:2], np.uint64)
    for k in range(bits):
        word |= units[:, :, k] << np.uint64(8 * k)
    mask = np.uint64((1 << bits) - 1)
    codes = [((word >> np.uint64(i * bits)) & mask).astype(np.uint8) for i in range(8)]
    return np.stack(codes, axis=2).reshape(block_tokens, head_dim)


def entropy(counts):
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log2(p)).sum())


def weighted(groups, levels):
    """Mean entropy of the groups' own tables, weighted by their sizes."""
    total = sum(g.size for g in groups)
    return sum(entropy(np.bincount(g.ravel(), minlength=levels)) * g.size for g in groups) / total


def analyse(path):
    data, layers, kv_heads, head_dim, block_tokens, blocks = read_context(path)
    rows = []
    for side, name in ((0, "K"), (1, "V")):
        tiles, stored_params, full = [], 0, 0
        for k_codec, v_codec, _flags, fill, payload in blocks:
            codec = (k_codec, v_codec)[side]
            if (codec & 0xFF) not in CODE_BITS or fill != block_tokens:
                continue  # hot (f16) and partly filled blocks stay as they are
            full += 1
            bits, code_bytes, param_bytes, tile = tile_layout(codec, block_tokens, head_dim)
            base = payload + (0 if side == 0 else layers * kv_heads * tile_layout(k_codec, block_tokens, head_dim)[3])
            for i in range(layers * kv_heads):
                start = base + i * tile
                tiles.append(unpack_tile(data[start:start + code_bytes], bits, block_tokens, head_dim))
                stored_params += param_bytes
        if not tiles:
            continue
        levels = 1 << bits
        c = np.stack(tiles).reshape(full, layers * kv_heads, block_tokens, head_dim)
        per_channel = [c[:, i, :, j] for i in range(c.shape[1]) for j in range(head_dim)]
        delta = (c[:, :, 1:, :].astype(np.int32) - c[:, :, :-1, :]) + levels
        conditional = 0.0
        for i in range(c.shape[1]):
            prev, cur = c[:, i, :-1, :].ravel().astype(np.int64), c[:, i, 1:, :].ravel()
            joint = np.bincount(prev * levels + cur, minlength=levels * levels).reshape(levels, levels)
            conditional += sum(entropy(joint[a]) * joint[a].sum() for a in range(levels) if joint[a].sum())
        conditional /= c[:, :, 1:, :].size
        rows.append({
            "file": path, "side": name, "bits": bits, "codes": int(c.size),
            "h_one_table": entropy(np.bincount(c.ravel(), minlength=levels)),
            "h_per_channel": weighted(per_channel, levels),
            "h_delta_prev_token": weighted([delta[:, i] for i in range(c.shape[1])], 2 * levels),
            "h_given_prev_token": conditional,
            "param_bytes_per_code": stored_params / c.size,
        })
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    rows = [r for f in args.files for r in analyse(f)]
    print(f"{'file':<28} {'side':>4} {'bits':>4} {'one table':>9} {'per chan':>9} {'delta':>7} {'|prev':>7} {'best saves':>10}")
    for r in rows:
        best = min(r["h_one_table"], r["h_per_channel"], r["h_delta_prev_token"], r["h_given_prev_token"])
        r["best_saving"] = 1 - best / r["bits"]
        print(f"{r['file'][-28:]:<28} {r['side']:>4} {r['bits']:>4} {r['h_one_table']:9.3f} {r['h_per_channel']:9.3f} "
              f"{r['h_delta_prev_token']:7.3f} {r['h_given_prev_token']:7.3f} {100 * r['best_saving']:9.1f}%")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
