"""Autotuning of the fusion threshold and the cycle time (``HVDLIKE_AUTOTUNE=1``).

While the job trains, the runtime tries settings one after the other, scores each
by the throughput the job achieves with it and keeps the best.

*Samples.* A sample is ``HVDLIKE_AUTOTUNE_STEPS_PER_SAMPLE`` training steps of the
global process set. A step ends when an allreduce name recurs: the first tensor
of the next step shows up again. Names hvdlike invents for unnamed collectives
(``allreduce.noname.17``) count as one name, so loops of unnamed allreduces have
steps too. A sample's score is the allreduce bytes it moved divided by the
wall time from the sample's first step to the next sample's (rank 0's clock).
Stretches without allreduce traffic never form a sample, and the first
``HVDLIKE_AUTOTUNE_WARMUP_SAMPLES`` samples (cache building, first-touch
allocations) are thrown away.

*Search.* A coordinate search over a fixed grid: first the fusion thresholds
(:data:`FUSION_GRID`) at the configured cycle time, then the cycle times
(:data:`CYCLE_GRID_MS`) at the best threshold. The configured values join their
grid and are tried first. Each setting gets :data:`SAMPLES_PER_CANDIDATE`
samples; the median is its score and the highest median wins (ties: the one
tried first). The search is deterministic; the number of samples it takes
is known beforehand (:meth:`CoordinateSearch.total_samples`).
``HVDLIKE_AUTOTUNE_BAYES_OPT_MAX_SAMPLES`` (Horovod's budget for its Bayesian
search) caps it: after that many scored samples the best setting so far wins.
Horovod's ``HOROVOD_AUTOTUNE_GAUSSIAN_PROCESS_NOISE`` has nothing to act on here.

*Agreement.* The fusion plan must be the same on every rank, so only rank 0
decides. Step boundaries come from the cycle's responses, which are identical
on every rank, so every rank reaches the end of a sample in the same cycle of
the global set; there each calls the set's control-plane ``broadcast`` and
applies rank 0's choice before that cycle's work is executed.
"""

from __future__ import annotations

import dataclasses
import os
import re
import statistics
import struct
import time
from typing import Callable, Dict, List, Optional, Sequence

from .errors import ConfigError
from .fusion import element_size
from .log import logger
from .messages import OpType
from .output_file import open_output_file

MIB = 1024 * 1024
FUSION_GRID = tuple(n * MIB for n in (1, 4, 16, 64, 128))
CYCLE_GRID_MS = (0.5, 1.0, 2.5, 5.0)
SAMPLES_PER_CANDIDATE = 3

CSV_HEADER = ("sample", "fusion_threshold_bytes", "cycle_time_ms", "score_bytes_per_second",
              "bytes", "seconds", "kind")

# Names Runtime.auto_name makes: "<op>[.ps<set>].noname.<counter>" (+ frontend suffixes),
# also as the caller's part of a composite's name ("broadcast.broadcast_object.noname.4.size").
_AUTO_NAME = re.compile(r"^([a-z_]+(?:\.[a-z_]+)?(?:\.ps\d+)?\.noname)\.\d+")
_DECISION = struct.Struct("<qdB")  # fusion threshold, cycle time ms, settled flag


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One setting the search may try."""

    fusion_threshold: int  # bytes
    cycle_time_ms: float

    def encode(self, settled: bool) -> bytes:
        return _DECISION.pack(self.fusion_threshold, self.cycle_time_ms, 1 if settled else 0)

    @staticmethod
    def decode(payload: bytes) -> "tuple[Candidate, bool]":
        if len(payload) != _DECISION.size:
            raise ValueError(f"autotune: decision of {len(payload)} bytes from rank 0, "
                             f"expected {_DECISION.size}")
        threshold, cycle_ms, settled = _DECISION.unpack(payload)
        return Candidate(threshold, cycle_ms), bool(settled)


def settings_lines(candidate: Candidate) -> List[str]:
    """The variables that reproduce ``candidate`` without tuning."""
    return [f"HVDLIKE_FUSION_THRESHOLD={candidate.fusion_threshold}",
            f"HVDLIKE_CYCLE_TIME={candidate.cycle_time_ms!r}"]


def step_key(name: str) -> str:
    """The name a tensor keeps from step to step (automatic counters dropped)."""
    match = _AUTO_NAME.match(name)
    return name if match is None else match.group(1) + name[match.end():]


class StepCounter:
    """Counts training steps in a stream of tensor names: a recurring name starts a step."""

    def __init__(self):
        self._seen: set = set()

    def feed(self, name: str) -> bool:
        """Note ``name``; True when it begins a new step (it was seen in the current one)."""
        key = step_key(name)
        if key in self._seen:
            self._seen = {key}
            return True
        self._seen.add(key)
        return False


class CoordinateSearch:
    """Rank 0's search: fusion thresholds first, then cycle times, best median wins."""

    def __init__(self, start: Candidate, thresholds: Sequence[int] = FUSION_GRID,
                 cycle_times: Sequence[float] = CYCLE_GRID_MS,
                 samples_per_candidate: int = SAMPLES_PER_CANDIDATE,
                 max_samples: Optional[int] = None):
        if samples_per_candidate < 1:
            raise ValueError("samples_per_candidate must be >= 1")
        self.samples_per_candidate = samples_per_candidate
        # HVDLIKE_AUTOTUNE_BAYES_OPT_MAX_SAMPLES: settle after this many samples.
        self.max_samples = max_samples
        self.recorded = 0
        self._thresholds = _start_first(start.fusion_threshold, thresholds)
        self._cycle_times = _start_first(start.cycle_time_ms, cycle_times)
        self._queue = [Candidate(t, start.cycle_time_ms) for t in self._thresholds]
        self._phase = 1
        self.scores: Dict[Candidate, List[float]] = {}
        self.order: List[Candidate] = []  # candidates in the order they were tried
        self.done = False

    @property
    def current(self) -> Candidate:
        """The setting being sampled now (the winner once done)."""
        return self.best() if self.done else self._queue[0]

    def total_samples(self) -> int:
        """Samples the whole search takes (warm-up not included)."""
        distinct = len(self._thresholds) + len(self._cycle_times) - 1
        whole = distinct * self.samples_per_candidate
        return whole if self.max_samples is None else min(whole, self.max_samples)

    def add(self, score: float) -> Candidate:
        """Record a sample of :attr:`current`; return the setting to use next."""
        if self.done:
            raise RuntimeError("autotune: the search has already settled")
        candidate = self._queue[0]
        if candidate not in self.scores:
            self.scores[candidate] = []
            self.order.append(candidate)
        self.scores[candidate].append(score)
        self.recorded += 1
        if self.max_samples is not None and self.recorded >= self.max_samples:
            self.done = True  # the budget is spent: the best so far wins
            return self.current
        if len(self.scores[candidate]) >= self.samples_per_candidate:
            self._queue.pop(0)
            if not self._queue and self._phase == 1:
                self._phase = 2
                threshold = self.best().fusion_threshold
                self._queue = [Candidate(threshold, c) for c in self._cycle_times]
            self._queue = [c for c in self._queue if c not in self.scores]
            if not self._queue:
                self.done = True
        return self.current

    def median(self, candidate: Candidate) -> float:
        return statistics.median(self.scores[candidate])

    def best(self) -> Candidate:
        """The candidate with the highest median so far (the earliest tried on ties)."""
        complete = [c for c in self.order if len(self.scores[c]) >= self.samples_per_candidate]
        pool = complete or self.order
        if not pool:
            raise RuntimeError("autotune: no sample recorded yet")
        return max(pool, key=lambda c: (self.median(c), -self.order.index(c)))


def _start_first(start, grid) -> list:
    return [start] + sorted(v for v in set(grid) if v != start)


class SampleLog:
    """The CSV file of every sample (rank 0 only); each row is appended and closed at once."""

    def __init__(self, path: str):
        self.path = path
        try:
            # No link planted in a shared folder followed (see output_file).
            with os.fdopen(open_output_file(path), "w") as f:
                f.write(",".join(CSV_HEADER) + "\n")
        except OSError as exc:
            from .config import spelled

            name = spelled("autotune_log", path, os.environ)
            raise ConfigError(f"{name}={path!r}: cannot write the autotune log: "
                              f"{exc.strerror or exc}") from None

    def row(self, sample, candidate: Candidate, score, nbytes, seconds, kind: str) -> None:
        if self.path is None:
            return
        values = (sample, candidate.fusion_threshold, repr(candidate.cycle_time_ms),
                  "" if score is None else f"{score:.6g}", nbytes,
                  "" if seconds is None else f"{seconds:.6f}", kind)
        try:
            with os.fdopen(open_output_file(self.path, truncate=False), "a") as f:
                f.write(",".join("" if v is None else str(v) for v in values) + "\n")
        except OSError as exc:
            logger.warning("autotune: stopped writing %s: %s", self.path, exc)
            self.path = None


class Autotuner:
    """One rank's part in tuning; the runtime calls :meth:`cycle` every global-set cycle.

    Args:
        rank: this rank in the global set (0 decides).
        broadcast: the global set's control-plane ``broadcast(payload) -> bytes``.
        apply: installs a candidate on this rank (executors' thresholds, cycle time).
        start: the configured setting, tried first.
        warmup_samples: samples discarded before the search starts.
        steps_per_sample: training steps per sample.
        log_path: CSV file rank 0 writes ("" for none).
        search: rank 0's search (built from ``start`` when None).
        clock: seconds, monotonic.
    """

    def __init__(self, rank: int, broadcast: Callable[[bytes], bytes],
                 apply: Callable[[Candidate], None], start: Candidate, warmup_samples: int,
                 steps_per_sample: int, log_path: str = "",
                 search: Optional[CoordinateSearch] = None,
                 clock: Callable[[], float] = time.perf_counter):
        if steps_per_sample < 1:
            raise ValueError("steps_per_sample must be >= 1")
        self.rank = rank
        self._broadcast = broadcast
        self._apply = apply
        self.warmup_samples = warmup_samples
        self.steps_per_sample = steps_per_sample
        self._clock = clock
        self._steps = StepCounter()
        self._steps_done = 0
        self._bytes = 0
        self._window_start: Optional[float] = None
        self.samples = 0
        self.current = start
        self.search = None
        self.log = None
        if rank == 0:
            self.search = search or CoordinateSearch(start)
            self.log = SampleLog(log_path) if log_path else None
        self.settled: Optional[Candidate] = None

    def cycle(self, work) -> bool:
        """Account one cycle's ``(response, entry)`` work; True once tuning is over.

        When a sample ends in this cycle, every rank exchanges rank 0's decision
        here and applies it before the cycle's work runs.
        """
        ended = None
        for response, _ in work:
            if response.op != OpType.ALLREDUCE or response.error:
                continue
            if self._steps.feed(response.name):
                self._steps_done += 1
                if ended is None and self._steps_done >= self.steps_per_sample:
                    ended = self._bytes  # this name already belongs to the next sample
                    self._bytes = 0
                    self._steps_done = 0
            self._bytes += response.numel * element_size(response.dtype)
        if self._window_start is None and self._bytes:
            self._window_start = self._clock()  # the first sample starts with traffic
        if ended is None:
            return False
        return self._end_sample(ended)

    def _end_sample(self, nbytes: int) -> bool:
        payload = b""
        if self.rank == 0:
            payload = self._decide(nbytes)
        candidate, settled = Candidate.decode(self._broadcast(payload))
        if candidate != self.current:
            self._apply(candidate)
            self.current = candidate
        if settled:
            self.settled = candidate
            if self.rank == 0:
                self._report(candidate)
        return settled

    def _decide(self, nbytes: int) -> bytes:
        now = self._clock()
        seconds = max(now - (self._window_start if self._window_start is not None else now), 1e-9)
        self._window_start = now
        score = nbytes / seconds
        self.samples += 1
        if self.samples <= self.warmup_samples:
            kind, nxt = "warmup", self.search.current
        else:
            kind = "sample"
            nxt = self.search.add(score)
        if self.log is not None:
            self.log.row(self.samples, self.current, score, nbytes, seconds, kind)
        logger.info("autotune sample %d (%s): fusion threshold %d bytes, cycle time %r ms: "
                    "%.3g MB/s", self.samples, kind, self.current.fusion_threshold,
                    self.current.cycle_time_ms, score / 1e6)
        return nxt.encode(self.search.done)

    def _report(self, best: Candidate) -> None:
        median = self.search.median(best)
        if self.log is not None:
            self.log.row("", best, median, "", None, "chosen")
        logger.warning("autotune settled after %d samples (%.3g MB/s); to reuse these "
                       "settings without tuning, set:\n%s", self.samples, median / 1e6,
                       "\n".join(settings_lines(best)))


class LiveSettings:
    """Settings read every cycle, which the autotuner changes while it searches.

    One per runtime: the background thread reads :attr:`cycle_seconds`, every
    executor reads :attr:`fusion_threshold`. The autotuner changes both in the
    same cycle on every rank (see *Agreement* above); ``separate_groups``
    (``disable_group_fusion``) is fixed for the runtime's life.
    """

    __slots__ = ("fusion_threshold", "cycle_seconds", "separate_groups")

    def __init__(self, fusion_threshold: int, cycle_time_ms: float,
                 separate_groups: bool = False):
        self.fusion_threshold = fusion_threshold
        self.cycle_seconds = cycle_time_ms / 1000.0
        self.separate_groups = separate_groups

    def apply(self, candidate: Candidate) -> None:
        self.fusion_threshold = candidate.fusion_threshold
        self.cycle_seconds = candidate.cycle_time_ms / 1000.0


def build(cfg, rank: int, broadcast: Callable[[bytes], bytes],
          settings: LiveSettings) -> Autotuner:
    """The autotuner ``cfg`` asks for, deciding through ``broadcast`` (the global set's)."""
    start = Candidate(cfg.fusion_threshold, cfg.cycle_time)
    search = (CoordinateSearch(start, max_samples=cfg.autotune_bayes_opt_max_samples)
              if rank == 0 else None)
    return Autotuner(rank, broadcast, settings.apply, start,
                     cfg.autotune_warmup_samples, cfg.autotune_steps_per_sample,
                     cfg.autotune_log, search=search)
