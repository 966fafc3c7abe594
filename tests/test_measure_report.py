"""The harness's arithmetic and file handling, without a model."""

import json
import os

import numpy as np
import pytest
import torch

from fairseq_plugins.bench import report
from fairseq_plugins.bench.measure import (PeakMemory, alternating_runs, oversubscribed, percentile,
                                           speed_ratio_figures)
from fairseq_plugins.common.textio import InputError


@pytest.mark.parametrize("q", [0, 10, 50, 90, 100])
def test_percentile_matches_numpy(q):
    values = [5.0, 1.0, 3.5, 2.0, 9.0, 7.25]
    assert percentile(values, q) == pytest.approx(np.percentile(values, q))


class FakeClock:
    """A clock that decoders advance by their cost times the machine's load at that moment."""

    def __init__(self, load=lambda calls: 1.0):
        self.now, self.calls, self.load = 0.0, 0, load

    def __call__(self):
        return self.now

    def spend(self, cost):
        self.now += cost * self.load(self.calls)
        self.calls += 1


def fake_decoder(clock, cost, log, name, length=1):
    def decode(batch):
        log.append((name, batch["id"][0]))
        clock.spend(cost)
        return {sid: [7] * length for sid in batch["id"]}

    return decode


def test_generators_alternate_batch_by_batch_and_runs_sum_their_batches():
    clock, log = FakeClock(), []
    decoders = {"method": fake_decoder(clock, 1.0, log, "method"), "stock": fake_decoder(clock, 2.0, log, "stock")}
    batches = [{"id": [0]}, {"id": [1]}, {"id": [2]}]
    measurements = alternating_runs(decoders, batches, torch.device("cpu"), 2, PeakMemory(torch.device("cpu")),
                                    clock=clock)
    m, s = "method", "stock"
    assert log == [(m, 0), (s, 0), (s, 1), (m, 1), (m, 2), (s, 2),  # run 1
                   (s, 0), (m, 0), (m, 1), (s, 1), (s, 2), (m, 2)]  # run 2 starts the other way round
    assert measurements[m].run_seconds == [3.0, 3.0] and measurements[s].run_seconds == [6.0, 6.0]
    assert measurements[m].batch_seconds == [1.0] * 6
    assert measurements[m].hypotheses == {0: [7], 1: [7], 2: [7]}
    assert measurements[m].peak_memory_mb > 0


def test_a_load_change_within_a_run_hits_both_generators_alike():
    # The machine gets 3x slower half-way through each run: timed pass by pass, the method would have run
    # fast and the stock generator slow (ratio 6); alternated batch by batch both see the same load.
    batches = [{"id": [i]} for i in range(6)]
    clock = FakeClock(load=lambda calls: 1.0 if calls % 12 < 6 else 3.0)
    decoders = {"method": fake_decoder(clock, 1.0, [], "method"), "stock": fake_decoder(clock, 2.0, [], "stock")}
    measurements = alternating_runs(decoders, batches, torch.device("cpu"), 3, PeakMemory(torch.device("cpu")),
                                    clock=clock)
    figures = speed_ratio_figures(measurements["stock"].run_seconds, measurements["method"].run_seconds)
    assert figures["speed_ratio_runs"] == [2.0, 2.0, 2.0] and figures["speed_ratio"] == 2.0


def test_the_speed_ratio_is_a_time_ratio_not_a_tokens_ratio():
    # A method writing outputs twice as long in the same time is not faster.
    from fairseq.data import Dictionary

    from fairseq_plugins.bench.harness import _figures

    clock = FakeClock()
    decoders = {"method": fake_decoder(clock, 1.0, [], "method", length=8),
                "stock": fake_decoder(clock, 1.0, [], "stock", length=4)}
    batches = [{"id": [i]} for i in range(4)]
    measurements = alternating_runs(decoders, batches, torch.device("cpu"), 3, PeakMemory(torch.device("cpu")),
                                    clock=clock)
    dictionary = Dictionary()
    for filler in ("x", "y", "z"):
        dictionary.add_symbol(filler)
    assert dictionary.add_symbol("w") == 7  # the token the fake decoders write

    class Words:
        decode = staticmethod(lambda text: text)

    figures = {name: _figures(measurements[name], [1.0], list(range(4)), dictionary, Words(), ["w w w w"] * 4,
                              {"description": "greedy"})[0] for name in measurements}
    ratio = speed_ratio_figures(figures["stock"]["run_seconds"], figures["method"]["run_seconds"])
    assert figures["method"]["tokens_per_s"] == 2 * figures["stock"]["tokens_per_s"]
    assert ratio["speed_ratio"] == 1.0 and ratio["speed_ratio_runs"] == [1.0, 1.0, 1.0]
    assert "stock time / method time on the same input sentences" in ratio["speed_ratio_definition"]
    # sacrebleu's explanation of the method's BLEU: outputs twice the reference length, no brevity penalty.
    assert figures["method"]["length_ratio"] == 2.0 and figures["method"]["bleu_brevity_penalty"] == 1.0
    assert figures["stock"]["bleu"] == 100.0 and figures["stock"]["bleu_precisions"] == [100.0] * 4


def test_a_wide_spread_or_too_few_runs_is_flagged():
    assert speed_ratio_figures([2.0, 2.0, 2.0], [1.0, 1.0, 1.0])["speed_ratio_flagged"] is False
    wide = speed_ratio_figures([2.0, 2.0, 2.4], [1.0, 1.0, 1.0])  # ratios 2, 2, 2.4: spread 20% of 2
    assert wide["speed_ratio"] == 2.0 and wide["speed_ratio_spread"] == pytest.approx(0.2)
    assert wide["speed_ratio_flagged"] is True
    assert speed_ratio_figures([2.0, 2.1, 2.0], [1.0, 1.0, 1.0])["speed_ratio_flagged"] is False  # 5%
    assert speed_ratio_figures([2.0, 2.0], [1.0, 1.0])["speed_ratio_flagged"] is True  # 2 runs
    with pytest.raises(ValueError, match="same number"):
        speed_ratio_figures([1.0], [1.0, 1.0])


def test_batch_1_times_the_first_200_sentences_unless_told_otherwise():
    from fairseq_plugins.bench.harness import DEFAULT_LIMIT, sentence_ids

    assert DEFAULT_LIMIT == 200
    assert sentence_ids(1000, None, 1) == list(range(200))
    assert sentence_ids(1000, None, 16) == list(range(1000))  # throughput batches: the whole split
    assert sentence_ids(1000, 0, 1) == list(range(1000))
    assert sentence_ids(50, None, 1) == sentence_ids(50, 300, 1) == list(range(50))


def test_oversubscription_counts_threads_and_other_load():
    assert oversubscribed(1, 0.9, 2) is False  # one training beside a 1-thread bench: fits
    assert oversubscribed(2, 1.0, 2) is True  # the measured 43x slowdown: 2 threads, other core busy
    assert oversubscribed(1, 1.5, 2) is True
    assert oversubscribed(1, None, 2) is False  # no load average on this platform: nothing to say


def test_peak_memory_sees_a_large_allocation():
    memory = PeakMemory(torch.device("cpu"))
    if not memory.resettable:
        pytest.skip("this kernel cannot reset the RSS high-water mark")
    memory.reset()
    before = memory.peak_mb()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    assert memory.peak_mb() - before > 50
    del block


def result(label, stock_seconds, bleu=30.0, model_note=None):
    """A bench result whose method took 1 s a run and the stock generator ``stock_seconds``."""
    stock = {"generator": {"description": "greedy"}, "bleu": 29.0, "sentences_per_s": 10.0, "tokens_per_s": 100.0,
             "latency_ms_p50": 90.0, "latency_ms_p90": 120.0, "peak_memory_mb": 500.0}
    method = {**stock, "bleu": bleu, "sentences_per_s": 10.0 * stock_seconds[0], "tokens_per_s": 50.0}
    return {"method": "m", "label": label, "device": "cpu", "threads": 1, "batch_size": 1, "beam": 1,
            **({"model_note": model_note} if model_note else {}), **method, "baseline": stock,
            **speed_ratio_figures(stock_seconds, [1.0] * len(stock_seconds))}


def test_tables_show_each_ratio_with_its_spread_and_flag_the_untrustworthy():
    results = [result("fast", [2.5, 2.5, 2.55], model_note="warm-started, 3 min"),
               result("noisy", [3.0, 4.0, 5.0], bleu=28.5)]
    table = report.markdown_table(results).splitlines()
    assert table[2].startswith("| fast | greedy | cpu | 1 | 1 | 30.00 | 25.00 | 50.0 |")
    assert table[2].endswith("| 2.50x (2.50-2.55) |")
    assert table[3].startswith("| stock | greedy |") and table[3].endswith("1.00x |")
    assert table[4].endswith("| 4.00x (3.00-5.00) ! |")
    assert table[-1] == "! noisy: the runs' ratios spread over 50% of the median (more than 10%)"
    summary = report.summary_table(results).splitlines()
    assert summary[0].split() == ["method", "BLEU", "stock", "BLEU", "dBLEU", "speed", "ratio", "(min-max)",
                                  "batch", "model"]
    # (BLEU on the timed sentences only, marked *: these results have no whole-split BLEU)
    assert summary[1].split() == ["fast", "(greedy", "vs", "stock", "greedy)", "30.00*", "29.00", "+1.00",
                                  "2.50x", "(2.50-2.55)", "1", "warm-started,", "3", "min"]
    assert summary[2].split()[5:] == ["28.50*", "29.00", "-0.50", "4.00x", "(3.00-5.00)", "!", "1", "-"]
    assert "speed ratio: stock time / method time on the same sentences" in summary[4]
    assert summary[5].startswith("BLEU: on the whole split; * on the sentences timed only")
    assert summary[6].startswith("! noisy: the runs' ratios spread over 50%")
    two_runs = result("two", [2.0, 2.0])
    assert report.flag_reasons(two_runs) == ["2 timed run(s), fewer than 3"]
    assert report.flag_reasons({**result("busy", [2.0] * 3), "timing": {"oversubscribed": True}}) == [
        "threads + load average exceeded the cores during the run"]
    sampled = {"oversubscribed": True, "runnable_threads_median": 3, "cores": 2}
    assert report.flag_reasons({**result("busy", [2.0] * 3), "timing": sampled}) == [
        "a median of 3 threads wanted the 2 cores while batches were timed"]


def test_runnable_threads_are_sampled_once_per_batch_and_judged_by_their_median(monkeypatch):
    from fairseq_plugins.bench import measure

    if os.path.exists("/proc/loadavg"):
        assert measure.runnable_threads() >= 1  # this process is running while it reads
    counts = iter([1, 2, 5, 2, 3])  # one busy moment (5) does not flag a run that mostly fit on 2 cores
    monkeypatch.setattr(measure, "runnable_threads", lambda: next(counts))
    sampler = measure.RunnableSampler()
    assert list(sampler.each(range(5))) == [0, 1, 2, 3, 4]
    assert sampler.figures(cores=2) == {"runnable_threads_median": 2, "runnable_threads_max": 5,
                                        "oversubscribed": False}
    assert sampler.figures(cores=1)["oversubscribed"] is True
    assert measure.RunnableSampler().figures(cores=2)["oversubscribed"] is None  # nothing sampled: nothing said


def test_results_file_round_trip_and_errors(tmp_path):
    path = tmp_path / "r.json"
    report.save_results(str(path), [result("a", [1.0])])
    assert isinstance(json.loads(path.read_text()), dict)  # one result: one object
    report.save_results(str(path), [result("a", [1.0]), result("b", [2.0])])
    assert [r["label"] for r in report.load_results(str(path))] == ["a", "b"]
    path.write_text('{"method": "m",\n  oops}')
    with pytest.raises(InputError, match=r"r\.json:2: not valid JSON"):
        report.load_results(str(path))
    path.write_text('[{"method": "m"}]')
    with pytest.raises(InputError, match="entry 0 is not a bench result"):
        report.load_results(str(path))


def test_provenance_skips_comments_and_blank_lines(tmp_path):
    path = tmp_path / "commands.txt"
    path.write_text("# made by a recipe\n\nfairseq-train a b\n  fairseq-generate c  \n")
    assert report.read_provenance([str(path)]) == ["fairseq-train a b", "fairseq-generate c"]
    with pytest.raises(InputError, match="no-such.txt: no such file"):
        report.read_provenance([str(tmp_path / "no-such.txt")])


def test_the_start_up_warning_counts_what_runs_now_not_the_lagging_load_average(monkeypatch, caplog):
    from fairseq_plugins.bench import harness, measure
    # An idle machine a few seconds after a training stopped: the load average still says 1.0, the
    # runnable threads say only this process runs. No warning.
    monkeypatch.setattr(harness, "usable_cores", lambda: 2)
    monkeypatch.setattr(measure, "runnable_threads", lambda: 1)
    monkeypatch.setattr(measure.time, "sleep", lambda seconds: None)
    assert measure.runnable_beside() == 0
    with caplog.at_level("WARNING"):
        harness._warn_if_busy(1, 1.0)
    assert "exceed" not in caplog.text
    # A training on each other core beside a 1-thread bench: warned, naming what it counted.
    monkeypatch.setattr(measure, "runnable_threads", lambda: 3)
    with caplog.at_level("WARNING"):
        harness._warn_if_busy(1, 0.0)
    assert "1 thread(s) + 2 other runnable thread(s) exceed the 2 usable cores" in caplog.text
    # No /proc/loadavg: the load average decides.
    caplog.clear()
    monkeypatch.setattr(measure, "runnable_threads", lambda: None)
    with caplog.at_level("WARNING"):
        harness._warn_if_busy(1, 1.5)
    assert "a load average of 1.50 exceed" in caplog.text
