"""Shared fixtures: a tiny synthetic corpus, its prepared form, and one tiny model trained on it.

Everything is built in temporary directories; no test reads ../shared (a user's clone has none).
Subprocesses run fairseq's real entry points (`python -m fairseq_cli.train`, ...) with --user-dir, forked from
a process that imported torch and fairseq once (tests/forkserver.py).
"""

import os
import subprocess
import sys

import pytest
from forkserver import ForkServer

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
USER_DIR = os.path.join(REPO, "fairseq_plugins")
SIZES = {"train": 2000, "val": 60, "test_2016_flickr": 40}

# A tiny transformer that learns the synthetic reordering task in about a minute on two cores.
TRAIN_FLAGS = [
    "--user-dir", USER_DIR, "--task", "translation", "--arch", "baseline_transformer_tiny",
    "--optimizer", "adam", "--lr", "5e-3", "--lr-scheduler", "inverse_sqrt", "--warmup-updates", "50",
    "--criterion", "label_smoothed_cross_entropy", "--label-smoothing", "0.1",
    "--max-tokens", "4000", "--seed", "1", "--num-workers", "0",
    "--log-format", "simple", "--no-progress-bar", "--no-epoch-checkpoints",
]
TRAIN_EPOCHS = 12
# Threads of the tiny trainings: both cores on a free machine (CI); OMP_NUM_THREADS=1 where another job holds one.
TRAIN_THREADS = os.environ.get("OMP_NUM_THREADS", "2")

# Fixtures that prepare data or train a model (a minute or more each on 2 cores). A test that needs one,
# directly or through another fixture, is marked ``slow``: `make test-fast` (pytest -m "not slow") runs the others.
TRAINING_FIXTURES = {"prepared", "trained", "copy_model"}  # (and every fixture named *_trained or *_system)

# The longest test files (`make test PYTEST_ARGS=--durations=0`, 2026-11-29), longest first: collected first, so
# that pytest-xdist (`make test`: --dist loadfile --no-loadscope-reorder hands out files in collection order)
# starts them first and the two workers end together instead of one running a long file started last (the GPU
# kit's dry run once ran alone for its last 8 minutes).
LONGEST_FIRST = ("test_gpu_kit.py", "test_double_token.py", "test_rnn_fc.py", "test_bytenet.py", "test_quickstart.py",
                 "test_blockwise.py", "test_lattice.py", "test_bench.py", "test_fast_step.py",
                 "test_fairseq_from_source.py")


def pytest_collection_modifyitems(config, items):
    order = {name: rank for rank, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: each file's own order is kept
    cuda_available = None  # asked once, and only if a test needs a device
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        if names & TRAINING_FIXTURES or any(name.endswith(("_trained", "_system")) for name in names):
            item.add_marker(pytest.mark.slow)
        # Tests marked ``cuda`` (tests/test_cuda.py) are skipped, with the reason, where torch sees no device.
        if item.get_closest_marker("cuda") is not None:
            if cuda_available is None:
                import torch

                cuda_available = torch.cuda.is_available()
            if not cuda_available:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


FORK_SERVER = ForkServer()


def run(module, *args, check=True, env=None, cwd=None, stdin=None, timeout=900):
    """Run ``python -m module args`` (one thread, as the tests share two cores); fail with its stderr tail.
    Forked from a process that imported torch and fairseq already (tests/forkserver.py), unless the command
    needs an interpreter of its own."""
    command = [sys.executable, "-m", module, *map(str, args)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    if FORK_SERVER.usable(env):
        proc = FORK_SERVER.run(command, env, cwd=cwd, stdin=stdin, timeout=timeout)
    else:
        proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, input=stdin,
                              timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {proc.returncode}:\n{proc.stderr[-4000:]}")
    return proc


def plugins_cli(*args, **kwargs):
    return run("fairseq_plugins.cli", *args, **kwargs)


# --- untrained models: a dictionary, the task stand-in build_model needs, random source batches ---------------

def recipe_bin():
    """The directory of the commands the recipes run (where examples/tools.sh finds fairseq-plugins: the venv's
    bin), to put on PATH after a test's stand-ins."""
    found = subprocess.run(["bash", "-c", "source examples/tools.sh; command -v fairseq-plugins"], cwd=REPO,
                           capture_output=True, text=True, check=True)
    return os.path.dirname(found.stdout.strip())


def word_dictionary(size=30):
    """A fairseq Dictionary of the words w0 .. w{size-1} (after the four special symbols)."""
    from fairseq.data import Dictionary

    dictionary = Dictionary()
    for i in range(size):
        dictionary.add_symbol(f"w{i}")
    return dictionary


class DictionaryTask:
    """What a model's ``build_model`` reads from its task: the two dictionaries (here one)."""

    def __init__(self, dictionary):
        self.source_dictionary = self.target_dictionary = dictionary


def random_batch(dictionary, bsz, src_len=7, seed=0):
    """``bsz`` random sources of 2..src_len tokens, left-padded as fairseq pads them, as a sample."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, src_len + 1, (bsz,), generator=g)
    src = torch.randint(dictionary.nspecial, len(dictionary), (bsz, src_len), generator=g)
    for i, n in enumerate(lengths.tolist()):
        src[i, : src_len - n] = dictionary.pad()  # fairseq pads sources on the left
    return {"net_input": {"src_tokens": src, "src_lengths": lengths}}


def on_device(sample, device):
    """``sample`` (nested dicts and lists of tensors) with every tensor on ``device``."""
    from fairseq import utils

    return utils.apply_to_sample(lambda tensor: tensor.to(device), sample)


def decode_on(device, make_generator, model, sample, dtype=None):
    """The n-best lists that ``make_generator(model)`` gives for ``sample`` with a copy of ``model`` moved to
    ``device`` (and cast to ``dtype``); ``model`` itself is left as it is. Each hypothesis as a dict: tokens (a
    list), score (a float), positional_scores (a CPU tensor of the generator's dtype)."""
    import copy

    import torch

    model = copy.deepcopy(model).to(device=device, dtype=dtype).eval()
    generator = make_generator(model)
    with torch.no_grad():
        output = generator.generate([model], on_device(sample, device))
    return [[{"tokens": h["tokens"].tolist(), "score": float(h["score"]),
              "positional_scores": h["positional_scores"].detach().cpu()} for h in hypotheses]
            for hypotheses in output]


def assert_same_hypotheses(got, expected, atol=1e-4):
    """Two decodings of the same sentences (``decode_on``) agree: as many hypotheses a sentence, their scores
    rank by rank within ``atol``, and tokens and positional scores wherever a score is unique in its n-best
    list (float rounding, another device's included, may swap hypotheses whose scores tie); at least half of
    the best hypotheses must have been compared token by token."""
    import torch

    assert len(got) == len(expected)
    compared_best = 0
    for sentence, (mine, theirs) in enumerate(zip(got, expected)):
        scores = [h["score"] for h in theirs]
        assert len(mine) == len(theirs) > 0, sentence
        assert [h["score"] for h in mine] == pytest.approx(scores, abs=atol), sentence
        for rank, (a, b) in enumerate(zip(mine, theirs)):
            if sum(abs(scores[rank] - score) <= atol for score in scores) == 1:
                assert a["tokens"] == b["tokens"], (sentence, rank)
                torch.testing.assert_close(a["positional_scores"].float(), b["positional_scores"].float(),
                                           rtol=0, atol=atol)
                compared_best += rank == 0
    assert 2 * compared_best >= len(expected), "too many tied scores to compare the outputs"


def once_per_session(tmp_path_factory, name, build):
    """``build(directory)`` (a JSON value: paths) run once per test session. Under pytest-xdist (`make test`
    runs two workers) every worker would run a session fixture itself; as xdist's documentation advises, the
    first worker builds it under a file lock in the workers' shared temporary folder and the others read it."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return build(tmp_path_factory.mktemp(name))
    import json
    import shutil

    from filelock import FileLock

    root = tmp_path_factory.getbasetemp().parent
    done = root / f"{name}.json"
    with FileLock(str(root / f"{name}.lock")):
        if done.is_file():
            return json.loads(done.read_text())
        directory = root / name
        shutil.rmtree(directory, ignore_errors=True)  # a build that failed in another worker
        directory.mkdir()
        result = build(directory)
        done.write_text(json.dumps(result))
        return result


@pytest.fixture(scope="session")
def synthetic_raw(tmp_path_factory):
    from fairseq_plugins.tools.synthetic import write_corpus

    return once_per_session(tmp_path_factory, "raw", lambda directory: write_corpus(str(directory), sizes=SIZES))


@pytest.fixture(scope="session")
def prepared(synthetic_raw, tmp_path_factory):
    """Joint SentencePiece (100 pieces) + fairseq binaries of the synthetic corpus."""
    def build(directory):
        out = str(directory / "data")
        plugins_cli("prepare", synthetic_raw, out, "-s", "src", "-t", "tgt", "--vocab-size", 100)
        return out

    return once_per_session(tmp_path_factory, "prepared", build)


def train_flags(task="translation", arch="baseline_transformer_tiny", **replace):
    """TRAIN_FLAGS for another task and model, other values replaced by keyword (the flag's name, dashes as
    underscores: ``lr="3e-3"``)."""
    flags = list(TRAIN_FLAGS)
    for name, value in {"task": task, "arch": arch, **replace}.items():
        flags[flags.index(f"--{name.replace('_', '-')}") + 1] = value
    return flags


def train_tiny(data_bin, save_dir, flags, *extra):
    """fairseq-train with the tiny trainings' threads; returns the save dir."""
    run("fairseq_cli.train", data_bin, *flags, *extra, "--save-dir", save_dir, env={"OMP_NUM_THREADS": TRAIN_THREADS})
    return save_dir


@pytest.fixture(scope="session")
def trained(prepared, tmp_path_factory):
    """A tiny baseline transformer trained through fairseq-train --user-dir; returns its paths."""
    def build(directory):
        save_dir = str(directory)
        run("fairseq_cli.train", os.path.join(prepared, "bin"), *TRAIN_FLAGS,
            "--max-epoch", TRAIN_EPOCHS, "--save-dir", save_dir,
            env={"OMP_NUM_THREADS": TRAIN_THREADS})
        return {"data": prepared, "save_dir": save_dir, "checkpoint": os.path.join(save_dir, "checkpoint_best.pt")}

    return once_per_session(tmp_path_factory, "checkpoints", build)


def incremental_and_full(model, dictionary, device, per_step=1):
    """A copy of ``model`` on ``device``: the decoder's outputs for random prefixes fed ``per_step`` tokens a
    call through fairseq's incremental state (two sentences, two beams each, reordered after the first step as
    beam search reorders them), and the full forward pass over the reordered prefixes; both on the CPU."""
    import copy

    import torch

    model = copy.deepcopy(model).to(device)
    batch = on_device(random_batch(dictionary, bsz=2), device)
    prev = torch.randint(dictionary.nspecial, len(dictionary), (4, 8), generator=torch.Generator().manual_seed(1))
    prev[:, :per_step] = dictionary.eos()
    prev = prev.to(device)
    reorder = torch.tensor([1, 1, 3, 2], device=device)  # beam 1 of sentence 0 replaces beam 0; sentence 1 swaps
    with torch.no_grad():
        encoder_out = model.encoder.forward_torchscript(batch["net_input"])
        encoder_out = model.encoder.reorder_encoder_out(encoder_out, torch.tensor([0, 0, 1, 1], device=device))
        state, steps = {}, []
        for end in range(per_step, prev.size(1) + 1, per_step):
            if end == 2 * per_step:
                model.decoder.reorder_incremental_state_scripting(state, reorder)
                encoder_out = model.encoder.reorder_encoder_out(encoder_out, reorder)
                prev = prev[reorder]
                steps = [step[reorder] for step in steps]
            logits, _ = model.decoder(prev[:, :end], encoder_out=encoder_out, incremental_state=state)
            assert logits.size(1) == per_step
            steps.append(logits)
        full, _ = model.decoder(prev, encoder_out=encoder_out)
    return torch.cat(steps, dim=1).cpu(), full.cpu()


# Tiny systems more than one test file decodes, trained once per session (under pytest-xdist, by the first
# worker that asks): each file then only reads them.

@pytest.fixture(scope="session")
def lattice_system(prepared, tmp_path_factory):
    """The synthetic corpus aligned, its candidate table, and a tiny lattice_transformer trained on it."""
    def build(directory):
        tok = os.path.join(prepared, "tok")
        plugins_cli("align", "--source", os.path.join(tok, "train.src"), "--target", os.path.join(tok, "train.tgt"),
                    "--output", directory / "train.align")
        plugins_cli("lattice-table", "--data-bin", os.path.join(prepared, "bin"), "-s", "src", "-t", "tgt",
                    "--alignment", directory / "train.align", "--output", directory / "table.pt")
        save_dir = train_tiny(os.path.join(prepared, "bin"), str(directory / "checkpoints"),
                              train_flags("lattice_translation", "lattice_transformer_tiny"), "--max-epoch", 12)
        return {"checkpoints": save_dir, "checkpoint": os.path.join(save_dir, "checkpoint_best.pt"),
                "table": str(directory / "table.pt")}

    return once_per_session(tmp_path_factory, "lattice", build)


# The blockwise heads' training flags: conftest's, with the blockwise task, model and criterion.
BLOCKWISE_TRAIN_FLAGS = train_flags("blockwise_translation", "blockwise_transformer_tiny",
                                    criterion="blockwise_label_smoothed_cross_entropy", lr="3e-3")
BLOCKWISE_HEADS = 4


@pytest.fixture(scope="session")
def blockwise_system(trained, tmp_path_factory):
    """Proposal heads (BLOCKWISE_HEADS, one FFN each) trained on the frozen tiny baseline (the paper's 'regular'
    setting), the checkpoint chosen on the heads' mean validation accuracy, as examples/blockwise/run.sh does."""
    def build(directory):
        save_dir = train_tiny(os.path.join(trained["data"], "bin"), str(directory / "checkpoints"),
                              BLOCKWISE_TRAIN_FLAGS, "--blockwise-heads", BLOCKWISE_HEADS,
                              "--blockwise-base-checkpoint", trained["checkpoint"], "--blockwise-freeze-base",
                              "--blockwise-head-layout", "separate", "--best-checkpoint-metric", "proposal_accuracy",
                              "--maximize-best-checkpoint-metric", "--patience", 3, "--max-epoch", 8)
        return {"checkpoints": save_dir, "checkpoint": os.path.join(save_dir, "checkpoint_best.pt")}

    return once_per_session(tmp_path_factory, "blockwise", build)


def train_double_token(data, save_dir, order, per_step, *extra):
    """A tiny double_token_transformer through fairseq-train; returns its best checkpoint and the training log."""
    proc = run("fairseq_cli.train", os.path.join(data, "bin"),
               *train_flags("double_token_translation", "double_token_transformer_tiny"), "--token-order", order,
               "--tokens-per-step", per_step, "--max-epoch", 12, "--save-dir", save_dir, *extra,
               env={"OMP_NUM_THREADS": TRAIN_THREADS})
    return os.path.join(save_dir, "checkpoint_best.pt"), proc.stdout + proc.stderr


@pytest.fixture(scope="session")
def double_token_bidir_system(prepared, tmp_path_factory):
    """The paper's bidirectional double-token system (bidir-2), validation BLEU logged (--eval-bleu)."""
    def build(directory):
        checkpoint, log = train_double_token(prepared, str(directory / "checkpoints"), "bidir", 2, "--eval-bleu",
                                             "--eval-bleu-remove-bpe", "sentencepiece")
        (directory / "train.log").write_text(log)
        return {"checkpoints": os.path.dirname(checkpoint), "checkpoint": checkpoint,
                "log": str(directory / "train.log")}

    return once_per_session(tmp_path_factory, "double_token_bidir", build)


@pytest.fixture(scope="session")
def rnn_fc_system(prepared, tmp_path_factory):
    """A tiny rnn_fc trained with --task translation (as examples/rnn_fc/run.sh trains it)."""
    def build(directory):
        save_dir = train_tiny(os.path.join(prepared, "bin"), str(directory / "checkpoints"),
                              train_flags("translation", "rnn_fc_tiny"), "--clip-norm", 1.0, "--max-epoch", 12)
        return {"checkpoints": save_dir, "checkpoint": os.path.join(save_dir, "checkpoint_best.pt")}

    return once_per_session(tmp_path_factory, "rnn_fc", build)
