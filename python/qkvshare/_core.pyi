"""
QKVShare: one model for many agents, quantized KV contexts handed over as descriptors
"""

from collections.abc import Iterator, Sequence
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


class Model:
    """
    A loaded model: weights mapped from the file, tokenizer, configuration.
    """

    @staticmethod
    def load(path: str, tokenizer: str | None = None) -> Model:
        """
        Loads a GGUF or llama2.c model (llama2.c needs `tokenizer`, e.g. tok512.bin).
        """

    @property
    def path(self) -> str: ...

    @property
    def tokenizer_path(self) -> str: ...

    @property
    def format(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def architecture(self) -> str: ...

    @property
    def n_layers(self) -> int: ...

    @property
    def d_model(self) -> int: ...

    @property
    def n_heads(self) -> int: ...

    @property
    def n_kv_heads(self) -> int: ...

    @property
    def vocab_size(self) -> int: ...

    @property
    def context_length(self) -> int: ...

    @property
    def bos_id(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    @property
    def add_bos(self) -> bool:
        """
        Whether prompts start with BOS (prefill/generate add it to a session's first prompt).
        """

    @property
    def fingerprint(self) -> str:
        """32 hex digits naming the model in descriptors."""

    def tokenize(self, text: str, add_bos: bool = False, special: bool = False) -> list[int]:
        """
        Text to token ids. `special`: texts such as <|im_start|> become their ids.
        """

    def detokenize(self, ids: Sequence[int]) -> str:
        """Token ids to text (invalid UTF-8 is replaced by U+FFFD)."""

    def chat_template(self, messages: Sequence[dict[str, str] | tuple[str, str]], add_generation_prompt: bool = True) -> str:
        """
        The model's chat format (ChatML) of [{'role':..., 'content':...}, ...]; tokenize it with special=True.
        """

    def __repr__(self) -> str: ...

class Engine:
    """Runs the model's forward pass for any number of sessions."""

    def __init__(self, model: Model, threads: int = 0, max_batch: int = 256, exact_matmul: bool = False, token_budget: int | None = None, max_sessions: int = 0, float_activations: bool = False) -> None:
        """
        threads=0: all hardware threads. exact_matmul: float activations (slow; for reference checks). float_activations: the SIMD kernels with float activations (weights dequantized to f32 once, 4 bytes per weight: float_copy_bytes). The step API's scheduler: token_budget, tokens per forward pass (default max_batch; a long prompt is chunked so decoding sessions keep their pace); max_sessions, requests per pass (0: no limit). Under either limit, requests with a higher `priority` run first.
        """

    @property
    def model(self) -> Model: ...

    @property
    def float_copy_bytes(self) -> int:
        """Bytes of the f32 weight copies float_activations made (0 otherwise)."""

    @property
    def threads(self) -> int: ...

    def generate_batch(self, sessions: Sequence[Session], prompts: Sequence[str | Sequence[int]], max_tokens: int = 128, temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0, repeat_last_n: int = 64, seed: int = 0, stop: Sequence[str] = [], ignore_eos: bool = False, special: bool = False, priorities: Sequence[int] | None = None) -> list[GenerateResult]:
        """
        Generates for several sessions of this engine together through the step API: each step is one forward pass carrying the next token of every decoding session and prompt chunks of the others. Returns one GenerateResult per session; a session that fails ends alone, and its error is raised after the others have finished.
        """

    def session(self, kv: str = 'int8', pool: Pool | None = None, capacity: int = 0) -> Session:
        """
        A new session. kv: a KV format (f32, f16, int8, int4, int2, k8v4, ...; 'dense': the f32 reference cache). pool: a Pool to keep the KV in (needed to seal and hand it on); None: a private pool. capacity: tokens (0: the model's context length).
        """

class GenerateResult:
    """What one generate() or stream() produced."""

    @property
    def tokens(self) -> list[int]:
        """Generated ids (an end-of-generation token is not included)."""

    @property
    def text(self) -> str: ...

    @property
    def stop_reason(self) -> str:
        """max_tokens, end_of_generation, stop_string or context_full."""

    @property
    def prefill_tokens(self) -> int: ...

    @property
    def decode_tokens(self) -> int: ...

    @property
    def prefill_seconds(self) -> float: ...

    @property
    def decode_seconds(self) -> float: ...

    def __repr__(self) -> str: ...

class Stream:
    """Iterator of text pieces of a generation; see Session.stream()."""

    def __iter__(self) -> Iterator[str]: ...

    def __next__(self) -> str: ...

    def close(self) -> None:
        """
        Stops generating (cancels the request); the tokens so far stay in the session.
        """

    def __enter__(self) -> object: ...

    def __exit__(self, *args) -> None: ...

    @property
    def done(self) -> bool: ...

    @property
    def result(self) -> GenerateResult:
        """The GenerateResult so far (final once the iterator is exhausted)."""

class Session:
    """An agent's decoding state: its tokens and their KV cache."""

    def prefill(self, prompt: str | Sequence[int], all_logits: bool = False, special: bool = False) -> numpy.typing.NDArray[numpy.float32]:
        """
        Feeds a str or token ids; returns the next-token logits (a read-only NumPy view, [vocab], or [tokens, vocab] with all_logits). A str is encoded with BOS first when the session is empty and the model adds BOS; `special` parses texts such as <|im_start|>.
        """

    def generate(self, prompt: str | Sequence[int], max_tokens: int = 128, temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0, repeat_last_n: int = 64, seed: int = 0, stop: Sequence[str] = [], ignore_eos: bool = False, special: bool = False, priority: int = 0) -> GenerateResult:
        """
        Appends the prompt and generates (blocking); sampling options as the CLI's (temperature 0: greedy). priority: higher runs first when the engine's token_budget or max_sessions limits a pass.
        """

    def stream(self, prompt: str | Sequence[int], max_tokens: int = 128, temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, repeat_penalty: float = 1.0, repeat_last_n: int = 64, seed: int = 0, stop: Sequence[str] = [], ignore_eos: bool = False, special: bool = False, priority: int = 0) -> Stream:
        """
        Like generate(), as an iterator of text pieces. Each next() steps the engine's scheduler until text arrives: every stream, generate() and generate_batch() of this engine in progress advances in the same forward pass (the GIL is released while the model runs).
        """

    @property
    def logits(self) -> numpy.typing.NDArray[numpy.float32] | None:
        """
        Logits of the last prefill() (read-only NumPy view, no copy); None before any and after generate/stream.
        """

    @property
    def tokens(self) -> list[int]:
        """Every token of the session, the pending one included."""

    @property
    def n_past(self) -> int:
        """Tokens whose KV is stored."""

    @property
    def pending_token(self) -> int | None:
        """
        The last generated token when no pass ran for it yet (it is fed first by the next call).
        """

    @property
    def capacity(self) -> int: ...

    @property
    def kv(self) -> str:
        """The KV format."""

    @property
    def text(self) -> str: ...

    @property
    def shared(self) -> bool:
        """Whether the KV is in a Pool."""

    @property
    def handoff(self) -> dict[str, Any]:
        """
        How pool.open() made this session: kv (continued on the producer's blocks) or fallback (none, model, format, checksum, shape, requested) with detail.
        """

    @property
    def closed(self) -> bool: ...

    def close(self) -> None:
        """Frees the session's KV now (later calls raise)."""

    def __repr__(self) -> str: ...

    def seal(self, producer: str) -> Context:
        """
        Seals the session's context (its last generated token fed first) and returns the producer's claim. The session may go on appending: it copies the partly filled tail block first.
        """

    def splice(self, pool: Pool, descriptor: Descriptor, agent: str, begin: int = 0, end: int | None = None, recompute: float = 0.15, guard: bool = True, threshold: float | None = None, release: bool = True) -> dict:
        """
        Splices tokens [begin, end) of a context granted to `agent` onto the end of this session (docs/design.md handoff mode splice): the session keeps its own prefix (its role), the spliced tokens' KV is reused at a position offset after the first `recompute` fraction of them is run again under this prefix; the guard recomputes more (up to all of it, a text re-read) when its estimate of the deviation is above `threshold` (None: calibrated for the session's KV format). Returns what it did: tokens, recomputed, reused, probe_tokens, fraction, estimate, escalated, text, seconds. Raises BadDescriptor for a stale, forged or foreign descriptor and InvalidArgument for a bad range or a session outside `pool`.
        """

class Descriptor:
    """
    The 256-byte value naming a sealed context for one grantee (bytes(d), pickle, d.json()).
    """

    @staticmethod
    def from_bytes(data: bytes) -> Descriptor:
        """
        Decodes and validates 256 bytes (raises BadDescriptor naming the field).
        """

    def __bytes__(self) -> bytes: ...

    def json(self) -> str:
        """Every field as one JSON object (a str)."""

    def __getstate__(self) -> bytes: ...

    def __setstate__(self, arg: bytes, /) -> None: ...

    def __eq__(self, arg: object, /) -> bool: ...

    def __hash__(self) -> int: ...

    @property
    def context_id(self) -> int: ...

    @property
    def pool_id(self) -> int: ...

    @property
    def token_count(self) -> int: ...

    @property
    def producer(self) -> str: ...

    @property
    def grantee(self) -> str: ...

    @property
    def kv(self) -> str:
        """The KV format of the context."""

    @property
    def fingerprint(self) -> str: ...

    def __repr__(self) -> str: ...

class Context:
    """A producer's claim on a sealed context; grant() hands it on."""

    def grant(self, agent: str) -> Descriptor:
        """
        A descriptor that only `agent` can open (one per consumer; several make a fork).
        """

    def release(self) -> None:
        """
        Drops the producer's claim; the context lives on while a grant is unopened or open.
        """

    def revoke(self) -> None:
        """Ends the context and every grant of it."""

    @property
    def id(self) -> int: ...

    @property
    def tokens(self) -> int:
        """Token count."""

    @property
    def producer(self) -> str: ...

    @property
    def released(self) -> bool: ...

    def __enter__(self) -> object: ...

    def __exit__(self, *args) -> None: ...

    def __repr__(self) -> str: ...

class Pool:
    """
    A shared context pool: the KV arena and the registry of sealed contexts.
    """

    @staticmethod
    def anonymous(bytes: int = 268435456, block_tokens: int = 32, max_contexts: int = 64, max_grants: int = 256, max_processes: int = 32, max_tokens: int = 16384) -> Pool:
        """A pool in this process's memory (and children it forks)."""

    @staticmethod
    def create(name: str, bytes: int = 268435456, block_tokens: int = 32, max_contexts: int = 64, max_grants: int = 256, max_processes: int = 32, max_tokens: int = 16384, unlink_on_close: bool = True) -> Pool:
        """
        A named POSIX shared-memory pool (/dev/shm/qkvshare.NAME) other processes can attach; its name is removed when this handle closes (unlink_on_close), attached processes keep their mapping.
        """

    @staticmethod
    def attach(name: str) -> Pool:
        """Maps a pool another process created."""

    def open(self, descriptor: Descriptor, engine: Engine, agent: str, mode: str = 'auto', verify: bool = False, capacity: int = 0, release: bool = True) -> Session:
        """
        Opens a descriptor granted to `agent` as a session of `engine` that continues the context. mode: 'auto' (the KV, else a text re-prefill with the reason in session.handoff), 'kv' (the KV or BadDescriptor), 'text'. verify: rehash every block first. release: end the grant once opened (the session holds its own block references, so the descriptor goes stale; False keeps it openable until pool.release()). Forged, stale or foreign descriptors raise BadDescriptor.
        """

    def release(self, descriptor: Descriptor, agent: str) -> None:
        """The grantee is done with the descriptor (it goes stale)."""

    def revoke(self, descriptor: Descriptor, agent: str) -> None:
        """The producer `agent` ends the context and all its grants."""

    def check(self, descriptor: Descriptor, verify: bool = False) -> dict[str, Any]:
        """
        Checks a descriptor without opening it (never raises for a bad one: 'problem' says what is wrong).
        """

    def stats(self) -> dict[str, Any]:
        """
        Counters and occupancy (the same JSON as `qkvshare pool stat`), as a dict.
        """

    def reap(self) -> int:
        """Reclaims what dead processes held; returns how many."""

    def close(self) -> None:
        """Drops this handle (sessions and contexts from it keep working)."""

    @property
    def closed(self) -> bool: ...

    @property
    def name(self) -> str | None: ...

    @property
    def id(self) -> int: ...

    def __enter__(self) -> object: ...

    def __exit__(self, *args) -> None: ...

    def __repr__(self) -> str: ...

class StepMetrics:
    """One step of a workflow run."""

    @property
    def step(self) -> str: ...

    @property
    def agent(self) -> str: ...

    @property
    def handoff(self) -> str:
        """new, text, continue, fork or fallback:<reason>."""

    @property
    def ttft_seconds(self) -> float: ...

    @property
    def seconds(self) -> float: ...

    @property
    def handoff_seconds(self) -> float: ...

    @property
    def prefill_computed(self) -> int: ...

    @property
    def prefill_reused(self) -> int: ...

    @property
    def decode_tokens(self) -> int: ...

    @property
    def kv_bytes(self) -> int: ...

    @property
    def output_tokens(self) -> list[int]: ...

    @property
    def output(self) -> str: ...

    def __repr__(self) -> str: ...

class RunReport:
    """What a workflow run measured (the JSON of `qkvshare run --json`)."""

    @property
    def workflow(self) -> str: ...

    @property
    def mode(self) -> str: ...

    @property
    def kv(self) -> str: ...

    @property
    def steps(self) -> list[StepMetrics]: ...

    @property
    def total_seconds(self) -> float: ...

    @property
    def load_seconds(self) -> float: ...

    @property
    def peak_kv_bytes(self) -> int: ...

    @property
    def weight_copies_bytes(self) -> int: ...

    @property
    def prefill_computed(self) -> int: ...

    @property
    def prefill_reused(self) -> int: ...

    @property
    def contexts_alive_at_end(self) -> int: ...

    @property
    def pool_blocks_used_at_end(self) -> int: ...

    def json(self) -> str:
        """The report as JSON text, as `qkvshare run --json` writes it."""

    def to_dict(self) -> dict[str, Any]: ...

    def __repr__(self) -> str: ...

class Workflow:
    """A multi-agent workflow (YAML; schema in docs/workflows.md)."""

    @staticmethod
    def load(path: str) -> Workflow:
        """
        Parses and validates a workflow file (BadWorkflow names file:line and the reason).
        """

    @staticmethod
    def parse(text: str, source: str = '<workflow>') -> Workflow: ...

    @property
    def name(self) -> str: ...

    @property
    def task(self) -> str: ...

    @property
    def steps(self) -> list[str]: ...

    @property
    def agents(self) -> list[str]: ...

    def run(self, model: Model | str, mode: str = 'qkvshare', kv: str = 'int8', threads: int = 0, context: int = 4096, max_tokens_cap: int = 0, exact_matmul: bool = False, float_activations: bool = False) -> RunReport:
        """
        Runs the DAG (mode: qkvshare, shared-text or independent). The run loads the model file itself (independent mode needs one private copy per agent), so a Model argument only names the file.
        """
