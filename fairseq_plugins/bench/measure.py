"""Timing generators over pre-built batches, alternating them batch by batch: wall time per run, per-batch
times (latency at batch 1), peak memory; the speed ratio and its spread; machine load."""

import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional

import torch


def _read_proc_status_kib(key: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class PeakMemory:
    """Peak memory of a timed section: CUDA allocator peak on GPU, the process's peak RSS on CPU.

    On Linux the RSS high-water mark is reset through /proc/self/clear_refs, so each generator's peak is
    its own; where that is impossible the figure is the process peak so far, and ``resettable`` says so.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.resettable = device.type == "cuda" or self._reset_rss_peak()

    @staticmethod
    def _reset_rss_peak() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._reset_rss_peak()

    def peak_mb(self) -> Optional[float]:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        kib = _read_proc_status_kib("VmHWM")
        return None if kib is None else kib / 1024


@dataclass
class Measurement:
    """What one generator did over all runs."""

    run_seconds: List[float] = field(default_factory=list)  # each run: the sum of its batches' times
    batch_seconds: List[float] = field(default_factory=list)  # every batch of every run
    peak_memory_mb: Optional[float] = None
    hypotheses: Optional[Dict[int, List[int]]] = None  # sentence id -> tokens, from the first run

    @property
    def median_run_seconds(self) -> float:
        return statistics.median(self.run_seconds)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def percentile(values: List[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]) of a non-empty list."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


Decoder = Callable[[Dict], Dict[int, List[int]]]


def alternating_runs(
    decoders: Dict[str, Decoder], batches: List[Dict], device: torch.device, runs: int, memory: PeakMemory,
    progress: Optional[Callable[[Iterable, int], Iterable]] = None, clock: Callable[[], float] = time.perf_counter,
) -> Dict[str, Measurement]:
    """Decode every batch ``runs`` times with every generator, alternating generators batch by batch.

    Within a run, batch ``b`` goes to the generators in their given order when ``run + b`` is even and in
    reverse otherwise: a change in machine load hits every generator alike instead of whichever pass happened
    to run then. A run's time for a generator is the sum of its own batch times, so the runs of two
    generators are paired (same run, same sentences, same moments) and their ratio is one sample of the
    speed ratio. ``progress(iterable, run)`` may wrap the batches (e.g. a tqdm bar); ``clock`` is for tests."""
    names = list(decoders)
    measurements = {name: Measurement() for name in names}
    for run in range(runs):
        totals = dict.fromkeys(names, 0.0)
        outputs = {name: {} for name in names}
        indices = range(len(batches))
        for index in progress(indices, run) if progress else indices:
            for name in names if (run + index) % 2 == 0 else names[::-1]:
                measurement = measurements[name]
                memory.reset()
                synchronize(device)
                start = clock()
                outputs[name].update(decoders[name](batches[index]))
                synchronize(device)
                seconds = clock() - start
                measurement.batch_seconds.append(seconds)
                totals[name] += seconds
                peak = memory.peak_mb()
                if peak is not None:
                    measurement.peak_memory_mb = max(peak, measurement.peak_memory_mb or 0.0)
        for name in names:
            measurements[name].run_seconds.append(totals[name])
            if measurements[name].hypotheses is None:
                measurements[name].hypotheses = outputs[name]
    return measurements


# The headline speed figure of every result: the project's one definition (docs/bench.md).
SPEED_RATIO_DEFINITION = (
    "stock time / method time on the same input sentences: the median over runs of (stock generator's run "
    "seconds / method generator's run seconds), runs alternating the two generators batch by batch in one "
    "process; equal to the ratio of sentences per second, not of tokens per second"
)
SPREAD_FLAG = 0.10  # a ratio whose (max - min) / median over runs exceeds this is flagged, not hidden


def speed_ratio_figures(stock_run_seconds: List[float], method_run_seconds: List[float]) -> Dict:
    """The speed ratio from paired runs (run i of each generator timed over the same sentences, interleaved),
    with every run's ratio, the min-max spread and whether that spread is too wide to trust."""
    if len(stock_run_seconds) != len(method_run_seconds) or not stock_run_seconds:
        raise ValueError("speed ratio: needs the same number (>= 1) of runs for both generators")
    per_run = [stock / method for stock, method in zip(stock_run_seconds, method_run_seconds)]
    median = statistics.median(per_run)
    spread = (max(per_run) - min(per_run)) / median
    return {
        "speed_ratio": median,
        "speed_ratio_definition": SPEED_RATIO_DEFINITION,
        "speed_ratio_runs": per_run,
        "speed_ratio_min": min(per_run),
        "speed_ratio_max": max(per_run),
        "speed_ratio_spread": spread,
        "speed_ratio_flagged": spread > SPREAD_FLAG or len(per_run) < 3,
    }


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def load_average() -> Optional[float]:
    """The 1-minute load average, or None where the platform has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def runnable_threads() -> Optional[int]:
    """Threads runnable on this machine right now, this one included (Linux: /proc/loadavg's R of R/T)."""
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            return int(f.read().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return None


class RunnableSampler:
    """Samples ``runnable_threads`` once per timed batch. The 1-minute load average lags by a minute and counts
    this process's own start-up, so it flags two one-thread jobs on two cores; what ran beside each batch
    does not."""

    def __init__(self):
        self.samples: List[int] = []

    def each(self, items: Iterable) -> Iterable:
        for item in items:
            count = runnable_threads()
            if count is not None:
                self.samples.append(count)
            yield item

    def figures(self, cores: int) -> Dict:
        if not self.samples:
            return {"runnable_threads_median": None, "runnable_threads_max": None, "oversubscribed": None}
        median = statistics.median(self.samples)
        return {"runnable_threads_median": median, "runnable_threads_max": max(self.samples),
                "oversubscribed": median > cores}


def runnable_beside(samples: int = 5, interval: float = 0.05) -> Optional[float]:
    """Threads runnable beside this one right now: the median of a few quick samples of ``runnable_threads``
    less this process's own. Unlike the 1-minute load average it does not still count a training stopped
    seconds ago. None where the platform does not say."""
    counts = []
    for index in range(samples):
        count = runnable_threads()
        if count is None:
            return None
        counts.append(count - 1)
        if index + 1 < samples:
            time.sleep(interval)
    return max(0.0, statistics.median(counts))


def oversubscribed(threads: int, load: Optional[float], cores: int) -> bool:
    """True when this run's threads plus what else was running exceed the cores: the worst noise measured
    here (a 2-thread greedy decode took 121 s against 2.8 s with 1 thread while the other core was busy)."""
    return load is not None and threads + load > cores
