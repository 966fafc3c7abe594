"""`fairseq-plugins bench`: batched runs, appended results, tables and charts, and clear errors."""

import json
import os

import pytest
import torch

from conftest import plugins_cli
from fairseq_plugins.common.textio import InputError


def bench(trained, *flags, check=True):
    return plugins_cli("bench", "--method", "baseline", "--path", trained["checkpoint"], "--data", trained["data"],
                       "--threads", 1, "--runs", 1, *flags, check=check)


def test_batched_greedy_run_appends_and_reports(trained, tmp_path):
    result_path, table, chart = tmp_path / "r.json", tmp_path / "r.md", tmp_path / "r.png"
    bench(trained, "--beam", 1, "--limit", 12, "--json", result_path, "--hypotheses", tmp_path / "one.hyp")
    bench(trained, "--beam", 1, "--batch-size", 4, "--limit", 12, "--latency-limit", 5, "--label", "batched",
          "--json", result_path, "--append", "--markdown", table, "--append-markdown", "--plot", chart,
          "--hypotheses", tmp_path / "batched.hyp")
    results = json.loads(result_path.read_text())
    assert [r.get("label") for r in results] == [None, "batched"]
    first, batched = results
    assert batched["batch_size"] == 4 and batched["sentences"] == 12
    assert batched["generator"]["description"] == batched["baseline"]["generator"]["description"] == "greedy"
    # Greedy decoding is the same whatever the batching: the same translations, in the same (corpus) order.
    hypotheses = (tmp_path / "one.hyp").read_text().splitlines()
    assert len(hypotheses) == 12 and hypotheses == (tmp_path / "batched.hyp").read_text().splitlines()
    assert first["bleu"] == batched["bleu"] and first["split_bleu"] == batched["split_bleu"]
    assert table.read_text().count("| baseline |") == 1 and table.read_text().count("| batched |") == 1
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert batched["timing"]["sentences_timed"] == 12 and batched["timing"]["latency_sentences"] == 5
    summary = plugins_cli("report", result_path).stdout.splitlines()
    assert summary[0].split()[:5] == ["method", "BLEU", "stock", "BLEU", "dBLEU"]
    assert summary[2].startswith("batched (greedy vs stock greedy)") and summary[2].split()[-3] == "!"
    assert summary[5].startswith("BLEU: on the whole split; * on the sentences timed only")
    assert [line.split(";")[0] for line in summary[6:]] == [  # (and the load, if this machine was busy)
        "! baseline: 1 timed run(s), fewer than 3", "! batched: 1 timed run(s), fewer than 3"]


def test_bleu_is_scored_on_the_whole_split_when_fewer_sentences_are_timed(trained, tmp_path):
    """--limit times the first sentences; the others are decoded once, untimed, so that the BLEU quoted is the
    whole split's: the same as a bench that times them all."""
    limited, everything, without = tmp_path / "limited.json", tmp_path / "all.json", tmp_path / "without.json"
    bench(trained, "--beam", 2, "--limit", 12, "--json", limited)
    bench(trained, "--beam", 2, "--limit", 0, "--json", everything)
    bench(trained, "--beam", 2, "--limit", 12, "--no-whole-split-bleu", "--json", without)
    limited, everything, without = (json.loads(p.read_text()) for p in (limited, everything, without))
    split = limited["split_bleu"]
    assert limited["sentences"] == 12 and everything["sentences"] == split["sentences"] == 40
    assert split["method"]["bleu"] == everything["bleu"] and split["stock"]["bleu"] == everything["baseline"]["bleu"]
    assert split["method"]["hypothesis_length"] == everything["hypothesis_length"]
    assert split["bleu_delta"] == round(everything["bleu"] - everything["baseline"]["bleu"], 2)
    assert "split_bleu" not in everything and "split_bleu" not in without  # nothing left untimed / not asked
    assert without["bleu"] == limited["bleu"]  # the timed sentences' own BLEU is unchanged
    summary = plugins_cli("report", tmp_path / "limited.json", tmp_path / "without.json").stdout.splitlines()
    bleu_cell = lambda line: line.split(")", 1)[1].split()[0]  # noqa: E731  (after "label (generators)")
    assert bleu_cell(summary[1]) == f"{split['method']['bleu']:.2f}"  # quoted on the whole split
    assert bleu_cell(summary[2]) == f"{without['bleu']:.2f}*"  # marked: the timed sentences only


def test_raw_source_file_decodes_like_the_binarised_split(trained, tmp_path):
    raw = os.path.join(trained["data"], "raw")
    result_path = tmp_path / "raw.json"
    bench(trained, "--beam", 1, "--limit", 10, "--source-file", os.path.join(raw, "test.src"),
          "--reference-file", os.path.join(raw, "test.tgt"), "--json", result_path,
          "--hypotheses", tmp_path / "raw.hyp")
    split_path = tmp_path / "split.json"
    bench(trained, "--beam", 1, "--limit", 10, "--json", split_path, "--hypotheses", tmp_path / "split.hyp")
    assert (tmp_path / "raw.hyp").read_text() == (tmp_path / "split.hyp").read_text()
    assert json.loads(result_path.read_text())["data"]["split"] is None


def test_the_stock_generator_can_decode_without_its_cache(trained, tmp_path):
    # What a cached decoder is compared with (ByteNet's demo row): the same outputs, every prefix recomputed.
    result_path = tmp_path / "r.json"
    bench(trained, "--beam", 1, "--limit", 8, "--baseline-no-cache", "--json", result_path)
    result = json.loads(result_path.read_text())
    assert result["baseline"]["generator"]["description"] == "greedy, no cache"
    assert result["generator"]["description"] == "greedy"
    assert result["stats"]["outputs_identical_to_baseline"] == 1.0


@pytest.mark.parametrize("flags, message", [
    (["--method", "no-such-method"], "argument --method: invalid choice: 'no-such-method'"),
    (["--no-such-flag", "3"], "bench: unrecognized arguments: --no-such-flag 3"),
    (["--data", "/no/such/dir"], "/no/such/dir: not a prepared data directory"),
    (["--path", "/no/such.pt"], "--path /no/such.pt: no such checkpoint"),
    (["--runs", "0"], "--runs must be at least 1, got 0"),
    (["--profile", "-1"], "--profile must not be negative, got -1"),
    (["--split", "nope"], "--split nope: "),
    (["--source-file", "/dev/null"], "--source-file and --reference-file go together"),
    (["--provenance", "/no/such.txt"], "/no/such.txt: no such file"),
])
def test_bad_input_is_a_clear_error(trained, tmp_path, flags, message):
    result_path = tmp_path / "never.json"
    args = ["--method", "baseline", "--path", trained["checkpoint"], "--data", trained["data"]]
    for flag in ("--method", "--path", "--data"):  # a flag under test replaces the good one
        if flag in flags:
            index = args.index(flag)
            del args[index:index + 2]
    proc = plugins_cli("bench", *args, "--limit", 2, "--runs", 1, "--json", result_path, *flags, check=False)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr
    assert not result_path.exists() and os.listdir(tmp_path) == []


def test_a_generator_that_leaves_sentences_without_a_hypothesis_is_a_clear_error():
    from fairseq_plugins.bench.harness import _decoder

    batch = {"id": torch.tensor([4, 7, 9])}
    nbest = [{"tokens": torch.tensor([5, 2])}]  # one hypothesis: tokens 5 then EOS
    assert _decoder(lambda b: [nbest] * 3, "the stock generator")(batch) == {4: [5, 2], 7: [5, 2], 9: [5, 2]}
    for hypos, message in (
        ([nbest] * 2, "returned 2 hypothesis lists for a batch of 3 sentences; none for sentence ids 9:"),
        ([nbest, [], nbest], "returned 3 hypothesis lists for a batch of 3 sentences; none for sentence ids 7:"),
        ([nbest] * 4, "returned 4 hypothesis lists for a batch of 3 sentences: its outputs cannot be compared"),
    ):
        with pytest.raises(InputError, match=f"^bench: the test generator \\(Fake\\) {message}"):
            _decoder(lambda b: hypos, "the test generator (Fake)")(batch)


def test_a_fp16_bench_records_float16_and_its_agreement_with_float32(trained, tmp_path):
    """bench --fp16 (here on the CPU, which has the float16 operations decoding needs): the row says the model
    decoded in float16 and how many outputs a float32 copy of the checkpoint agrees with."""
    result_path = tmp_path / "r.json"
    bench(trained, "--beam", 1, "--limit", 6, "--fp16", "--json", result_path)
    result = json.loads(result_path.read_text())
    assert result["model_dtype"] == "float16"
    assert 0 <= result["stats"]["outputs_identical_to_float32"] <= 1
    bench(trained, "--beam", 1, "--limit", 6, "--json", result_path)
    result = json.loads(result_path.read_text())
    assert result["model_dtype"] == "float32" and "outputs_identical_to_float32" not in result["stats"]


def test_a_fp16_row_records_its_dtype_and_its_agreement_with_float32():
    """What a --fp16 bench adds (issue 57): ``model_dtype`` of the models as loaded (float16; float32 for the
    copy it compares with), the share of outputs the float16 and float32 decodings agree on, and the overview
    keeping a GPU fp16 row only where ``model_dtype`` says it decoded in half precision. Here on the CPU: fairseq's
    greedy search over a random transformer in float16 and in float32."""
    import argparse
    import copy

    from conftest import random_batch, word_dictionary
    from fairseq.sequence_generator import SequenceGenerator

    from fairseq_plugins.bench.harness import _ready_for_inference, model_dtype, outputs_agreement
    from fairseq_plugins.bench.overview import precision_known
    from test_fast_step import random_transformer

    dictionary = word_dictionary()
    model = random_transformer(dictionary)
    cfg = argparse.Namespace(common=argparse.Namespace(fp16=True), generation=argparse.Namespace(beam=1))
    half = _ready_for_inference([copy.deepcopy(model)], cfg, torch.device("cpu"))
    full = _ready_for_inference([copy.deepcopy(model)], cfg, torch.device("cpu"), half=False)
    assert (model_dtype(half), model_dtype(full)) == ("float16", "float32")
    sample = random_batch(dictionary, bsz=8, seed=3)
    sample["id"] = torch.arange(8)

    def outputs(models):
        with torch.no_grad():
            hypotheses = SequenceGenerator(models, dictionary, beam_size=1, max_len_b=10).generate(models, sample)
        return {i: h[0]["tokens"].tolist() for i, h in enumerate(hypotheses)}

    ids = list(range(8))
    float16, float32 = outputs(half), outputs(full)
    assert outputs_agreement(float32, float32, ids) == 1.0
    agreement = outputs_agreement(float16, float32, ids)
    assert agreement == sum(float16[i] == float32[i] for i in ids) / 8 and agreement >= 0.5  # random weights: ties
    assert outputs_agreement({0: [4, 2], 1: [5, 2]}, {0: [4, 2], 1: [5, 6, 2]}, [0, 1]) == 0.5
    gpu_fp16_row = {"device_type": "cuda", "commands": ["fairseq-plugins bench --fp16 --device cuda"]}
    assert not precision_known(gpu_fp16_row)  # before issue 57: the flag only
    assert precision_known({**gpu_fp16_row, "model_dtype": "float16"})
    assert not precision_known({**gpu_fp16_row, "model_dtype": "float32"})


@pytest.mark.cuda
def test_cuda_bench_decodes_like_cpu(trained, tmp_path):
    for device in ("cpu", "cuda"):
        bench(trained, "--device", device, "--beam", 1, "--limit", 10, "--json", tmp_path / f"{device}.json",
              "--hypotheses", tmp_path / f"{device}.hyp")
    result = json.loads((tmp_path / "cuda.json").read_text())
    assert result["device_type"] == "cuda" and result["threads"] is None and result["peak_memory_mb"] > 0
    assert (tmp_path / "cuda.hyp").read_text() == (tmp_path / "cpu.hyp").read_text()


def test_profile_splits_each_generators_time_per_token_on_the_cpu(trained, tmp_path):
    """--profile: the fast step's greedy decode (the stock output, token for token) spends its time in fewer aten
    operators per token than the stock generator's; each split adds up to the profiled wall time."""
    plugins_cli("bench", "--method", "fast_step", "--path", trained["checkpoint"], "--data", trained["data"],
                "--fast-step", "--threads", 1, "--runs", 1, "--beam", 1, "--limit", 6, "--profile", 4,
                "--json", tmp_path / "p.json")
    result = json.loads((tmp_path / "p.json").read_text())
    profile = result["profile"]
    assert set(profile) == {"method", "stock", "split"} and "aten operators" in profile["split"]
    method, stock = profile["method"], profile["stock"]
    assert method["sentences"] == stock["sentences"] == 4
    assert method["tokens"] == stock["tokens"] > 4  # the same outputs, EOS included
    for figures in (method, stock):
        assert 0 < figures["op_share"] <= 1 and figures["ops_per_token"] > 0
        assert figures["op_ms_per_token"] + figures["outside_ops_ms_per_token"] == pytest.approx(
            figures["wall_ms_per_token"], abs=2e-4)
        assert "device_ms_per_token" not in figures
    assert method["ops_per_token"] < stock["ops_per_token"]
    table = plugins_cli("report", "--profile", tmp_path / "p.json").stdout.splitlines()
    assert table[0] == ("| method | generator | device | tokens | ms/token | aten ops ms | outside ops ms | in ops "
                        "| ops/token |")
    assert table[2].startswith("| fast_step | greedy |") and table[3].startswith("| stock | greedy |")
    assert table[3].split(" | ")[3] == str(stock["tokens"])
    assert table[-1].startswith("Per output token of the profiled decode: time inside top-level aten operators")


@pytest.mark.cuda
def test_profile_splits_kernel_time_from_the_gaps_on_cuda(trained, tmp_path):
    bench(trained, "--device", "cuda", "--beam", 1, "--limit", 4, "--profile", 4, "--json", tmp_path / "p.json")
    stock = json.loads((tmp_path / "p.json").read_text())["profile"]["stock"]
    assert stock["device_activities_per_token"] > 1 and 0 < stock["device_busy_share"] <= 1
    assert stock["device_ms_per_token"] + stock["gap_ms_per_token"] == pytest.approx(stock["wall_ms_per_token"],
                                                                                     abs=2e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_requested_without_a_device_is_a_clear_error(trained):
    proc = bench(trained, "--device", "cuda", "--limit", 2, check=False)
    assert proc.returncode == 2 and "--device cuda: no CUDA device is available" in proc.stderr


def test_baseline_beam_decodes_the_stock_side_at_its_own_beam(trained, tmp_path):
    # --baseline-beam: the method at greedy against stock beam 5 in the same run; the stock side must be
    # exactly what a plain beam-5 bench of the same model decodes.
    mixed, beam5 = tmp_path / "mixed.json", tmp_path / "beam5.json"
    bench(trained, "--beam", 1, "--baseline-beam", 5, "--limit", 12, "--json", mixed)
    bench(trained, "--beam", 5, "--limit", 12, "--json", beam5)
    mixed, beam5 = json.loads(mixed.read_text()), json.loads(beam5.read_text())
    assert mixed["beam"] == 1 and mixed["generator"]["description"] == "greedy"
    assert mixed["baseline"]["generator"]["beam"] == 5 == beam5["baseline"]["generator"]["beam"]
    assert mixed["baseline"]["bleu"] == beam5["baseline"]["bleu"] == beam5["bleu"]
    proc = bench(trained, "--beam", 1, "--baseline-beam", 0, "--limit", 2, check=False)
    assert proc.returncode != 0 and "--baseline-beam must be at least 1, got 0" in proc.stderr
    # --baseline-no-repeat-ngram-size 0: the method decodes under fairseq's no-repeat rule, the stock side without
    # it, exactly as the plain beam-5 run's stock side.
    rule = tmp_path / "rule.json"
    bench(trained, "--beam", 5, "--no-repeat-ngram-size", 1, "--baseline-no-repeat-ngram-size", 0, "--limit", 12,
          "--json", rule)
    rule = json.loads(rule.read_text())
    assert rule["generator"]["no_repeat_ngram_size"] == 1 and "no repeated 1-grams" in rule["generator"]["description"]
    assert rule["baseline"]["generator"]["no_repeat_ngram_size"] == 0
    assert rule["baseline"]["generator"] == beam5["baseline"]["generator"]
    assert rule["baseline"]["bleu"] == beam5["baseline"]["bleu"]


def test_profile_counts_overlapping_device_work_once_and_only_top_level_operators_on_the_host():
    from types import SimpleNamespace

    from fairseq_plugins.bench.profile import split_events

    def event(name, device, start, end, parent=None):
        return SimpleNamespace(name=name, device_type=SimpleNamespace(name=device), cpu_parent=parent,
                               is_async=False, time_range=SimpleNamespace(start=start, end=end))

    linear = event("aten::linear", "CPU", 0, 400)
    events = [linear, event("aten::addmm", "CPU", 50, 350, parent=linear), event("aten::softmax", "CPU", 900, 1000),
              event("ProfilerStep#1", "CPU", 0, 5000),  # an annotation, not an operator
              event("gemm", "CUDA", 100, 300), event("gemm", "CUDA", 250, 400),  # overlapping streams
              event("softmax", "CUDA", 1000, 1100)]
    assert split_events(events, on_device=False) == {"busy_ms": 0.5, "count": 2}
    assert split_events(events, on_device=True) == {"busy_ms": 0.4, "count": 3}
