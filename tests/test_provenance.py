"""A bench result names what it measured by content (checkpoints, task files, data) and by commit, also on a
copy of the tree without .git (a lent GPU machine)."""

import hashlib
import json
import os
import subprocess

from conftest import plugins_cli
from fairseq_plugins.bench.provenance import model_hashes, task_files
from fairseq_plugins.bench.report import COMMIT_STAMP, COMMIT_VARIABLE, git_commit

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sha256(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_bench_records_the_content_of_its_checkpoints_and_data(trained, tmp_path):
    result_path = tmp_path / "r.json"
    plugins_cli("bench", "--method", "baseline", "--path", trained["checkpoint"], "--data", trained["data"],
                "--threads", 1, "--runs", 1, "--beam", 1, "--limit", 2, "--no-whole-split-bleu",
                "--json", result_path)
    hashes = json.loads(result_path.read_text())["hashes"]
    assert hashes["checkpoint"] == hashes["baseline_checkpoint"] == sha256(trained["checkpoint"])
    assert hashes["data"]["test.src"] == sha256(os.path.join(trained["data"], "raw", "test.src"))
    assert set(hashes["data"]) == {"test.src", "test.tgt", "test.src-tgt.src.bin", "test.src-tgt.tgt.bin",
                                   "dict.src.txt", "dict.tgt.txt"}
    assert hashes["task_files"] == {}


def test_a_stock_side_of_its_own_and_the_files_task_flags_name_are_hashed(tmp_path):
    method, stock, table = tmp_path / "method.pt", tmp_path / "stock.pt", tmp_path / "table.txt"
    method.write_bytes(b"method")
    stock.write_bytes(b"stock")
    table.write_text("a b 0.5\n")
    hashes = model_hashes(str(method), str(stock), {"lattice_table": str(table), "lattice_k": 8, "empty": ""},
                          [str(table), None, str(tmp_path / "missing")])
    assert hashes["checkpoint"] == sha256(method) and hashes["baseline_checkpoint"] == sha256(stock)
    assert hashes["task_files"] == {"lattice_table": {"path": str(table), "sha256": sha256(table)}}
    assert hashes["data"] == {"table.txt": sha256(table)}
    assert task_files({"not_a_file": str(tmp_path)}) == {}  # a directory is not a file the task read


def test_a_copy_without_git_names_the_commit_it_was_stamped_with(tmp_path, monkeypatch):
    monkeypatch.delenv(COMMIT_VARIABLE, raising=False)
    assert git_commit(str(tmp_path)) == "unknown"
    (tmp_path / ".gpu").mkdir()
    (tmp_path / COMMIT_STAMP).write_text("0123abcd+dirty\n")
    assert git_commit(str(tmp_path)) == "0123abcd+dirty"
    monkeypatch.setenv(COMMIT_VARIABLE, "feedbeef")
    assert git_commit(str(tmp_path)) == "feedbeef"


def test_the_gpu_kit_stamps_the_commit_of_the_tree_it_carries(tmp_path):
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(tmp_path)]
    subprocess.run(git + ["init", "-q"], check=True)
    (tmp_path / "f").write_text("one\n")
    subprocess.run(git + ["add", "f"], check=True)
    subprocess.run(git + ["commit", "-qm", "one"], check=True)
    head = subprocess.run(git + ["rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    kit = os.path.join(REPO, "examples", "gpu", "run.sh")
    subprocess.run([kit, "stamp"], cwd=tmp_path, check=True, capture_output=True)
    assert (tmp_path / COMMIT_STAMP).read_text().strip() == head
    (tmp_path / "f").write_text("two\n")
    subprocess.run([kit, "stamp"], cwd=tmp_path, check=True, capture_output=True)
    assert (tmp_path / COMMIT_STAMP).read_text().strip() == head + "+dirty"
