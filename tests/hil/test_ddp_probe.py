"""The DDP probe (hil/ddp_probe.py) without GPUs: the bit-for-bit comparison and the refusal of too few GPUs."""

from __future__ import annotations

import pytest

from hil import ddp_probe as dp


def _rank(rank, losses, means, **extra):
    return {"rank": rank, "losses": [float(v).hex() for v in losses], "mean_losses": [float(v).hex() for v in means],
            **extra}


def test_identical_losses_compare_equal_rank_by_rank():
    nat = [_rank(1, [2.0, 1.5], [2.0, 1.4], native={"reserved_bytes.all.peak": 10}), _rank(0, [2.5, 1.0], [2.0, 1.4])]
    gm = [_rank(0, [2.5, 1.0], [2.0, 1.4], gpumem={"num_allocs": 7}, consistency_problems=[]),
          _rank(1, [2.0, 1.5], [2.0, 1.4])]
    out = dp.compare({"native": nat, "gpumem": gm})
    assert [(c.rank, c.identical, c.first_difference) for c in out] == [(0, True, None), (1, True, None)]
    assert out[0].gpumem == {"num_allocs": 7} and out[1].native == {"reserved_bytes.all.peak": 10}


def test_one_bit_of_difference_is_found_at_its_step():
    nat = [_rank(0, [2.5, 1.0, 0.5], [2.5, 1.0, 0.5])]
    gm = [_rank(0, [2.5, 1.0000000000000002, 0.5], [2.5, 1.0, 0.5], consistency_problems=["x"])]
    (c,) = dp.compare({"native": nat, "gpumem": gm})
    assert (c.identical, c.first_difference, c.consistency_problems) == (False, 1, ["x"])
    short = [_rank(0, [2.5], [])]
    (c,) = dp.compare({"native": nat, "gpumem": short})
    assert not c.identical


def test_too_few_gpus_is_refused(capsys):
    torch = pytest.importorskip("torch")
    n = torch.cuda.device_count()
    assert dp.main(["run", "--nproc", str(n + 1)]) == 2
    assert f"needs {n + 1} GPUs" in capsys.readouterr().err
    assert dp.main(["run", "--nproc", "0"]) == 2
