"""Which optimizer's steps mark a device: the rule gpumem.torch's automatic step marks follow (Note [Automatic
step marks] in :mod:`gpumem.torch`), and a snapshot's replay with them (Note [Two optimizers of one class] in
:mod:`gpumem.trace.optimizer_marks`).

A module of its own, importing nothing of gpumem, so that both can use it without either importing the other.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["HANDOVER_MIN_STEPS", "RARER_GAPS", "MarkerRule"]

#: Fewest steps of another optimizer, with none of the marker's between, that hand a device's marks over.
HANDOVER_MIN_STEPS = 16


#: Gaps in a row in which the marker stepped 2 to HANDOVER_MIN_STEPS times between two steps of one other optimizer
#: that hand it the marks (Note [Automatic step marks]: a critic's five steps per generator step).
RARER_GAPS = 2


@dataclasses.dataclass
class MarkerRule:
    """Which optimizer's steps mark a device (Note [Automatic step marks]): :meth:`stepped` is told each step's
    optimizer, by any key that compares equal for one optimizer, and says whether that step marks. Also how a
    snapshot's replay follows it (Note [Two optimizers of one class] in :mod:`gpumem.trace.optimizer_marks`)."""

    marker: Any = None    # the key of the optimizer whose steps mark
    others: int = 0       # steps of other optimizers since the marker's last
    others_max: int = 0   # the most such steps seen between two of the marker's
    mine: int = 0         # the marker's steps since another optimizer's last (or since it began marking)
    rarer: Any = None     # another optimizer that stepped after at least two of the marker's
    rarer_gaps: int = 0   # ... that many times in a row

    def stepped(self, key: Any) -> bool:
        """Whether the step of the optimizer ``key`` marks, after the hand-over rules."""
        if self.marker is not None and key == self.marker:
            self.others_max, self.others = max(self.others_max, self.others), 0
            self.mine += 1
            return True
        if self.marker is None:
            self._hand_to(key, 0)
            return True
        self.others += 1
        gap, self.mine = self.mine, 0
        if 2 <= gap <= HANDOVER_MIN_STEPS:   # a sub-iteration's steps between; not an auxiliary one's rare step
            self.rarer_gaps = self.rarer_gaps + 1 if self.rarer is not None and key == self.rarer else 1
            self.rarer = key
        else:
            self.rarer, self.rarer_gaps = None, 0
        if self.rarer_gaps >= RARER_GAPS:
            self._hand_to(key, gap)   # the old marker steps about `gap` times between the new one's
            return True
        if self.others >= max(HANDOVER_MIN_STEPS, 2 * self.others_max + 2):
            self._hand_to(key, 0)
            return True
        return False

    def _hand_to(self, key: Any, others_max: int) -> None:
        self.marker, self.others, self.others_max, self.mine, self.rarer, self.rarer_gaps = key, 0, others_max, 1, \
            None, 0
