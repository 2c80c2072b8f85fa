"""Ranks as threads: an in-memory control plane for driving Controllers without processes."""

import threading


class Exchange:
    """In-memory collectives for ``size`` threads, each call a rendezvous.

    ``calls`` counts, per kind ("sum", "min", "gather", "broadcast"), the
    collectives rank 0 joined.
    """

    def __init__(self, size):
        self.size = size
        self.barrier = threading.Barrier(size, timeout=10)
        self.slots = [None] * size
        self.calls = {"sum": 0, "min": 0, "gather": 0, "broadcast": 0}

    def all(self, rank, value, kind):
        """Every rank's ``value``, once all ranks called."""
        if rank == 0:
            self.calls[kind] += 1
        self.slots[rank] = value
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()
        return values


class FakeControl:
    """The bit-vector control plane only (no one-word fast path)."""

    def __init__(self, exchange, rank):
        self.ex, self.rank, self.size = exchange, rank, exchange.size

    def allreduce_sum(self, values):
        return [sum(col) for col in zip(*self.ex.all(self.rank, list(values), "sum"))]

    def gather(self, payload):
        values = self.ex.all(self.rank, payload, "gather")
        return values if self.rank == 0 else None

    def broadcast(self, payload):
        return self.ex.all(self.rank, payload, "broadcast")[0]


class FastControl(FakeControl):
    """Also the steady-state word (``allreduce_min``), as the real planes have."""

    def allreduce_min(self, value):
        return min(self.ex.all(self.rank, value, "min"))


def run_in_threads(size, body, timeout=30):
    """Run ``body(rank)`` on ``size`` threads.

    Fails if any thread is still running after ``timeout``; re-raises the first
    exception a thread raised (other threads' exceptions are named in its notes),
    so an assertion inside ``body`` fails the test instead of vanishing with its
    thread.
    """
    errors = {}

    def run(rank):
        try:
            body(rank)
        except BaseException as exc:  # handed to the test's thread below
            errors[rank] = exc

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if errors:
        rank = min(errors)
        first = errors[rank]
        others = sorted(r for r in errors if r != rank)
        if others and hasattr(first, "add_note"):
            first.add_note(f"rank threads {others} raised too: "
                           + "; ".join(f"{r}: {errors[r]!r}" for r in others))
        raise AssertionError(f"rank thread {rank} raised {first!r}") from first
    assert not any(t.is_alive() for t in threads), "a rank thread did not finish"
