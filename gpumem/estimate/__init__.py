"""Memory estimation for decoder LLMs: peak allocated (formulas walked over a synthetic allocation trace),
peak reserved (that trace replayed through gpumem's allocator models), and the largest batch that fits.

See ``docs/estimation.md``.
"""

from .fit import DEFAULT_MARGINS, FitResult, FitTry, ReservedEstimate, estimate_peak_reserved, find_max_batch
from .formulas import (
    MemoryEstimate,
    TrainingEstimate,
    estimate_inference_memory,
    estimate_kv_cache_memory,
    estimate_model_memory,
    estimate_training_memory,
)
from .shape import DTYPE_BYTES, ModelShape, from_hf_config
from .workload import Category, WorkloadTrace, inference_trace, training_trace

__all__ = [
    "Category", "DEFAULT_MARGINS", "DTYPE_BYTES", "FitResult", "FitTry", "MemoryEstimate", "ModelShape",
    "ReservedEstimate", "TrainingEstimate", "WorkloadTrace", "estimate_inference_memory",
    "estimate_kv_cache_memory", "estimate_model_memory", "estimate_peak_reserved", "estimate_training_memory",
    "find_max_batch", "from_hf_config", "inference_trace", "training_trace",
]
