"""docs/python-api.md, run as written: for each method, its fairseq-interactive command on raw text and its
Python snippet (fairseq's hub interface, ``from_pretrained(...).translate``) on tiny trained checkpoints, with
the fixtures' paths in place of the document's. Both must give, string for string, what fairseq-generate
gives for the same sentences of the binarised test split with the same checkpoint and flags.

Also the two fixes the hub interface needs (``task=`` switching the task, fairseq_fixes.py; ``--bpe
char``, bytenet/char_bpe.py) and the document's claims about which SentencePiece model to pass.
"""

import os
import random
import re
import shlex

import pytest

from conftest import USER_DIR, plugins_cli, run, train_flags, train_tiny

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "python-api.md")
EXAMPLE = "A little girl climbs into a wooden playhouse."  # the document's sentence, replaced by test sentences
SENTENCES = 4  # the first sentences of the test split, translated all three ways
DOC_DATA = "work/baseline/data"
# The document's checkpoint directories (and the lattice table), by section.
DOC_PATHS = {
    "baseline": "work/baseline/checkpoints",
    "blockwise": "work/blockwise/regular/checkpoints",
    "double_token": "work/double_token/bidir-2/checkpoints",
    "lattice": "work/lattice/distill-1/checkpoints",
    "rnn_fc": "work/rnn_fc/fc4-tanh/checkpoints",
    "fast_step": "work/baseline/checkpoints",
    "bytenet": "work/bytenet/bytenet-mt/checkpoints",
}
DOC_TABLE = "work/lattice/distill/table.pt"
DOC_CHAR_DATA = "work/bytenet/mt-data"
DOC_LANGS = {"en": "src", "de": "tgt"}


# --- the document --------------------------------------------------------------------------------------------

def doc_sections():
    """{section title: (its ```sh block, its ```python block)} of docs/python-api.md."""
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    sections = {}
    for part in re.split(r"^## ", text, flags=re.M)[1:]:
        title = part.split("\n", 1)[0].strip()
        blocks = dict((kind, body) for kind, body in re.findall(r"```(sh|python)\n(.*?)```", part, flags=re.S))
        if blocks:
            sections[title] = (blocks.get("sh"), blocks.get("python"))
    return sections


def substitute(text, paths):
    for doc_path, path in sorted(paths.items(), key=lambda item: -len(item[0])):  # longest first
        text = text.replace(doc_path, str(path))
    return text


def interactive_flags(sh, paths):
    """The fairseq-interactive arguments of a section's command (paths substituted, the languages mapped)."""
    command = substitute(sh, paths).replace("\\\n", " ")
    (segment,) = [s for s in command.split(" | ") if s.strip().startswith("fairseq-interactive")]
    args = shlex.split(segment)[1:]
    args = [USER_DIR if arg == "$(fairseq-plugins user-dir)" else arg for arg in args]
    for flag in ("--source-lang", "--target-lang"):
        args[args.index(flag) + 1] = DOC_LANGS[args[args.index(flag) + 1]]
    assert EXAMPLE in sh  # the sentence echoed into it, replaced by the test's
    return args


def run_snippet(python, paths, sentences):
    """Execute a section's Python snippet with ``sentences`` (a list) in place of the example sentence; returns
    what it printed (``translate`` of a list: a list of strings) and the hub interface it built."""
    code = substitute(python, paths)
    assert code.count(repr(EXAMPLE).replace("'", '"')) == 1
    code = code.replace(repr(EXAMPLE).replace("'", '"'), repr(list(sentences)))
    printed = []
    namespace = {"print": printed.append, "__name__": "python_api_snippet"}
    exec(compile(code, DOC, "exec"), namespace)
    (result,) = printed
    return result, namespace["hub"]


# --- fairseq's commands --------------------------------------------------------------------------------------

def fields(output, kind):
    """{sentence id: text} of the ``kind``- lines (H or D) of fairseq-interactive/-generate output."""
    found = {}
    for line in output.splitlines():
        if line.startswith(f"{kind}-"):
            head, _score, text = (line.split("\t", 2) + ["", ""])[:3]
            found.setdefault(int(head[2:]), text)
    return found


def three_ways(section, paths, data, sentences_from=None):
    """The document's section run three ways on the first SENTENCES raw test sources of prepared ``data``:
    fairseq-interactive, the Python snippet, and fairseq-generate (with the interactive command's flags) on the
    binarised test split. Checks that they agree; returns (the translations, the hub interface)."""
    from fairseq_plugins.tools.prepared import PreparedData

    prepared = PreparedData(data)
    with open(prepared.raw_path("test", "src"), encoding="utf-8") as f:
        sentences = [next(f).rstrip("\n") for _ in range(SENTENCES)]
    sh, python = doc_sections()[section]
    flags = interactive_flags(sh, paths)

    interactive = run("fairseq_cli.interactive", *flags, stdin="\n".join(sentences) + "\n").stdout
    detokenised = fields(interactive, "D")
    pieces = fields(interactive, "H")
    assert sorted(detokenised) == sorted(pieces) == list(range(SENTENCES)), interactive[-2000:]
    by_interactive = [detokenised[i] for i in range(SENTENCES)]
    # The H- lines (pieces) through the prepared directory's own detokeniser (fairseq-plugins detok's) agree.
    assert [prepared.tokenizer("tgt").decode(pieces[i]) for i in range(SENTENCES)] == by_interactive

    generate = run("fairseq_cli.generate", *flags, "--gen-subset", "test").stdout
    generated = fields(generate, "D")
    assert len(generated) == len(prepared_lines(prepared)), generate[-2000:]
    by_generate = [generated[i] for i in range(SENTENCES)]

    by_hub, hub = run_snippet(python, paths, sentences)

    assert by_hub == by_interactive == by_generate, (by_hub, by_interactive, by_generate)
    assert all(text.strip() for text in by_hub)
    return by_hub, hub


def prepared_lines(prepared):
    with open(prepared.raw_path("test", "src"), encoding="utf-8") as f:
        return f.read().splitlines()


def ends_sentences(translations):
    """The synthetic corpus's targets end with " ." (as its sources do): the models learnt that much."""
    return all(text.endswith(" .") and len(text.split()) >= 3 for text in translations)


# --- tiny models (the recipes of the methods' own test modules) ----------------------------------------------

@pytest.fixture(scope="module")
def blockwise_trained(blockwise_system):
    return blockwise_system["checkpoints"]


@pytest.fixture(scope="module")
def double_token_trained(double_token_bidir_system):
    return double_token_bidir_system["checkpoints"]


def write_copy_corpus(directory, seed=3, alphabet="abcdefghijkl "):
    """Character copy task, the target the source (tests/test_bytenet.py's corpus)."""
    rng = random.Random(seed)
    os.makedirs(directory, exist_ok=True)
    for split, size in (("train", 2000), ("val", 50), ("test", 40)):
        lines = ["".join(rng.choice(alphabet) for _ in range(rng.randint(3, 24))).strip() or "a"
                 for _ in range(size)]
        for lang in ("src", "tgt"):
            with open(os.path.join(directory, f"{split}.{lang}"), "w", encoding="utf-8") as f:
                f.write("\n".join(lines) + "\n")
    return directory


@pytest.fixture(scope="module")
def bytenet_trained(tmp_path_factory):
    """A tiny ByteNet that learnt to copy characters, on data prepared with --char."""
    root = tmp_path_factory.mktemp("hub_bytenet")
    data = str(root / "data")
    plugins_cli("prepare", "--char", write_copy_corpus(str(root / "raw")), data, "-s", "src", "-t", "tgt")
    save_dir = train_tiny(os.path.join(data, "bin"), str(root / "checkpoints"),
                          train_flags("translation", "bytenet_tiny", lr="3e-3", max_tokens="3000"),
                          "--max-epoch", 6, "--cpu")
    return {"data": data, "checkpoints": save_dir}


# --- each method, three ways ---------------------------------------------------------------------------------

@pytest.mark.slow
def test_baseline(trained):
    paths = {DOC_DATA: trained["data"], DOC_PATHS["baseline"]: trained["save_dir"]}
    translations, hub = three_ways("baseline", paths, trained["data"])
    assert type(hub.task).__name__ == "TranslationTask"
    assert ends_sentences(translations), translations


@pytest.mark.slow
def test_blockwise(trained, blockwise_trained):
    from fairseq_plugins.blockwise.task import BlockwiseTranslationTask

    paths = {DOC_DATA: trained["data"], DOC_PATHS["blockwise"]: blockwise_trained}
    translations, hub = three_ways("blockwise", paths, trained["data"])
    assert isinstance(hub.task, BlockwiseTranslationTask) and ends_sentences(translations), translations
    # translate's default beam (5) is refused, naming the flag to give.
    with pytest.raises(ValueError, match="blockwise decoding is greedy: pass --beam 1"):
        hub.translate("the old dress carries the old red bike in the beach .")


@pytest.mark.slow
def test_double_token(prepared, double_token_trained):
    from fairseq_plugins.double_token.task import DoubleTokenTranslationTask

    paths = {DOC_DATA: prepared, DOC_PATHS["double_token"]: double_token_trained}
    translations, hub = three_ways("double_token", paths, prepared)
    assert isinstance(hub.task, DoubleTokenTranslationTask) and hub.task.token_order == "bidir"
    assert ends_sentences(translations), translations


@pytest.mark.slow
def test_lattice(prepared, lattice_system):
    from fairseq_plugins.lattice.task import LatticeTranslationTask

    paths = {DOC_DATA: prepared, DOC_PATHS["lattice"]: lattice_system["checkpoints"],
             DOC_TABLE: lattice_system["table"]}
    translations, hub = three_ways("lattice", paths, prepared)
    assert isinstance(hub.task, LatticeTranslationTask) and hub.task.cfg.lattice_table == lattice_system["table"]
    assert ends_sentences(translations), translations


@pytest.mark.slow
def test_rnn_fc(prepared, rnn_fc_system):
    from fairseq_plugins.rnn_fc.generator import RnnFcGenerator
    from fairseq_plugins.rnn_fc.task import RnnFcTranslationTask

    translations, hub = three_ways("rnn_fc", {DOC_DATA: prepared, DOC_PATHS["rnn_fc"]: rnn_fc_system["checkpoints"]}, prepared)
    # task= switched the checkpoint's --task translation to rnn_fc's (fairseq alone keeps translation).
    assert isinstance(hub.task, RnnFcTranslationTask)
    assert isinstance(hub.task.build_generator(hub.models, hub.cfg.generation), RnnFcGenerator)
    assert ends_sentences(translations), translations


@pytest.mark.slow
def test_fast_step(trained):
    from fairseq_plugins.kernels.sequence_generator import FastStepSequenceGenerator
    from fairseq_plugins.fast_step.task import FastStepTranslationTask

    paths = {DOC_DATA: trained["data"], DOC_PATHS["fast_step"]: trained["save_dir"]}
    translations, hub = three_ways("fast_step", paths, trained["data"])
    # The task and its flag reached the task the hub interface decodes with: the fast step ran, not fairseq's.
    assert isinstance(hub.task, FastStepTranslationTask) and hub.task.cfg.fast_step
    assert isinstance(hub.task.build_generator(hub.models, hub.cfg.generation), FastStepSequenceGenerator)
    assert ends_sentences(translations), translations


@pytest.mark.slow
def test_bytenet(bytenet_trained):
    data = bytenet_trained["data"]
    paths = {DOC_CHAR_DATA: data, DOC_PATHS["bytenet"]: bytenet_trained["checkpoints"]}
    translations, hub = three_ways("bytenet", paths, data)
    from fairseq_plugins.tools.prepared import PreparedData

    sources = prepared_lines(PreparedData(data))[:SENTENCES]
    assert sum(t == s for t, s in zip(translations, sources)) >= SENTENCES - 1, (translations, sources)  # copies
    # Spaces, and a tab (which fairseq's own --bpe characters loses), go through as prepare --char writes them.
    assert hub.translate("abc def", beam=5) == "abc def"
    assert hub.apply_bpe("a b\tc") == "a ▁ b <U+0009> c" and hub.remove_bpe("a ▁ b <U+0009> c") == "a b\tc"


# --- the fixes and the document's claims ---------------------------------------------------------------------

@pytest.mark.slow
def test_task_override_switches_the_task_and_reaches_its_flags(trained):
    import fairseq_plugins
    from fairseq import checkpoint_utils
    from fairseq.models.transformer import TransformerModel
    from fairseq_plugins.fast_step.task import FastStepTranslationTask

    common = dict(checkpoint_file="checkpoint_best.pt", data_name_or_path=os.path.join(trained["data"], "bin"),
                  user_dir=fairseq_plugins.user_dir())
    hub = TransformerModel.from_pretrained(trained["save_dir"], task="fast_step_translation", fast_step=True,
                                           fast_step_precision="int8", fast_step_early_stop_delta=2.0, **common)
    assert isinstance(hub.task, FastStepTranslationTask)
    assert (hub.task.cfg.fast_step, str(hub.task.cfg.fast_step_precision), hub.task.cfg.fast_step_early_stop_delta) \
        == (True, "int8", 2.0)
    assert hub.task.cfg.data == common["data_name_or_path"]  # the overrides of the keys both tasks have still apply
    plain = TransformerModel.from_pretrained(trained["save_dir"], **common)
    assert type(plain.task).__name__ == "TranslationTask"
    with pytest.raises(ValueError, match="task='no_such_task': no such fairseq task"):
        TransformerModel.from_pretrained(trained["save_dir"], task="no_such_task", **common)
    wrapper = checkpoint_utils.overwrite_args_by_name
    fairseq_plugins.fairseq_fixes.switch_task_in_overrides()  # idempotent: wraps once
    assert checkpoint_utils.overwrite_args_by_name is wrapper and wrapper.switches_task


def test_char_bpe_is_prepare_chars_tokenizer():
    from fairseq.data import encoders
    from fairseq_plugins.tools.tokenization import CharTokenizer

    bpe = encoders.build_bpe("char")
    for text in ["a little girl .", "tab\there", "no\u00a0break", "", "  two  spaces "]:
        assert bpe.encode(text) == CharTokenizer().encode(text)
        assert bpe.decode(bpe.encode(text)) == text


@pytest.mark.slow
def test_separate_sentencepiece_models_pass_the_source_model(synthetic_raw, tmp_path):
    """With prepare --separate, fairseq's one --sentencepiece-model is the source's: it splits the source as the
    prepared data was split, and joins the target's pieces back into the raw target text."""
    from fairseq.data import encoders
    from omegaconf import OmegaConf

    data = tmp_path / "data"
    plugins_cli("prepare", synthetic_raw, data, "-s", "src", "-t", "tgt", "--vocab-size", 60, "--separate")
    assert sorted(p.name for p in data.glob("spm*.model")) == ["spm.src.model", "spm.tgt.model"]
    source_model = str(data / "spm.src.model")
    bpe = encoders.build_bpe(OmegaConf.create({"_name": "sentencepiece", "sentencepiece_model": source_model}))

    def lines(*parts):
        return (data.joinpath(*parts)).read_text(encoding="utf-8").splitlines()

    assert [bpe.encode(line) for line in lines("raw", "test.src")] == lines("tok", "test.src")
    assert [bpe.decode(line) for line in lines("tok", "test.tgt")] == lines("raw", "test.tgt")
    assert lines("tok", "test.tgt") != [bpe.encode(line) for line in lines("raw", "test.tgt")]  # models differ
