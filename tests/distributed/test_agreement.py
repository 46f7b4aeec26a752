"""agreed: a step that fails on some ranks fails on every rank (its own error where it failed, StepFailed naming the
first failing rank elsewhere), and a step that succeeds everywhere goes on; one gather either way."""

import pytest

from distperp_harness.distributed.agreement import StepFailed, agreed


class Peers:
    """A collective of this rank and others whose outcomes are given (None: that rank's step succeeded)."""

    def __init__(self, rank, others):
        self.rank, self.others, self.gathers = rank, others, []

    def all_gather_object(self, obj, name):
        self.gathers.append(name)
        return [*self.others[: self.rank], obj, *self.others[self.rank :]]


def test_success_everywhere_goes_on_after_one_gather():
    peers = Peers(0, [None])
    with agreed(peers, "loading the model"):
        pass
    assert peers.gathers == ["agree on loading the model"]


def test_a_rank_that_failed_raises_its_own_error():
    with pytest.raises(FileNotFoundError, match="model.safetensors"), agreed(Peers(1, [None]), "loading the model"):
        raise FileNotFoundError("no model.safetensors here")


def test_the_others_raise_the_first_failing_ranks_error():
    peers = Peers(0, [None, ("node-b", "OSError: disk"), ("node-c", "OSError: gone")])
    with pytest.raises(StepFailed) as caught, agreed(peers, "loading the model"):
        pass
    assert caught.value.rank == 2 and caught.value.cause == "OSError: disk" and caught.value.same_on_every_rank
    assert str(caught.value).startswith("rank 2 (node-b) failed while loading the model: OSError: disk (and 1 more")
    assert "Fix:" in str(caught.value)
