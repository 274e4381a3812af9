"""A stateful Hypothesis test: other tenants come and go, the workspace is polled; its books always agree."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from workspace_helpers import BIG_LAYER

from gpumem.sim import SimDevice, Step, get_profile
from gpumem.units import MiB
from gpumem.workspace import InsufficientWorkspaceMemoryError, Workspace

RESERVE = 64 * MiB


class WorkspaceUnderTenants(RuleBasedStateMachine):
    """Tenants take and give memory; polls shrink and grow the workspace; nothing else ever fails."""

    def __init__(self) -> None:
        super().__init__()
        self.dev = SimDevice(get_profile("gtx-1050-2gb"))
        self.ws = Workspace(self.dev, *BIG_LAYER, reserve_nbytes=RESERVE)
        self.full = self.ws.nbytes

    @rule(nbytes_mib=st.integers(1, 1800), hold_ms=st.integers(1, 30))
    def tenant_arrives(self, nbytes_mib, hold_ms):
        self.dev.add_tenant(Step(nbytes=nbytes_mib * MiB, at_s=0.0, until_s=hold_ms * 1e-3))

    @rule(ms=st.integers(1, 10))
    def time_passes(self, ms):
        self.dev.advance(ms * 1e-3)

    @rule()
    def poll(self):
        before = self.ws.nbytes
        free_before = self.dev.mem_info().free_nbytes
        try:
            resized = self.ws.poll()
        except InsufficientWorkspaceMemoryError:
            assert self.ws.nbytes == 0 and self.ws.ptr is None
            return
        if resized and before and free_before < RESERVE:
            assert self.ws.nbytes < before  # a forced resize is a shrink
        if not resized:
            assert self.ws.nbytes == before

    @precondition(lambda self: self.ws.nbytes == 0)
    @rule()
    def ensure(self):
        try:
            self.ws.ensure()
        except InsufficientWorkspaceMemoryError:
            pass

    @invariant()
    def books_agree(self):
        ws = self.ws
        assert (ws.ptr is None) == (ws.nbytes == 0) == (ws.batch_size == 0)
        assert ws.allocator.allocated_nbytes >= ws.nbytes
        assert ws.nbytes <= self.full + 2 * MiB
        stats = ws.stats()
        assert stats.shrinks + stats.grows <= stats.polls + 1
        assert stats.peak_nbytes >= ws.nbytes

    def teardown(self):
        self.ws.close()
        assert self.dev.n_allocations == 0 and not self.dev.mapping_ranges()
        self.dev.close()


TestWorkspaceUnderTenants = WorkspaceUnderTenants.TestCase
TestWorkspaceUnderTenants.settings = settings(max_examples=15, stateful_step_count=25, deadline=None)
