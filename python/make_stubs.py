"""Regenerates python/qkvshare/_core.pyi from the built extension.

nanobind's stubgen writes the signatures; the replacements below give the
arguments and results that the bindings take as generic Python objects
(prompts, NumPy logits, dicts) their real types. Run after changing a binding:

    PYTHONPATH=<folder holding the built qkvshare package> python python/make_stubs.py
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "qkvshare" / "_core.pyi"

HEADER = '''from collections.abc import Iterator, Sequence
from typing import Any

import numpy
import numpy.typing

class Error(RuntimeError):
    """Base of every qkvshare error; `code` names the library's ErrorCode."""
    code: str

class InvalidArgument(Error, ValueError): ...
class BadModelFile(Error): ...
class BadTokenizer(Error): ...
class Unsupported(Error): ...
class IOFailure(Error, OSError): ...
class ContextFull(Error): ...
class OutOfMemory(Error, MemoryError): ...
class BadDescriptor(Error): ...
class BadWorkflow(Error): ...
class InternalError(Error): ...

__version__: str
'''

REPLACE = [
    ("def chat_template(self, messages: object,",
     "def chat_template(self, messages: Sequence[dict[str, str] | tuple[str, str]],"),
    ("def __iter__(self) -> object: ...", "def __iter__(self) -> Iterator[str]: ..."),
    ("prompt: object", "prompt: str | Sequence[int]"),
    ("special: bool = False) -> object:", "special: bool = False) -> numpy.typing.NDArray[numpy.float32]:"),
    ("def logits(self) -> object:", "def logits(self) -> numpy.typing.NDArray[numpy.float32] | None:"),
    ("def stats(self) -> object:", "def stats(self) -> dict[str, Any]:"),
    ("def to_dict(self) -> object: ...", "def to_dict(self) -> dict[str, Any]: ..."),
    ("def run(self, model: object,", "def run(self, model: Model | str,"),
    ("def check(self, descriptor: Descriptor, verify: bool = False) -> dict:",
     "def check(self, descriptor: Descriptor, verify: bool = False) -> dict[str, Any]:"),
    ("def handoff(self) -> dict:", "def handoff(self) -> dict[str, Any]:"),
    ("prompts: list,", "prompts: Sequence[str | Sequence[int]],"),
]


def main() -> int:
    tmp = OUT.with_suffix(".raw.pyi")
    subprocess.run([sys.executable, "-m", "nanobind.stubgen", "-q", "-m", "qkvshare._core", "-o", str(tmp)], check=True)
    text = tmp.read_text()
    tmp.unlink()
    # Drop the generated re-import of the exception classes: HEADER declares them.
    start = text.index("from qkvshare import (")
    end = text.index(")\n", start) + 2
    doc_end = text.index('"""', 3) + 3
    text = text[:doc_end] + "\n\n" + HEADER + text[end:]
    text = text.replace("from collections.abc import Sequence\n", "", 1)
    for old, new in REPLACE:
        if old not in text:
            raise SystemExit(f"make_stubs: '{old}' not in the generated stub; update REPLACE")
        text = text.replace(old, new)
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
