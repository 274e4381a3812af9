"""Memory estimation for decoder LLMs: peak allocated (formulas walked over a synthetic allocation trace),
peak reserved (that trace replayed through gpumem's allocator models), and the largest batch that fits.

See ``docs/estimation.md``.
"""

from .fit import (DEFAULT_MARGINS, DEFAULT_NEW_TOKENS, FitResult, FitTry, InjectedFaultError, ReservedEstimate,
                  estimate_peak_reserved, find_max_batch, replay_inference, usable_memory)
from .formats import WEIGHT_FORMATS, WeightFormat, custom_bits, weight_format
from .formulas import (
    MemoryEstimate,
    TrainingEstimate,
    estimate_inference_memory,
    estimate_kv_cache_memory,
    estimate_model_memory,
    estimate_training_memory,
)
from .shape import DTYPE_BYTES, ModelShape, from_hf_config
from .workload import Category, WorkloadTrace, inference_trace, stream_inference, training_trace

__all__ = [
    "Category", "DEFAULT_MARGINS", "DTYPE_BYTES", "FitResult", "FitTry", "MemoryEstimate", "ModelShape",
    "ReservedEstimate", "TrainingEstimate", "WorkloadTrace", "estimate_inference_memory",
    "estimate_kv_cache_memory", "estimate_model_memory", "estimate_peak_reserved", "estimate_training_memory",
    "find_max_batch", "from_hf_config", "inference_trace", "training_trace", "DEFAULT_NEW_TOKENS",
    "InjectedFaultError", "replay_inference", "usable_memory", "stream_inference", "WEIGHT_FORMATS", "WeightFormat",
    "custom_bits", "weight_format",
]
