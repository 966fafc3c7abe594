"""The README's results table and the cross-method plot come from the bench JSON files, never by hand."""

import json
import os

import pytest

from conftest import REPO, plugins_cli
from fairseq_plugins.bench.overview import BEGIN, END, best_per_method


def result(method, label, bleu, stock_bleu, ratio, runs=(None, None, None), device_type="cpu"):
    runs = [ratio if r is None else r for r in runs]
    return {"method": method, "label": label, "bleu": bleu, "baseline": {"bleu": stock_bleu},
            "bleu_delta": bleu - stock_bleu, "speed_ratio": ratio, "speed_ratio_runs": runs,
            "speed_ratio_min": min(runs), "speed_ratio_max": max(runs),
            "speed_ratio_spread": (max(runs) - min(runs)) / ratio, "batch_size": 1, "device": "test CPU",
            "device_type": device_type, "sentences": 10, "generator": {"description": "greedy"},
            "timing": {"alternation": "per batch"}}


@pytest.fixture
def results_dir(tmp_path):
    directory = tmp_path / "docs" / "results"
    directory.mkdir(parents=True)
    (directory / "fast.json").write_text(json.dumps([
        result("fast", "k=8", 30.0, 34.0, 3.0),       # fastest, but loses 4 BLEU
        result("fast", "k=4", 33.5, 34.0, 2.0),       # within 1 BLEU: the one to show
        result("fast", "k=2", 34.0, 34.0, 1.5),
        result("lossy", "a", 20.0, 30.0, 5.0),
        result("lossy", "b", 27.0, 30.0, 1.2, device_type="cuda"),  # none within 1 BLEU: the closest
    ]))
    (directory / "fast_sweep.json").write_text(json.dumps([
        result("fast", "sweep", 34.0, 34.0, 9.0, runs=(6.0, 9.0, 12.0)),  # the fastest, but its runs spread
        result("fast", "sweep k=3", 33.2, 34.0, 2.5),
        result("fast", "on a GPU", 33.9, 34.0, 4.0, device_type="cuda"),
        result("lattice", "K=16", 30.0, 33.0, 15.0),   # -3.0: within the lattice's 3.5
        result("lattice", "K=8", 29.0, 33.0, 20.0),    # -4.0: outside it
        # -4.0 on the sentences timed, -3.4 on the whole split: the whole split's gap decides, and is shown
        {**result("lattice", "K=12", 29.0, 33.0, 17.0),
         "split_bleu": {"sentences": 1000, "method": {"bleu": 31.0}, "stock": {"bleu": 34.4}, "bleu_delta": -3.4}},
    ]))
    recompute = result("cnn", "length 400", 1.0, 1.0, 0.1, runs=(0.09, 0.1, 0.11))
    recompute["generator"]["description"] = "greedy, no cache"  # the method side is the uncached reference
    # every output forced to 400 tokens, identical on both sides
    recompute["generator"].update(min_len=400, max_len_a=0.0, max_len_b=400)
    recompute["stats"] = {"outputs_identical_to_baseline": 1.0}
    (directory / "cnn.json").write_text(json.dumps([recompute]))
    (directory / "summary.json").write_text(json.dumps({"method": "fast", "baseline": "a text", "rows": []}))
    return directory


def test_each_method_shows_its_fastest_setting_that_keeps_bleu_per_device_from_every_file(results_dir):
    from fairseq_plugins.bench.overview import bench_results

    results = bench_results([str(results_dir)])
    chosen = {(r["method"], r.get("device_type")): (os.path.basename(path), r["label"], why)
              for path, r, why in best_per_method(results)}
    # Sweeps count; k=8 loses 4 BLEU; the sweep's 9x is flagged (its runs spread), so the unflagged 2.5x wins.
    assert chosen[("fast", "cpu")] == ("fast_sweep.json", "sweep k=3", "fastest within 1 BLEU of stock")
    assert chosen[("fast", "cuda")] == ("fast_sweep.json", "on a GPU", "fastest within 1 BLEU of stock")
    assert chosen[("lossy", "cpu")] == ("fast.json", "a", "none within 1 BLEU: closest in BLEU")
    assert chosen[("lossy", "cuda")] == ("fast.json", "b", "none within 1 BLEU: closest in BLEU")
    # A cached-against-recomputed bench is turned round (the cache is the method), and is an ablation: on the
    # method's page, not in the README's rows.
    from fairseq_plugins.bench.overview import best_per_file

    assert "cnn" not in {r["method"] for _, r, _ in best_per_method(results)}
    name, cnn, _ = best_per_file(results, "cnn", None)[0]
    assert cnn["label"] == "cached vs recomputed: length 400" and cnn["generator"]["description"] == "greedy"
    assert (round(cnn["speed_ratio"], 2), round(cnn["speed_ratio_min"], 2), round(cnn["speed_ratio_max"], 2)) == \
        (10.0, 9.09, 11.11)
    # The lattice's own tolerance (its issue's target gap to beam 5).
    assert chosen[("lattice", "cpu")] == ("fast_sweep.json", "K=12", "fastest within 3.5 BLEU of stock")


def test_a_row_measured_against_ctranslate2_shows_that_ratio(results_dir):
    from fairseq_plugins.bench.overview import row_line

    measured = result("fast", "int8 vs CT2", 33.2, 34.0, 2.5)
    runs = [1.1, 1.2, 1.25]
    measured["ctranslate2"] = {"compute_type": "int8", "bleu": 33.5, "speed_ratio": 1.2, "speed_ratio_runs": runs,
                               "speed_ratio_min": 1.1, "speed_ratio_max": 1.25, "speed_ratio_spread": 0.125}
    line = row_line(str(results_dir / "fast.json"), measured, "chosen", str(results_dir.parent), None, 1000)
    # CTranslate2 time / method time, its spread flagged (over 10%), its compute type and BLEU
    assert "| 2.50x (2.50-2.50) | 1.20x (1.10-1.25) !, CT2 int8 BLEU 33.50 |" in line


def test_readme_block_is_written_between_the_markers_and_checked(results_dir, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n\n{BEGIN}\nstale text\n{END}\n\nafter\n")
    # a method measured only in a subfolder of the results (as docs/results/gpu/, docs/results/bytenet-cpu/)
    (results_dir / "gpu").mkdir()
    (results_dir / "gpu" / "gpu_only.json").write_text(json.dumps([
        result("gpu_only", "batch 64", 34.0, 34.0, 6.0, device_type="cuda")]))
    stale = plugins_cli("report", results_dir, results_dir / "gpu", "--readme", readme, "--check", check=False)
    assert stale.returncode == 1 and "out of date" in stale.stdout
    assert "stale text" in readme.read_text()  # --check changes nothing
    plugins_cli("report", results_dir, results_dir / "gpu", "--readme", readme,
                "--overview-plot", tmp_path / "overview.png")
    text = readme.read_text()
    assert text.startswith("# title\n\nbefore\n\n") and text.endswith("\n\nafter\n") and "stale" not in text
    assert ("| fast | sweep k=3 (greedy) | 33.20 (34.00) | -0.80 | same model | 2.50x (2.50-2.50) | - | 1 | "
            "test CPU | not sampled | 10 |") in text
    # each row links the file it came from, relative to the README; the text leaves out docs/results/
    assert "| fastest within 1 BLEU of stock | [fast_sweep.json](docs/results/fast_sweep.json) |" in text
    assert "[gpu/gpu_only.json](docs/results/gpu/gpu_only.json)" in text
    # a row scored on the whole split quotes that BLEU, and says on how many sentences
    assert ("| lattice | K=12 (greedy) | 31.00 (34.40) | -3.40 | same model | 17.00x (17.00-17.00) | - | 1 | "
            "test CPU | not sampled | 10 (BLEU: all 1000) |") in text
    # no hashes recorded: every row says it comes from an unpinned model set
    assert "From an unpinned model set" in text and "From the pinned model set" not in text
    # a cache ablation (forced lengths) is not a README row
    assert "| cnn |" not in text
    assert (tmp_path / "overview.png").read_bytes()[:4] == b"\x89PNG"
    assert plugins_cli("report", results_dir, results_dir / "gpu", "--readme", readme, "--check").returncode == 0


def test_a_readme_without_markers_is_a_clear_error(results_dir, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text("# no block here\n")
    proc = plugins_cli("report", results_dir, "--readme", readme, check=False)
    assert proc.returncode == 2 and f"--readme {readme}: no results block" in proc.stderr
    proc = plugins_cli("report", results_dir, "--check", check=False)
    assert proc.returncode == 2 and "--check goes with --readme" in proc.stderr


def test_the_readme_in_this_repository_is_current_with_docs_results():
    """What CI checks: the table was generated from the committed results, not typed or left stale."""
    proc = plugins_cli("report", "--readme", "README.md", "--check", cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert os.path.isfile(os.path.join(REPO, "docs", "results", "overview.png"))


def test_a_forced_length_bench_quotes_no_bleu():
    """Every output forced to one length (ByteNet's sweep): BLEU says nothing; the row says whether both sides
    wrote the same outputs."""
    from fairseq_plugins.bench.overview import readme_block, row_line

    row = result("cnn", "length 200", 0.0, 0.0, 4.0)
    row["generator"].update(min_len=200, max_len_a=0.0, max_len_b=200)
    for identical, cell in ((1.0, "identical outputs"), (0.9, "-")):
        row["stats"] = {"outputs_identical_to_baseline": identical}
        assert f"| - (every output forced to 200 tokens) | {cell} | same model" in \
            row_line("cnn.json", row, "why", ".", None, None)
    row["generator"].update(max_len_b=300)  # a cap, not a forced length: BLEU as usual, and a README row
    assert "| 0.00 (0.00) | +0.00 | same model | 4.00x" in readme_block([("cnn.json", row)])


def test_a_page_quoting_a_results_file_gets_every_row_of_it_generated_and_checked(results_dir, tmp_path):
    from fairseq_plugins.bench.overview import FILE_BEGIN, FILE_END

    readme = tmp_path / "README.md"
    readme.write_text(f"{BEGIN}\n{END}\n")
    measured = result("fast", "int8 vs CT2", 33.2, 34.0, 2.5)
    measured.update(beam=5, sentences_per_s=50.0, threads=1, git_commit="0123456789abcdef", date="2026-12-01T23:00")
    measured["baseline"].update(sentences_per_s=20.0)
    measured["stats"] = {"outputs_identical_to_baseline": 0.9}
    measured["ctranslate2"] = {"compute_type": "int8", "bleu": 33.5, "sentences_per_s": 40.0,
                               "outputs_identical_to_stock": 0.95, "speed_ratio": 1.25,
                               "speed_ratio_runs": [1.2, 1.25, 1.3], "speed_ratio_min": 1.2, "speed_ratio_max": 1.3,
                               "speed_ratio_spread": 0.08}
    unreferenced = {**result("fast", "no reference", 34.0, 34.0, 1.5, runs=(1.0, 1.5, 2.0)),
                    "git_commit": "0123456789abcdef", "date": "2026-12-01T23:10"}
    (results_dir / "against_ct2.json").write_text(json.dumps([measured, unreferenced]))
    page = tmp_path / "docs" / "page.md"
    block = lambda name: f"{FILE_BEGIN.format(file=name)}\nhand-typed figures\n{FILE_END.format(file=name)}"
    page.write_text(f"# a page\n\n{block('against_ct2.json')}\n\nprose\n")
    stale = plugins_cli("report", results_dir, "--readme", readme, "--check", check=False)
    assert stale.returncode == 1 and "docs/page.md" in stale.stdout
    plugins_cli("report", results_dir, "--readme", readme)
    text = page.read_text()
    assert text.startswith("# a page\n\n") and text.endswith("\n\nprose\n") and "hand-typed" not in text
    assert "Every row of [against_ct2.json](results/against_ct2.json)" in text
    assert "commit 0123456, 2026-12-01" in text
    # both ratios of the same runs, each side's speed, BLEU and identical outputs; '-' where a row has no reference
    assert ("| int8 vs CT2 | 5 | 1 | 2.50x (2.50-2.50) | 1.25x (1.20-1.30) | 50.0, 40.0, 20.0 | "
            "33.20, 33.50, 34.00 (10 timed) | 90%, 95% | not sampled |") in text
    assert "| no reference | - | 1 | 1.50x (1.00-2.00), spread 67% ! | - | -, -, - |" in text
    assert "! no reference: the runs' ratios spread over 67% of the median (more than 10%)." in text
    assert plugins_cli("report", results_dir, "--readme", readme, "--check").returncode == 0
    # a block naming a file that is not there: the marker and the path in the error, nothing written
    page.write_text(block("missing.json") + "\n")
    proc = plugins_cli("report", results_dir, "--readme", readme, check=False)
    assert proc.returncode == 2 and "results-file:missing.json" in proc.stderr and "no such results file" in proc.stderr
    assert "hand-typed" in page.read_text()


def test_a_page_gets_its_profile_table_from_the_profile_files(results_dir, tmp_path):
    from fairseq_plugins.bench.overview import PROFILE_BEGIN, PROFILE_END

    readme = tmp_path / "README.md"
    readme.write_text(f"{BEGIN}\n{END}\n")

    def profile(beam, search, parts, total, ct2):
        return {"checkpoint_sha256": "ab" * 32, "precision": "int8", "beam": beam, "search": search, "threads": 1,
                "device": "test CPU", "git_commit": "fedcba9876543210", "date": "2026-12-01T23:30:00",
                "fast_step": {"sentences": 300, "ms_per_token": parts, "ms_per_token_total": total},
                "ctranslate2": {"ms_per_token_total": ct2, "compute_type": "int8"}}

    (results_dir / "profile_greedy.json").write_text(json.dumps(
        profile(1, "native", {"encoder": 0.05, "decoder": 0.15}, 0.2, 0.3)))
    (results_dir / "profile_beam5.json").write_text(json.dumps(
        profile(5, "python", {"encoder": 0.06, "search bookkeeping": 0.5}, 0.56, 0.6)))
    files = "profile_greedy.json,profile_beam5.json"
    page = tmp_path / "docs" / "page.md"
    page.write_text(f"{PROFILE_BEGIN.format(files=files)}\nold\n{PROFILE_END.format(files=files)}\n")
    plugins_cli("report", results_dir, "--readme", readme)
    text = page.read_text()
    assert "| part | greedy, native search | beam 5, python search |" in text
    # every part of either file, '-' where a file has no such part; both totals
    assert "| encoder | 0.050 | 0.060 |" in text and "| search bookkeeping | - | 0.500 |" in text
    assert "| **fast step, total** | **0.200** | **0.560** |" in text
    assert "| CTranslate2, total | 0.300 (int8) | 0.600 (int8) |" in text
    assert "a model not in the pinned set (sha256 abababababab...)" in text and "commit fedcba9, 2026-12-01" in text
    assert plugins_cli("report", results_dir, "--readme", readme, "--check").returncode == 0
    # a file that is no profile: a clear error naming the block and the file
    (results_dir / "profile_beam5.json").write_text(json.dumps({"fast_step": {}}))
    proc = plugins_cli("report", results_dir, "--readme", readme, check=False)
    assert proc.returncode == 2 and "profile_beam5.json: not a profile written by" in proc.stderr
