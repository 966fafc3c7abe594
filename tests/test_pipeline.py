"""The whole user path on a tiny model: fairseq-train --user-dir -> fairseq-generate / -interactive -> detok ->
sacrebleu, and `fairseq-plugins bench` agreeing with it exactly. Also resumed training (checkpoint loading)."""

import json
import os
import shutil
import subprocess
import sys

import sacrebleu

from conftest import TRAIN_EPOCHS, TRAIN_FLAGS, USER_DIR, plugins_cli, run

REQUIRED_KEYS = {
    "method", "device", "threads", "batch_size", "beam", "bleu", "sentences_per_s", "tokens_per_s",
    "latency_ms_p50", "latency_ms_p90", "peak_memory_mb", "stats", "baseline", "speed_ratio", "commands",
    "git_commit", "versions", "speed_ratio_definition", "speed_ratio_runs", "speed_ratio_spread", "timing",
    "bleu_brevity_penalty", "bleu_precisions", "length_ratio", "hashes",
}


def generate(trained, *flags):
    return run("fairseq_cli.generate", os.path.join(trained["data"], "bin"), "--user-dir", USER_DIR,
               "--path", trained["checkpoint"], "--gen-subset", "test", *flags).stdout


def test_generate_learns_the_task_and_bench_reproduces_its_outputs(trained, tmp_path):
    data = trained["data"]
    # At batch 1 fairseq main's batch_by_size would drop the last sentence; the package's fix keeps it.
    out = generate(trained, "--beam", 5, "--batch-size", 1)
    (tmp_path / "gen.out").write_text(out)
    hyps = plugins_cli("detok", data, "--from-generate", "--input", tmp_path / "gen.out").stdout.splitlines()
    refs = open(os.path.join(data, "raw/test.tgt")).read().splitlines()
    assert len(hyps) == len(refs) == 40
    (tmp_path / "gen.hyp").write_text("\n".join(hyps) + "\n")
    # sacrebleu's own command line on the detokenised file: the score a user would report.
    cli = subprocess.run([sys.executable, "-m", "sacrebleu", os.path.join(data, "raw/test.tgt"), "-i",
                          str(tmp_path / "gen.hyp"), "-b", "-w", "2"], capture_output=True, text=True, check=True)
    generate_bleu = float(cli.stdout.strip())
    assert generate_bleu > 50, f"the tiny model did not learn the synthetic task (BLEU {generate_bleu:.1f})"

    provenance = tmp_path / "commands.txt"
    provenance.write_text("# how the checkpoint was made\nfairseq-train data-bin --arch baseline_transformer_tiny\n")
    result_path = tmp_path / "bench.json"
    bench = plugins_cli(
        "bench", "--method", "baseline", "--path", trained["checkpoint"], "--data", data, "--beam", 5,
        "--threads", 1, "--runs", 2, "--warmup", 1, "--json", result_path, "--hypotheses", tmp_path / "bench.hyp",
        "--provenance", provenance, "--lenpen", 1.0,
    )
    result = json.loads(result_path.read_text())
    assert REQUIRED_KEYS <= set(result)
    # The harness decodes, detokenises and scores exactly as fairseq-generate + detok + sacrebleu do.
    assert (tmp_path / "bench.hyp").read_text().splitlines() == hyps
    # Both of the harness's BLEUs (its method and its stock generator) are sacrebleu's CLI score of
    # fairseq-generate's output.
    assert result["bleu"] == generate_bleu == result["baseline"]["bleu"]
    assert result["baseline"]["generator"]["beam"] == result["beam"] == 5
    assert len(result["run_seconds"]) == len(result["baseline"]["run_seconds"]) == 2
    assert result["sentences"] == 40 and result["threads"] == 1 and result["peak_memory_mb"] > 0
    assert result["latency_ms_p90"] >= result["latency_ms_p50"] > 0
    # The headline ratio is a time ratio over paired runs, every run kept, with its spread and the machine's load.
    assert len(result["speed_ratio_runs"]) == 2 and result["speed_ratio_flagged"] is True  # 2 runs: flagged
    assert result["speed_ratio_min"] <= result["speed_ratio"] <= result["speed_ratio_max"]
    assert result["speed_ratio_definition"].startswith("stock time / method time on the same input sentences")
    assert result["timing"]["alternation"] == "per batch" and result["timing"]["sentences_timed"] == 40
    assert result["timing"]["threads"] == 1 and result["timing"]["load_average_before"] >= 0
    assert result["commands"][0].startswith("fairseq-plugins prepare ")  # from the prepared directory
    assert result["commands"][1] == "fairseq-train data-bin --arch baseline_transformer_tiny"
    assert result["commands"][-1].startswith("fairseq-plugins bench --method baseline")
    assert set(result["versions"]) >= {"python", "torch", "fairseq"}
    assert "| baseline | beam 5 |" in bench.stdout and "| stock | beam 5 |" in bench.stdout


def test_interactive_translates_raw_input_with_the_plugin_checkpoint(trained):
    from fairseq_plugins.tools.prepared import PreparedData

    data = PreparedData(trained["data"])
    refs = open(data.raw_path("test", "tgt")).read().splitlines()
    sources = open(data.raw_path("test", "src")).read().splitlines()[:3]
    pieces = "\n".join(data.tokenizer("src").encode(s) for s in sources) + "\n"
    out = run("fairseq_cli.interactive", os.path.join(trained["data"], "bin"), "--user-dir", USER_DIR,
              "--path", trained["checkpoint"], "--source-lang", "src", "--target-lang", "tgt", "--beam", 5,
              stdin=pieces).stdout
    hyps = [line.split("\t")[2] for line in out.splitlines() if line.startswith("H-")]
    assert len(hyps) == 3
    decoded = [data.tokenizer("tgt").decode(h) for h in hyps]
    assert sacrebleu.corpus_bleu(decoded, [refs[:3]]).score > 30


def test_resumed_training_loads_its_checkpoint(trained, tmp_path):
    save_dir = tmp_path / "resume"
    shutil.copytree(trained["save_dir"], save_dir)
    proc = run("fairseq_cli.train", os.path.join(trained["data"], "bin"), *TRAIN_FLAGS,
               "--max-epoch", TRAIN_EPOCHS + 1, "--save-dir", save_dir)
    log = proc.stdout + proc.stderr
    assert f"Loaded checkpoint {save_dir}/checkpoint_last.pt (epoch {TRAIN_EPOCHS + 1}" in log
    assert f"epoch {TRAIN_EPOCHS + 1:03d} | valid on 'valid' subset" in log
    assert "epoch 001 |" not in log  # nothing retrained from scratch
