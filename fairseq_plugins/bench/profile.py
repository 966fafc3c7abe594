"""Where a decoded token's time goes: device work against the host's gaps between it (``bench --profile N``).

At batch 1 a small model's step on a GPU is a few dozen short kernels, each launched by Python and the
dispatcher: the device then waits on the host more than it computes. torch.profiler records both sides; this
module turns a profiled decode into figures per output token:

- on CUDA, ``device_ms`` is the time some kernel or copy ran on the device (the union of their intervals,
  so overlapping streams count once) and ``gap_ms`` the rest of the wall time, when the device was idle
  waiting for the host (launch overhead, Python, the search's bookkeeping, synchronisation);
- on the CPU there is no device: ``op_ms`` is the time inside the top-level aten operators (the products,
  softmax, copies), ``outside_ops_ms`` the rest (Python, the search's bookkeeping, the dispatcher's way in, and
  the fast step's own kernels, which ctypes calls outside aten: on the CPU the split is a proxy for stock
  fairseq and the methods built of aten operators, not for the fast step).

The busy time comes from a decode under the profiler, the wall time from the same decode again without it
(the profiler's own cost per recorded operator lengthens the host's side, which would count as gaps); on the
CPU the operators' recorded time still carries some of that cost.
"""

import time
from typing import Callable, Dict, List, Sequence, Tuple

import torch

DEVICE_TYPES = ("CUDA", "HIP", "PrivateUse1", "XPU")


def _union_ms(intervals: Sequence[Tuple[float, float]]) -> float:
    """The total length (ms) of the union of (start, end) intervals in microseconds."""
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total / 1000.0


def split_events(events, on_device: bool) -> Dict[str, float]:
    """From torch.profiler's events: the busy time (ms) and its count, of the device's kernels and copies
    (``on_device``), or of the host's top-level aten operators."""
    if on_device:
        busy = [e for e in events if e.device_type.name in DEVICE_TYPES]
    else:
        busy = [e for e in events if e.device_type.name == "CPU" and e.cpu_parent is None and not e.is_async
                and e.name.startswith("aten::")]
    return {"busy_ms": _union_ms([(e.time_range.start, e.time_range.end) for e in busy]), "count": len(busy)}


def _decode_all(decode, batches: List[Dict], device: torch.device) -> Tuple[float, int]:
    """Decode ``batches``; (wall ms, output tokens, EOS included, as fairseq counts a hypothesis' tokens)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start, tokens = time.perf_counter(), 0
    for batch in batches:
        tokens += sum(len(output) for output in decode(batch).values())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) * 1000.0, tokens


def profile_decoder(decode: Callable[[Dict], Dict[int, List[int]]], batches: List[Dict],
                    device: torch.device) -> Dict:
    """Decode ``batches`` (``decode``: batch -> {sentence id: output tokens}) under torch.profiler for the busy
    time, then once more without it for the wall time (the profiler's own cost per recorded operator would
    otherwise count as gaps); the figures per output token."""
    from torch.profiler import ProfilerActivity, profile

    on_device = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_device else [])
    with profile(activities=activities) as profiler:
        profiled_ms, tokens = _decode_all(decode, batches, device)
    busy = split_events(profiler.events(), on_device)
    wall_ms, again = _decode_all(decode, batches, device)
    if again != tokens:
        raise RuntimeError(f"profile: the decode under the profiler wrote {tokens} tokens, the same decode without it "
                           f"{again}: the generator is not deterministic, so its split means nothing")
    busy_ms = min(busy["busy_ms"], wall_ms)
    per_token = lambda ms: round(ms / max(tokens, 1), 4)  # noqa: E731
    figures = {"sentences": sum(len(batch["id"]) for batch in batches), "tokens": tokens,
               "wall_ms_per_token": per_token(wall_ms), "profiled_wall_ms_per_token": per_token(profiled_ms)}
    share = round(busy_ms / wall_ms, 4) if wall_ms else None
    count = round(busy["count"] / max(tokens, 1), 2)
    if on_device:
        figures.update(device_ms_per_token=per_token(busy_ms), gap_ms_per_token=per_token(wall_ms - busy_ms),
                       device_busy_share=share, device_activities_per_token=count)
    else:
        figures.update(op_ms_per_token=per_token(busy_ms), outside_ops_ms_per_token=per_token(wall_ms - busy_ms),
                       op_share=share, ops_per_token=count)
    return figures


def profile_decoders(decoders: Dict[str, Callable], batches: List[Dict], device: torch.device) -> Dict:
    """``profile_decoder`` for every decoder but CTranslate2's (whose work torch cannot see), and what the split
    is of."""
    profiles = {name: profile_decoder(decode, batches, device) for name, decode in decoders.items()
                if name != "ctranslate2"}
    profiles["split"] = ("device kernels and copies against the gaps between them" if device.type == "cuda"
                         else "time inside top-level aten operators against the rest (Python, the search's "
                              "bookkeeping, native kernels called through ctypes)")
    return profiles
