"""Weight formats of the linear layers: bits per weight, their packing and their scales.

Note [Weight formats]
    Only the seven projections of each block (q, k, v, o, gate, up, down) take the format; the
    embeddings, the norms, the biases and the output projection stay in the activation dtype, as
    bitsandbytes, GPTQ/AWQ and BitNet checkpoints keep them. A projection of ``out x in`` weights stores:

    * ``int8``: one byte per weight and one fp32 scale per output row (bitsandbytes' ``SCB``);
    * ``int4``: half a byte per weight and one fp16 scale per group of 128 consecutive inputs of a row
      (group-wise symmetric: ``out * ceil(in / 128)`` scales);
    * ``fp8``: one byte per weight and one fp32 scale per tensor (per-tensor scaling);
    * ``i2s``: BitNet's ternary I2_S, 2 bits per weight and one fp32 scale per tensor;
    * ``tl1``: ternary by table lookup, two weights in a 4-bit index (2 bits per weight), one fp32 scale;
    * ``tl2``: three weights in a 5-bit index (5/3 bits per weight, a row padded to whole bytes), one fp32 scale;
    * ``--weight-bits B``: ``ceil(out * in * B / 8)`` bytes and no scale (a format this table does not name:
      its scales, if any, are not counted, and the output says so).

    Activations stay 16-bit. The ternary formats are dequantized at run time into a workspace one layer at
    a time: :func:`gpumem.workspace.size_workspace` sizes it for the largest projection on the device, and
    the estimate holds it from the first forward on (Note [Overhead] in :mod:`.workload`). No other format
    has a workspace here: bitsandbytes and fp8 kernels dequantize tiles in registers or shared memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from ..errors import InvalidArgumentError

__all__ = ["WeightFormat", "WEIGHT_FORMATS", "weight_format", "custom_bits"]

INT4_GROUP = 128
"""Inputs per scale of the ``int4`` format."""


@dataclass(frozen=True)
class WeightFormat:
    """How a projection's weights are stored (Note [Weight formats])."""

    name: str
    bits_num: int
    """Bits per weight are ``bits_num / bits_den`` (5/3 for TL2)."""
    bits_den: int = 1
    scale_nbytes: int = 0
    """Bytes of one scale."""
    scales: str = "none"
    """``row`` (one per output row), ``group`` (per ``group`` inputs of a row), ``tensor`` or ``none``."""
    group: int = 0
    qtype: str = ""
    """The workspace sizing's quantization type for the ternary formats (``i2s``, ``tl1``, ``tl2``), else ``""``."""

    @property
    def bits_per_weight(self) -> float:
        """Bits per weight, scales not counted."""
        return self.bits_num / self.bits_den

    def nbytes(self, out_features: int, in_features: int) -> int:
        """Bytes of an ``out_features x in_features`` projection in this format, scales included."""
        if self.name == "tl2":  # rows padded to whole bytes
            packed = out_features * math.ceil(in_features * self.bits_num / (self.bits_den * 8))
        else:
            packed = math.ceil(out_features * in_features * self.bits_num / (self.bits_den * 8))
        n_scales = {"row": out_features, "group": out_features * math.ceil(in_features / max(self.group, 1)),
                    "tensor": 1, "none": 0}[self.scales]
        return packed + n_scales * self.scale_nbytes


WEIGHT_FORMATS: Mapping[str, WeightFormat] = {
    "int8": WeightFormat("int8", 8, 1, 4, "row"),
    "int4": WeightFormat("int4", 4, 1, 2, "group", INT4_GROUP),
    "fp8": WeightFormat("fp8", 8, 1, 4, "tensor"),
    "i2s": WeightFormat("i2s", 2, 1, 4, "tensor", qtype="i2s"),
    "tl1": WeightFormat("tl1", 2, 1, 4, "tensor", qtype="tl1"),
    "tl2": WeightFormat("tl2", 5, 3, 4, "tensor", qtype="tl2"),
}
"""The named formats (Note [Weight formats])."""


def weight_format(name: str) -> WeightFormat:
    """The named format; raises ``InvalidArgumentError`` naming the known ones."""
    key = name.strip().lower().replace("_", "") if isinstance(name, str) else None
    if key not in WEIGHT_FORMATS:
        raise InvalidArgumentError(f"unknown weight format {name!r:.40}; known: {', '.join(WEIGHT_FORMATS)}")
    return WEIGHT_FORMATS[key]


def custom_bits(bits: float) -> WeightFormat:
    """A format of ``bits`` per weight and no scales (``--weight-bits``): 1.58 and other fractions are kept in
    ten-thousandths of a bit, rounded up (never fewer bits than given: 1.5849 was 1.58 in hundredths)."""
    if isinstance(bits, bool) or not isinstance(bits, (int, float)) or not math.isfinite(bits) \
            or not 1.0 <= bits <= 32.0:
        raise InvalidArgumentError(f"weight bits must be a number in [1, 32], got {bits!r:.40}")
    den = 10_000
    num = math.ceil(round(bits * den, 6))  # round first: 1.58 * 10000 is 15800.000000000002 in binary
    div = math.gcd(num, den)
    return WeightFormat(f"{bits:g}-bit", num // div, den // div)
