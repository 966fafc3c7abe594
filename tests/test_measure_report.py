"""The harness's arithmetic and file handling, without a model."""

import json
import time

import numpy as np
import pytest
import torch

from fairseq_plugins.bench import report
from fairseq_plugins.bench.measure import Measurement, PeakMemory, percentile, timed_pass
from fairseq_plugins.common.textio import InputError


@pytest.mark.parametrize("q", [0, 10, 50, 90, 100])
def test_percentile_matches_numpy(q):
    values = [5.0, 1.0, 3.5, 2.0, 9.0, 7.25]
    assert percentile(values, q) == pytest.approx(np.percentile(values, q))


def test_timed_pass_records_runs_batches_and_first_outputs():
    measurement = Measurement()
    memory = PeakMemory(torch.device("cpu"))
    batches = [{"id": [0]}, {"id": [1]}, {"id": [2]}]

    def decode(batch, outputs=iter([{0: [4]}, {1: [5]}, {2: [6]}, {0: [7]}, {1: [8]}, {2: [9]}])):
        time.sleep(0.01)
        return next(outputs)

    timed_pass(decode, batches, torch.device("cpu"), measurement, memory)
    timed_pass(decode, batches, torch.device("cpu"), measurement, memory)
    assert len(measurement.run_seconds) == 2 and len(measurement.batch_seconds) == 6
    assert all(s >= 0.01 for s in measurement.batch_seconds)
    assert measurement.run_seconds[0] >= sum(measurement.batch_seconds[:3])
    assert measurement.hypotheses == {0: [4], 1: [5], 2: [6]}  # kept from the first run
    assert measurement.peak_memory_mb > 0


def test_peak_memory_sees_a_large_allocation():
    memory = PeakMemory(torch.device("cpu"))
    if not memory.resettable:
        pytest.skip("this kernel cannot reset the RSS high-water mark")
    memory.reset()
    before = memory.peak_mb()
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
    assert memory.peak_mb() - before > 50
    del block


def result(label, tokens_per_s, bleu=30.0):
    stock = {"generator": {"description": "greedy"}, "bleu": 29.0, "sentences_per_s": 10.0, "tokens_per_s": 100.0,
             "latency_ms_p50": 90.0, "latency_ms_p90": 120.0, "peak_memory_mb": 500.0}
    return {"method": "m", "label": label, "device": "cpu", "threads": 1, "batch_size": 1, "beam": 1,
            **stock, "tokens_per_s": tokens_per_s, "bleu": bleu, "sentences_per_s": tokens_per_s / 10,
            "baseline": stock, "speed_ratio": tokens_per_s / 100.0}


def test_tables_list_each_result_beside_its_stock_run():
    results = [result("fast", 250.0), result("faster", 400.0, bleu=28.5)]
    table = report.markdown_table(results).splitlines()
    assert len(table) == 2 + 4
    assert table[2].startswith("| fast | greedy | cpu | 1 | 1 | 30.00 | 25.00 | 250.0 |") and table[2].endswith("2.50x |")
    assert table[3].startswith("| stock | greedy |") and table[3].endswith("1.00x |")
    summary = report.summary_table(results).splitlines()
    assert summary[2].split() == ["faster", "(greedy)", "28.50", "40.00", "10.00", "(greedy)", "4.00x"]


def test_results_file_round_trip_and_errors(tmp_path):
    path = tmp_path / "r.json"
    report.save_results(str(path), [result("a", 1.0)])
    assert isinstance(json.loads(path.read_text()), dict)  # one result: one object
    report.save_results(str(path), [result("a", 1.0), result("b", 2.0)])
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
