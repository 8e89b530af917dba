"""QKVShare for Python: one model for many agents, KV contexts handed over as descriptors.

    import qkvshare as q
    model = q.Model.load("SmolLM2-135M-Instruct.Q4_1.gguf")
    engine = q.Engine(model, threads=2)
    pool = q.Pool.anonymous()
    writer = engine.session(kv="int8", pool=pool)
    for piece in writer.stream("Once upon a time", max_tokens=32, temperature=0):
        print(piece, end="")
    desc = writer.seal("writer").grant("reviewer")      # 256 bytes, picklable
    reviewer = pool.open(desc, engine, agent="reviewer")  # continues on the same KV blocks

See docs/python.md.
"""
from ._core import (  # noqa: F401
    BadDescriptor,
    BadModelFile,
    BadTokenizer,
    BadWorkflow,
    Context,
    ContextFull,
    Descriptor,
    Engine,
    Error,
    GenerateResult,
    InternalError,
    InvalidArgument,
    IOFailure,
    Model,
    OutOfMemory,
    Pool,
    RunReport,
    Session,
    StepMetrics,
    Stream,
    Unsupported,
    Workflow,
    __version__,
)

__all__ = [
    "BadDescriptor", "BadModelFile", "BadTokenizer", "BadWorkflow", "Context", "ContextFull", "Descriptor",
    "Engine", "Error", "GenerateResult", "InternalError", "InvalidArgument", "IOFailure", "Model", "OutOfMemory",
    "Pool", "RunReport", "Session", "StepMetrics", "Stream", "Unsupported", "Workflow", "__version__",
]
