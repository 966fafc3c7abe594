"""Timing one generator over pre-built batches: wall time per run, batch-1 latency, peak memory."""

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

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

    run_seconds: List[float] = field(default_factory=list)
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


def timed_pass(
    decode: Callable[[Dict], Dict[int, List[int]]], batches: List[Dict], device: torch.device,
    measurement: Measurement, memory: PeakMemory, progress: Optional[Callable] = None,
) -> None:
    """Decode every batch once, appending the run's and each batch's wall time to ``measurement``."""
    memory.reset()
    hypotheses = {}
    synchronize(device)
    run_start = time.perf_counter()
    for batch in progress(batches) if progress else batches:
        start = time.perf_counter()
        hypotheses.update(decode(batch))
        synchronize(device)
        measurement.batch_seconds.append(time.perf_counter() - start)
    measurement.run_seconds.append(time.perf_counter() - run_start)
    peak = memory.peak_mb()
    if peak is not None:
        measurement.peak_memory_mb = max(peak, measurement.peak_memory_mb or 0.0)
    if measurement.hypotheses is None:
        measurement.hypotheses = hypotheses
