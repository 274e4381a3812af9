"""The segment placement probe (no GPU here): its arguments, and its reading of where segments went, on a
scripted stand-in for PyTorch that places segments as the H200 placed the tied Qwen2 0.16B row's."""

from __future__ import annotations

import pytest

from hil.probes import segment_placement as probe

MiB = 1 << 20


@pytest.mark.parametrize("argv, why", [
    (["--count", "0"], "--count must be >= 1"),
    (["--sizes-mib", "10"], "each size an even number of MiB >= 12"),
    (["--sizes-mib", "12,x"], "whole MiB separated by commas"),
    (["--plan", "no-such-model"], "unknown plan 'no-such-model'"),
])
def test_refuses_bad_arguments(argv, why, capsys):
    with pytest.raises(SystemExit) as exc:
        probe.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: python -m hil.probes.segment_placement")
    assert why in err


class _FakeTensor:
    def __init__(self, addr: int) -> None:
        self.addr = addr

    def data_ptr(self) -> int:
        return self.addr


class _FakeCuda:
    def __init__(self, held: list[tuple[int, int]], addresses: list[int]) -> None:
        self.held = list(held)
        self.addresses = list(addresses)

    def memory_snapshot(self):
        return [{"address": a, "total_size": n} for a, n in self.held]


class _FakeTorch:
    """``torch.empty`` hands out the scripted addresses in turn, each a segment of the tensor's size."""

    uint8 = "uint8"

    def __init__(self, held, addresses) -> None:
        self.cuda = _FakeCuda(held, addresses)

    def empty(self, nbytes, dtype, device):
        addr = self.cuda.addresses.pop(0)
        self.cuda.held.append((addr, nbytes))
        return _FakeTensor(addr)


def test_a_pass_says_how_much_went_up_before_the_first_segment_below_everything():
    base = 0x7F2F_E6C0_0000  # the weights end here (run 5's tied process)
    held = [(0x7F2F_DA00_0000, 64 * MiB), (0x7F2F_DE00_0000, 20 * MiB)]
    up = [base + 2 * MiB, base + 90 * MiB, base + 150 * MiB]  # up in the free range above the weights
    down = [0x7F2F_0000_0000, 0x7F2E_FE00_0000]  # then below everything, each under the one before
    torch = _FakeTorch(held, up + down)
    out = probe._pass(torch, [12, 20], 5)
    placed = out["placed"]
    assert [p["size_mib"] for p in placed] == [12, 20, 12, 20, 12]
    assert [p["above_previous"] for p in placed] == [None, True, True, False, False]
    assert [p["below_everything"] for p in placed] == [False, False, False, True, True]
    assert out["mib_placed_before_the_first_below_everything"] == 12 + 20 + 12
    assert out["n_above_previous"] == 2 and out["each_its_own_segment"]
    assert out["held_bottom"] == held[0][0] and out["held_top"] == held[1][0] + 20 * MiB
