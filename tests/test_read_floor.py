"""tools/read_floor.py: every way it times must read every byte it is given (a probe
that skipped some would make the bandwidth floor too low, and every step look slow
beside it), or the floor would not be one."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))


def test_every_way_of_reading_sums_every_float_it_is_given():
    from read_floor import ReadFloor
    floor = ReadFloor(4 * 3_000_017)
    torch.manual_seed(0)
    n = 3_000_017  # no multiple of the threads, streams or vector widths
    floor.buf[:n] = torch.randint(0, 4, (n,)).float()  # small integers: every order sums exactly
    want = float(floor.buf[:n].double().sum())
    for name, read in floor.ways(4 * n).items():
        assert float(read()) == pytest.approx(want, abs=0.5), name
    seconds, way = floor.seconds(4 * n, repeat=2)
    assert seconds > 0 and way in floor.ways(4 * n)
