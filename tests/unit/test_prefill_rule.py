"""The load-or-recompute rule (kvd.planner.prefill): a prefill profile read from its file and
interpolated, and the number of matched blocks whose load, plus computing the rest, finishes first."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvd.planner.prefill import FORMAT, PrefillProfile, best_stop

BLOCK = 16


def profile(per_token_s: float = 1e-3, fixed_s: float = 0.01, host_load_s_per_token: float = 0.0) -> PrefillProfile:
    """Prefill costs fixed_s plus per_token_s per new token, more with a longer prefix (attention)."""
    new, prefixes = np.array([16, 256, 1024]), np.array([0, 1024])
    seconds = fixed_s + np.outer(new, [per_token_s, 1.5 * per_token_s])
    return PrefillProfile.from_dict({"format": FORMAT, "model": "m", "engine": "e", "new_tokens": new.tolist(),
                                     "prefixes": prefixes.tolist(), "seconds": seconds.tolist(),
                                     "host_load_s_per_token": host_load_s_per_token})


def test_the_profile_interpolates_between_its_points_and_extends_along_its_last_slope():
    p = profile()
    got = p.prefill_s(np.array([16, 136, 1024, 2048, 8, 256]), np.array([0, 0, 512, 0, 0, 4096]))
    want = [0.01 + 0.016, 0.01 + 0.136, 0.01 + 1024 * 1.25e-3, 0.01 + 2.048, 0.01 + 0.016, 0.01 + 256 * 1.5e-3]
    np.testing.assert_allclose(got, want, rtol=1e-9)


@pytest.mark.parametrize("change, message", [
    ({"format": "other/1"}, "not a kvd-prefill-profile/1 file"),
    ({"new_tokens": [256, 16, 1024]}, "new_tokens must be 2 or more increasing"),
    ({"prefixes": [512, 1024]}, "prefixes must be increasing counts from 0"),
    ({"seconds": [[1.0, 2.0]]}, "seconds must be 3 rows of 2"),
    ({"seconds": [[1.0, 2.0], [1.0, -1.0], [3.0, 4.0]]}, "every entry of seconds must be a positive number"),
    ({"host_load_s_per_token": -1}, "host_load_s_per_token must be a number >= 0"),
    ({"new_tokens": None}, "new_tokens must be"),
    ({"seconds": "many"}, "ValueError: could not convert"),
    ({"new_tokens": 5} | {"prefixes": []}, "new_tokens must be"),
])
def test_a_malformed_profile_is_refused_naming_what_is_wrong(tmp_path, change, message):
    good = {"format": FORMAT, "new_tokens": [16, 256, 1024], "prefixes": [0, 1024],
            "seconds": [[1.0, 2.0], [2.0, 3.0], [3.0, 4.0]]}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({**good, **change}))
    with pytest.raises(ValueError, match=message):
        PrefillProfile.load(path)
    with pytest.raises(ValueError, match="cannot read it"):
        PrefillProfile.load(tmp_path / "missing.json")


def test_free_loads_are_taken_whole_and_a_load_slower_than_compute_is_not_taken():
    p = profile()
    assert best_stop(p, 0, 8, BLOCK, 200, np.zeros(8, dtype=np.float32)).stop == 8  # host hits: load all
    slow = np.cumsum(np.full(8, 1.0)).astype(np.float32)  # 1 s per block against ~16 ms to compute one
    choice = best_stop(p, 0, 8, BLOCK, 200, slow)
    assert (choice.stop, choice.load_s) == (0, 0.0)
    assert choice.compute_s == pytest.approx(choice.recompute_s) == pytest.approx(0.01 + 0.2)


def test_the_leading_blocks_are_loaded_while_they_beat_computing_and_the_rest_computed():
    """Two host blocks, then disk blocks at 10 ms each: cheaper than computing 16 tokens at 1 ms each
    only up to where the disk queue starts (200 ms ahead of the third disk block)."""
    p = profile()
    load_s = np.array([0, 0, 0.01, 0.02, 0.23, 0.24, 0.25, 0.26], dtype=np.float32)
    choice = best_stop(p, 0, 8, BLOCK, 200, load_s)
    assert choice.stop == 4 and choice.load_s == pytest.approx(0.02)
    assert choice.load_s + choice.compute_s < choice.recompute_s


def test_unmeasured_tiers_count_as_free_so_they_get_measured_and_blocks_vllm_has_are_not_priced():
    p = profile(host_load_s_per_token=1e-4)
    unknown = np.array([0, 0, math.nan, math.nan], dtype=np.float32)
    assert best_stop(p, 0, 4, BLOCK, 100, unknown).stop == 4
    # vLLM computed blocks [0, 2) already: the slow disk blocks before them cost this load nothing
    load_s = np.array([5.0, 10.0, 10.0, 10.0], dtype=np.float32)
    choice = best_stop(p, 2, 4, BLOCK, 100, load_s)
    assert choice.stop == 4 and choice.load_s == pytest.approx(2 * BLOCK * 1e-4)


def test_the_host_copy_alone_can_make_recompute_the_better_choice():
    assert best_stop(profile(host_load_s_per_token=0.01), 0, 4, BLOCK, 100, None).stop == 0
    assert best_stop(profile(host_load_s_per_token=1e-5), 0, 4, BLOCK, 100, None).stop == 4


def test_blocks_looked_up_from_a_parent_are_priced_after_the_tokens_before_them():
    """A Lookup from a parent key (SGLang's pages after those it holds): the prefill saved by a block
    is priced with the tokens before it cached; here, with 1024 of them, each computed token costs
    1.5 ms, not 1 ms, so a load of 1.2 ms per token pays only there."""
    p = profile()
    load_s = np.cumsum(np.full(4, 1.2e-3 * BLOCK))
    assert best_stop(p, 0, 4, BLOCK, 5 * BLOCK, load_s).stop == 0  # a block of new tokens after the hit
    assert best_stop(p, 0, 4, BLOCK, 1024 + 5 * BLOCK, load_s, before_tokens=1024).stop == 4
