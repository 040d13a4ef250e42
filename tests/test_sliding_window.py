"""Sliding-window models: pages wholly outside every row's window go back to the
pool every --swa-release-interval steps, and the answer does not change.

The oracle is the same request with releases effectively off (an interval longer
than the run). The pool's free count is the assertion that releases happened:
without them a 300-token generation holds every page it wrote."""
from __future__ import annotations

import random

import pytest

from engine import LocalEngine


@pytest.mark.parametrize("overlap", [False, True])
def test_pages_outside_the_window_are_released_and_outputs_are_unchanged(tiny_models, overlap):
    rng = random.Random(7)
    prompts = [[rng.randrange(5, 900) for _ in range(n)] for n in (100, 30, 9)]
    outs, peak_held = {}, {}
    for interval in (4, 10_000):
        eng = LocalEngine(tiny_models["mistral"], num_pages=512, page_size=4, max_batch_tokens=48,
                          overlap=overlap, swa_release_interval=interval)
        try:
            window = eng.runner.config.sliding_window
            assert window and window < 300, "the tiny mistral must have a window shorter than the run"
            rids = [eng.submit(p, 200, ignore_eos=True) for p in prompts]
            held = 0
            while not all(r in eng.finish for r in rids):
                eng.step()
                held = max(held, eng.pool.num_pages - eng.pool.free_count)
            eng.run_to_idle()
            outs[interval] = [eng.outputs[r] for r in rids]
            peak_held[interval] = held
            assert eng.pool.free_count + eng.core.cache.tree.num_pages == eng.pool.num_pages
        finally:
            eng.close()
    assert outs[4] == outs[10_000], "releasing out-of-window pages changed the answer"
    # Each row needs at most ceil((window + page) / page) + a few pages live at once.
    assert peak_held[4] < peak_held[10_000] * 0.7, peak_held
