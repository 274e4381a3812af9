"""Shared pieces of the workspace tests: a scripted tenant and a layer that fills a small card."""

from __future__ import annotations

from dataclasses import dataclass

from gpumem.sim.pressure import Scenario, TenantContext

BIG_LAYER = (32768, 32768, "i2s")
"""2 GiB of fp16 dequantized weights: more than a 2 GB card has, so the workspace is memory-bound (tiled)."""


@dataclass(frozen=True)
class Script(Scenario):
    """At each ``(at_s, nbytes)``: take ``nbytes`` (> 0) or give back ``-nbytes`` (< 0)."""

    actions: tuple[tuple[float, int], ...]

    def process(self, ctx: TenantContext):
        for at_s, nbytes in self.actions:
            if at_s > ctx.env.now:
                yield ctx.env.timeout(at_s - ctx.env.now)
            if nbytes > 0:
                ctx.take(nbytes)
            elif ctx.held_nbytes:
                ctx.give(min(-nbytes, ctx.held_nbytes))
