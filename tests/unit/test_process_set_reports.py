"""What one rank sends in a process-set exchange cannot crash the others."""

from hvdlike.core import process_sets
from hvdlike.core.registry import _refusal, _well_formed


class _Unreadable:
    def __iter__(self):
        raise RuntimeError("iteration failed")


def test_an_argument_that_raises_anything_is_a_problem_told_to_every_rank():
    # Only TypeError/ValueError were caught: a RuntimeError left the rank alone in
    # the exchange and the others waited 30 s for a DeadlockError.
    pset, problem = process_sets._as_process_set(_Unreadable())
    assert pset is None and isinstance(problem, ValueError)
    assert "RuntimeError: iteration failed" in str(problem)


def test_a_malformed_report_names_the_rank_that_sent_it():
    # A report of another shape (a rank running other code, or lying) raised a bare
    # IndexError on rank 0, which then left the others waiting.
    good = ([[0, 1]], None)
    for bad in (("only one",), [1, 2, 3], None, ([[0, 1]], ("ValueError",))):
        message = _refusal("init()", _well_formed([good, bad]))
        assert message.startswith("init() was refused on every rank: rank(s) 1"), message
        assert "rank 1 sent a malformed process-set report" in message, message
    assert _refusal("init()", _well_formed([good, good])) is None
