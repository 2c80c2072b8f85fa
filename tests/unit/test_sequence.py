"""The learned order and the one-word negotiation fast path (threads, no processes)."""


from hvdlike.core.controller import Controller
from hvdlike.core.handles import Handle
from hvdlike.core.messages import OpType, Request
from hvdlike.core.sequence import LearnedSequence
from hvdlike.core.tensor_queue import Entry
from tests.unit.fake_ranks import Exchange, FastControl, run_in_threads


def test_order_is_learned_after_a_slot_comes_round_again():
    seq = LearnedSequence()
    for slot in (3, 1, 2):
        seq.executed(slot)
    assert seq.order is None
    seq.executed(3)
    assert seq.order == [3, 1, 2] and seq.pos == 1
    assert seq.ready_prefix({1, 2}) == 2
    assert seq.ready_prefix({2}) == 0
    assert seq.take(2) == [1, 2]
    seq.executed(1)
    seq.executed(2)
    assert seq.pos == 0  # wrapped: the next round starts
    seq.executed(2)  # out of order: forget, learn again
    assert seq.order is None


def test_reset_forgets_everything():
    seq = LearnedSequence()
    for slot in (0, 1, 0):
        seq.executed(slot)
    assert seq.order == [0, 1]
    seq.reset()
    assert seq.order is None and seq.ready_prefix({0, 1}) == 0
    assert seq.take(0) == []  # idle ranks agree on 0 before any order exists


def _entry(name, rank):
    req = Request(name=name, op=OpType.ALLREDUCE, dtype="float32", shape=(4,), rank=rank)
    return Entry(req, None, None, Handle(name))


def _drive(size, schedule, capacity=64):
    """schedule[rank] = list of per-cycle name lists; returns per-rank executed names."""
    ex = Exchange(size)
    out = [None] * size
    ctls = [None] * size

    def body(rank):
        ctl = Controller(FastControl(ex, rank), capacity)
        seen = []
        for names in schedule[rank]:
            result = ctl.cycle([_entry(n, rank) for n in names])
            seen.append([r.name for r, e in result.work])
            for _, entry in result.work:
                assert entry is not None
        out[rank], ctls[rank] = seen, ctl

    run_in_threads(size, body)
    assert all(o is not None for o in out), "a rank failed"
    return out, ctls, ex


def test_steady_training_rounds_negotiate_with_one_word():
    names = [f"g{i}" for i in range(6)]
    steps = 8
    schedule = [[names] * steps, [names] * steps]
    out, ctls, ex = _drive(2, schedule)
    assert out[0] == out[1]
    assert all(sorted(cycle) == sorted(names) for cycle in out[0])
    assert ex.calls["gather"] == 1
    # step 1 negotiates the names, step 2 runs them from the cache, step 3
    # closes the learned round; after that every cycle is one word.
    assert ctls[0].fast_cycles >= steps - 3
    assert ex.calls["sum"] <= 3


def test_ranks_ready_at_different_paces_run_the_common_prefix_in_order():
    names = [f"g{i}" for i in range(6)]
    warm = [names] * 3
    fast = warm + [names, [], names, []]
    slow = warm + [names[:2], names[2:], names[:4], names[4:]]
    out, ctls, _ = _drive(2, [fast, slow])
    assert out[0] == out[1]
    assert out[0][3] == names[:2] and out[0][4] == names[2:]
    assert out[0][5] == names[:4] and out[0][6] == names[4:]
    assert ctls[0].fast_cycles >= 4


def test_a_tensor_outside_the_order_falls_back_to_the_full_vector_without_hanging():
    names = [f"g{i}" for i in range(4)]
    warm = [names] * 3
    # step 4: both ranks also send "extra" (new name), then the order goes on.
    schedule = [warm + [names + ["extra"], names], warm + [["extra"] + names, names]]
    out, ctls, ex = _drive(2, schedule)
    assert out[0] == out[1]
    executed = [n for cycle in out[0] for n in cycle]
    assert executed.count("extra") == 1 and executed.count("g0") == 5
    assert ex.calls["gather"] == 2


def test_executed_many_matches_executed_one_by_one():
    import random

    rng = random.Random(7)
    for _ in range(200):
        # Mostly a repeating order, with the odd deviation, as in training.
        base = list(range(rng.randint(1, 6)))
        stream = []
        for _ in range(rng.randint(1, 8)):
            stream += base if rng.random() < 0.8 else rng.sample(base, len(base))
            if rng.random() < 0.2:
                stream.append(rng.randint(0, 8))
        one, many = LearnedSequence(), LearnedSequence()
        for slot in stream:
            one.executed(slot)
        cut = rng.randint(0, len(stream))
        many.executed_many(stream[:cut])
        many.executed_many(stream[cut:])
        assert (one.order, one.pos, one._round, one._seen) == \
            (many.order, many.pos, many._round, many._seen)
