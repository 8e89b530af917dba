"""A direct port of llama2.c run.c's tokenizer (encode and decode), kept naive
(O(n^2) merging) on purpose: it is the reference that the C++ tokenizer is
compared with, so it follows run.c line by line rather than being clever.

Usage as a script: python3 tokenizer_llama2c.py TOKENIZER_BIN TEXT
prints {"ids": [...]} like `qkvshare tokenize` does (no BOS).
"""

import json
import struct
import sys


class Llama2cTokenizer:
    def __init__(self, path, vocab_size=512):
        data = open(path, "rb").read()
        (self.max_token_length,) = struct.unpack_from("<i", data, 0)
        offset = 4
        self.vocab = []
        self.scores = []
        for _ in range(vocab_size):
            score, length = struct.unpack_from("<fi", data, offset)
            offset += 8
            self.vocab.append(data[offset : offset + length])
            offset += length
            self.scores.append(score)
        # run.c's str_lookup is a bsearch over the sorted vocabulary; the
        # vocabularies used here have no duplicate pieces, so a dict is the same.
        self.lookup = {}
        for i, piece in enumerate(self.vocab):
            self.lookup.setdefault(piece, i)

    def encode(self, text: bytes):
        """run.c encode(t, text, bos=0, eos=0, ...)."""
        tokens = []
        if len(text) > 0:
            tokens.append(self.lookup.get(b" ", -1))  # the dummy prefix
        buf = b""
        for i, c in enumerate(text):
            if (c & 0xC0) != 0x80:
                buf = b""
            buf += bytes([c])
            nxt = text[i + 1] if i + 1 < len(text) else 0
            if (nxt & 0xC0) == 0x80 and len(buf) < 4:
                continue
            tid = self.lookup.get(buf, -1)
            if tid != -1:
                tokens.append(tid)
            else:
                tokens.extend(b + 3 for b in buf)  # byte fallback: <0x00> is id 3
            buf = b""
        while True:
            best_score = -1e10
            best_id = -1
            best_idx = -1
            for i in range(len(tokens) - 1):
                tid = self.lookup.get(self.vocab[tokens[i]] + self.vocab[tokens[i + 1]], -1)
                if tid != -1 and self.scores[tid] > best_score:
                    best_score = self.scores[tid]
                    best_id = tid
                    best_idx = i
            if best_idx == -1:
                break
            tokens[best_idx] = best_id
            del tokens[best_idx + 1]
        return tokens

    def decode_piece(self, prev, token):
        """run.c decode(): strips the space after BOS, maps <0xNN> to the byte."""
        piece = self.vocab[token]
        if prev == 1 and piece[:1] == b" ":
            piece = piece[1:]
        if len(piece) == 6 and piece.startswith(b"<0x") and piece.endswith(b">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece


def main():
    tok = Llama2cTokenizer(sys.argv[1])
    print(json.dumps({"ids": tok.encode(sys.argv[2].encode("utf-8", "surrogateescape"))}))


if __name__ == "__main__":
    main()
