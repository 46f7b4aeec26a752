"""The release check: a dropped run's model must be collected (and on CUDA its bytes back at the baseline)."""

from __future__ import annotations

import weakref

from distperp_harness.commands.release import RELEASE_SLACK, Release, cuda_baseline, released


def test_a_model_still_referenced_is_not_released() -> None:
    class Model:
        pass

    held = Model()
    kept = released(weakref.ref(held), None)
    assert not kept.ok and "still referenced" in kept.detail
    gone = Model()
    ref = weakref.ref(gone)
    del gone
    assert released(ref, None) == Release(collected=True, left_bytes=None)


def test_bytes_left_above_the_slack_fail_the_release() -> None:
    assert Release(collected=True, left_bytes=RELEASE_SLACK).ok
    left = Release(collected=True, left_bytes=RELEASE_SLACK + 1)
    assert not left.ok and "+16.0 MiB allocated vs the baseline" in left.detail


def test_no_cuda_means_no_baseline() -> None:
    import torch

    if not torch.cuda.is_available():
        assert cuda_baseline() is None
