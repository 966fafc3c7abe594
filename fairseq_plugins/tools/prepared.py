"""Prepared data directories: raw parallel text -> tokens -> fairseq binaries, and the way back; the
``prepare``, ``prepare-lm`` and ``detok`` subcommands.

Layout written by ``fairseq-plugins prepare`` (the directory is built aside and renamed into place)::

    OUT/prepare.json           manifest: languages, tokenizer spec, splits, the command that made it
    OUT/spm*.model             SentencePiece models (joint: spm.model; separate: spm.<lang>.model)
    OUT/raw/<split>.<lang>     untokenised valid/test text, the references for scoring
    OUT/tok/<split>.<lang>     tokenised text, the input to fairseq-preprocess
    OUT/bin/                   fairseq-preprocess output: the data directory for fairseq-train/-generate
"""

import contextlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
from typing import Dict, Iterator, List, Optional

from ..common.textio import (InputError, decode_lines, give_default_mode, non_negative_int, positive_int, read_lines,
                     read_parallel, write_lines)
from .tokenization import VISIBLE_SPACE, CharTokenizer, SentencePieceTokenizer, load_tokenizer, train_sentencepiece

logger = logging.getLogger(__name__)

MANIFEST = "prepare.json"
MANIFEST_VERSION = 1
FAIRSEQ_SPLITS = ("train", "valid", "test")
LM_STREAM = "txt"  # prepare_lm's tokenised text: tok/<split>.txt
NUM_SPECIAL_SYMBOLS = 4  # fairseq's <s>, <pad>, </s>, <unk>: in a Dictionary, not in its dict.*.txt
# File stems each fairseq split is found under, in order of preference (Multi30k's names first).
SPLIT_STEMS = {
    "train": ("train",),
    "valid": ("val", "valid", "dev"),
    "test": ("test_2016_flickr", "test"),
}


def find_split_prefixes(raw_dir: str, source_lang: str, target_lang: str, stems: Dict[str, str]) -> Dict[str, str]:
    """Map each fairseq split to the path prefix of its raw files in ``raw_dir`` (Multi30k layout)."""
    if not os.path.isdir(raw_dir):
        raise InputError(f"{raw_dir}: data directory not found")
    prefixes = {}
    for split in FAIRSEQ_SPLITS:
        candidates = (stems[split],) if stems.get(split) else SPLIT_STEMS[split]
        for stem in candidates:
            prefix = os.path.join(raw_dir, stem)
            if all(os.path.isfile(f"{prefix}.{lang}") for lang in (source_lang, target_lang)):
                prefixes[split] = prefix
                break
        else:
            wanted = " or ".join(f"{stem}.{{{source_lang},{target_lang}}}" for stem in candidates)
            raise InputError(f"{raw_dir}: no {split} split found (looked for {wanted})")
    return prefixes


def _check_output_dir(out_dir: str, overwrite: bool) -> None:
    """Refuse to replace a non-empty directory unless asked (checked before any slow work)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise InputError(f"{out_dir}: output directory is a file")
    if os.path.exists(out_dir) and os.listdir(out_dir) and not overwrite:
        raise InputError(f"{out_dir}: output directory exists and is not empty (pass --overwrite to replace it)")


@contextlib.contextmanager
def _build_aside(out_dir: str) -> Iterator[str]:
    """A hidden directory beside ``out_dir``, renamed into its place only if the block succeeds.

    An existing ``out_dir`` is moved aside first and deleted only once the new one is in place: a failure
    leaves it whole."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    build_dir = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(os.path.abspath(out_dir))}.")
    try:
        yield build_dir
        give_default_mode(build_dir)
        old_dir = f"{build_dir}.old" if os.path.exists(out_dir) else None
        if old_dir:
            os.replace(out_dir, old_dir)
        try:
            os.replace(build_dir, out_dir)
        except BaseException:
            if old_dir:
                os.replace(old_dir, out_dir)
            raise
        if old_dir:
            shutil.rmtree(old_dir, ignore_errors=True)
    except BaseException:
        shutil.rmtree(build_dir, ignore_errors=True)
        raise


def prepare(
    raw_dir: str,
    out_dir: str,
    source_lang: str,
    target_lang: str,
    tokenizer: str = "sentencepiece",
    vocab_size: int = 8000,
    joint: bool = True,
    spm_model_type: str = "unigram",
    split_stems: Optional[Dict[str, str]] = None,
    train_limit: int = 0,
    workers: int = 1,
    overwrite: bool = False,
    command: Optional[List[str]] = None,
) -> Dict:
    """Tokenise and binarise a parallel corpus; returns the manifest. See the module docstring for layout."""
    if source_lang == target_lang:
        raise InputError(f"--source-lang and --target-lang are both {source_lang!r}")
    _check_output_dir(out_dir, overwrite)
    prefixes = find_split_prefixes(raw_dir, source_lang, target_lang, split_stems or {})
    langs = (source_lang, target_lang)
    texts = {}
    for split, prefix in prefixes.items():
        source, target = read_parallel(f"{prefix}.{source_lang}", f"{prefix}.{target_lang}")
        if split == "train" and train_limit:
            source, target = source[:train_limit], target[:train_limit]
        texts[split] = {source_lang: source, target_lang: target}

    with _build_aside(out_dir) as build_dir:
        for split in FAIRSEQ_SPLITS:
            for lang in langs:
                write_lines(os.path.join(build_dir, "raw", f"{split}.{lang}"), texts[split][lang])

        if tokenizer == "char":
            char = CharTokenizer()
            for split in FAIRSEQ_SPLITS:
                for lang in langs:
                    _check_characters(char, texts[split][lang], f"{prefixes[split]}.{lang}")
            tokenizers = {lang: char for lang in langs}
            specs = {lang: char.spec() for lang in langs}
        elif tokenizer == "sentencepiece":
            tokenizers, specs = _train_sentencepiece_models(build_dir, langs, joint, vocab_size, spm_model_type)
        else:
            raise InputError(f"--tokenizer {tokenizer!r}: expected 'sentencepiece' or 'char'")

        joined_dictionary = joint or tokenizer == "char"
        _tokenize_and_binarize(build_dir, texts, tokenizers, workers, (source_lang, target_lang), joined_dictionary)
        manifest = {
            "version": MANIFEST_VERSION,
            "source_lang": source_lang,
            "target_lang": target_lang,
            "tokenizer": specs,
            "joined_dictionary": joined_dictionary,
            "splits": {
                split: {"lines": len(texts[split][source_lang]), "from": os.path.abspath(prefixes[split])}
                for split in FAIRSEQ_SPLITS
            },
            "command": command or [],
        }
        _write_manifest(build_dir, manifest)
    return manifest


def _train_sentencepiece_models(build_dir, langs, joint, vocab_size, model_type):
    """Train one joint model on both sides' training text, or one model per language."""
    train_files = {lang: os.path.join(build_dir, "raw", f"train.{lang}") for lang in langs}
    groups = {"spm": list(langs)} if joint else {f"spm.{lang}": [lang] for lang in langs}
    tokenizers, specs = {}, {}
    for prefix, group in groups.items():
        logger.info("training SentencePiece %s (%d pieces) on %s", prefix, vocab_size, ", ".join(group))
        try:
            model_path = train_sentencepiece(
                [train_files[lang] for lang in group], os.path.join(build_dir, prefix), vocab_size, model_type
            )
        except RuntimeError as error:  # e.g. a vocabulary larger than the text supports
            raise InputError(f"--vocab-size {vocab_size}: SentencePiece training failed: {error}") from error
        for lang in group:
            tokenizers[lang] = SentencePieceTokenizer(model_path)
            specs[lang] = {"kind": "sentencepiece", "model": os.path.basename(model_path)}
    return tokenizers, specs


def _check_characters(char: CharTokenizer, lines: List[str], path: str) -> None:
    for number, line in enumerate(lines, start=1):
        char.check(line, f"{path}:{number}")


def _tokenize_and_binarize(build_dir: str, texts: Dict[str, Dict[str, List[str]]], tokenizers: Dict, workers: int,
                           pair: Optional[tuple] = None, joined_dictionary: bool = False) -> Dict:
    """The one text -> tokens -> binaries pipeline of :func:`prepare` and :func:`prepare_lm`.

    ``texts[split][name]`` is written tokenised to ``tok/<split>.<name>`` and binarised by fairseq-preprocess
    into ``bin/``: as a (source, target) ``pair`` of languages, or, without one, as a single monolingual
    stream (``--only-source``: bin/<split>.bin, what ``--task language_modeling`` reads). Returns the
    tokenised lines.
    """
    from fairseq import options
    from fairseq_cli import preprocess

    tok = os.path.join(build_dir, "tok")
    encoded = {}
    for split, by_name in texts.items():
        for name, lines in by_name.items():
            encoded.setdefault(split, {})[name] = [tokenizers[name].encode(line) for line in lines]
            write_lines(os.path.join(tok, f"{split}.{name}"), encoded[split][name])
    argv = ["--destdir", os.path.join(build_dir, "bin"), "--workers", str(workers)]
    for split in FAIRSEQ_SPLITS:
        if split not in texts:
            continue
        if pair:  # fairseq-preprocess appends .<lang> to the prefix
            prefix = os.path.join(tok, split)
        else:  # one stream, read from the prefix as it is
            (name,) = texts[split]
            prefix = os.path.join(tok, f"{split}.{name}")
        argv += [f"--{split}pref", prefix]
    if pair:
        argv += ["--source-lang", pair[0], "--target-lang", pair[1]]
    else:
        argv.append("--only-source")
    if joined_dictionary:
        argv.append("--joined-dictionary")
    with _preprocess_log_kept():
        preprocess.main(options.get_preprocessing_parser().parse_args(argv))
    return encoded


@contextlib.contextmanager
def _preprocess_log_kept() -> Iterator[None]:
    """fairseq-preprocess writes bin/preprocess.log (dictionary sizes, <unk> rates) through its INFO logs: keep
    them for that file when the command is quiet (WARNING), without letting them through to stderr. The file
    handler fairseq-preprocess adds for it is closed and removed afterwards (it never removes it: every call in
    one process would add one more, each holding its file open and getting every later call's logs)."""
    log = logging.getLogger("fairseq_cli.preprocess")
    level, propagate, handlers = log.level, log.propagate, list(log.handlers)
    if not log.isEnabledFor(logging.INFO):  # with -v they go to stderr too, as fairseq-preprocess shows them
        log.setLevel(logging.INFO)
        log.propagate = False
    try:
        yield
    finally:
        log.setLevel(level)
        log.propagate = propagate
        for handler in [h for h in log.handlers if h not in handlers]:
            log.removeHandler(handler)
            handler.close()


def _write_manifest(build_dir: str, manifest: Dict) -> None:
    with open(os.path.join(build_dir, MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, ensure_ascii=False)


class PreparedData:
    """A directory written by :func:`prepare`: its manifest, tokenisers and references."""

    def __init__(self, path: str):
        manifest_path = os.path.join(path, MANIFEST)
        if not os.path.isfile(manifest_path):
            raise InputError(f"{path}: not a prepared data directory (no {MANIFEST}; run `fairseq-plugins prepare`)")
        with open(manifest_path, encoding="utf-8") as f:
            self.manifest = json.load(f)
        if self.manifest.get("version") != MANIFEST_VERSION:
            raise InputError(f"{manifest_path}: manifest version {self.manifest.get('version')}, expected {MANIFEST_VERSION}")
        if self.manifest.get("kind") == "lm":
            raise InputError(f"{path}: language-model data (made by `fairseq-plugins prepare-lm`); this command "
                             "needs a parallel corpus made by `fairseq-plugins prepare RAW OUT -s SRC -t TGT`")
        self.path = path
        self.source_lang = self.manifest["source_lang"]
        self.target_lang = self.manifest["target_lang"]
        self._tokenizers = {}

    @property
    def bin_dir(self) -> str:
        return os.path.join(self.path, "bin")

    def tokenizer(self, lang: str):
        if lang not in self.manifest["tokenizer"]:
            raise InputError(f"{self.path}: no tokenizer for language {lang!r}")
        if lang not in self._tokenizers:
            self._tokenizers[lang] = load_tokenizer(self.manifest["tokenizer"][lang], base_dir=self.path)
        return self._tokenizers[lang]

    def raw_path(self, split: str, lang: str) -> str:
        return os.path.join(self.path, "raw", f"{split}.{lang}")


def binarized_dir(path: str) -> str:
    """The fairseq-preprocess output a ``--data`` flag names: a prepared directory's bin/, or such a directory
    itself (the two cannot be confused: only a prepared directory has a manifest)."""
    if os.path.isfile(os.path.join(path, MANIFEST)) and os.path.isdir(os.path.join(path, "bin")):
        return os.path.join(path, "bin")
    return path


_GENERATE_LINE = re.compile(r"([SH])-(\d+)\t")


def parse_generate_output(lines, where: str = "fairseq-generate output") -> List[str]:
    """Hypotheses (``H-<id>`` lines, first per id) of ``fairseq-generate`` output, in sentence-id order.

    Every sentence must have one: each ``S-<id>`` line, and every id below the largest (ids are the split's
    line numbers), else an error names the missing ids (a truncated run, or sentences dropped or filtered)."""
    hypotheses, ids = {}, set()
    for line in lines:
        match = _GENERATE_LINE.match(line)
        if match:
            ids.add(int(match.group(2)))
            if match.group(1) == "H":
                _head, _score, text = (line.rstrip("\n").rstrip("\r").split("\t", 2) + ["", ""])[:3]
                hypotheses.setdefault(int(match.group(2)), text)
    if not hypotheses:
        raise InputError(f"{where}: no H-<id> lines (not fairseq-generate output, or made with --quiet?)")
    missing = sorted((ids | set(range(max(ids) + 1))) - hypotheses.keys())
    if missing:
        shown = ", ".join(map(str, missing[:20])) + (", ..." if len(missing) > 20 else "")
        raise InputError(f"{where}: {len(missing)} of {max(ids) + 1} sentences have no H- line (ids {shown}): "
                         "a truncated fairseq-generate run, or sentences it skipped or dropped")
    return [hypotheses[i] for i in sorted(hypotheses)]


def _check_not_post_processed(hypotheses: List[str], tokenizer, where: str) -> None:
    """fairseq-generate --post-process/--remove-bpe writes H- lines already detokenised: no word-boundary symbol
    left, which decoding them again would glue into one word. Refuse such output."""
    symbol = getattr(tokenizer, "space_symbol", VISIBLE_SPACE)
    words = [h for h in hypotheses if h.strip()]
    if not words or any(symbol in h for h in words):
        return
    # SentencePiece marks every word's first piece; characters show words only in sentences with a space,
    # so for them the sign is a token of several characters (not an escape like <U+00A0> or <unk>).
    if tokenizer.kind == "char" and not any(len(token) > 1 and not (token.startswith("<") and token.endswith(">"))
                                            for h in words for token in h.split()):
        return
    raise InputError(f"{where}: its H- lines hold no {symbol!r} word-boundary symbol, which the data's "
                     f"{tokenizer.kind} tokens carry: already detokenised by fairseq-generate --post-process or "
                     "--remove-bpe? Run fairseq-generate without them and detok its output")


def detokenize_stream(data: PreparedData, lang: str, lines, from_generate: bool = False, out=sys.stdout,
                      keep_pieces: bool = False, where: str = "fairseq-generate output") -> None:
    tokenizer = data.tokenizer(lang)
    if from_generate:
        lines = parse_generate_output(lines, where)
        _check_not_post_processed(lines, tokenizer, where)
    for line in lines:
        line = line.rstrip("\n").rstrip("\r")
        out.write((line if keep_pieces else tokenizer.decode(line)) + "\n")


def prepare_lm(
    train: str, valid: str, out_dir: str, test: Optional[str] = None, overwrite: bool = False,
    command: Optional[List[str]] = None,
) -> Dict:
    """Character language-model data: each line's characters, then end-of-line as fairseq's EOS.

    Layout: OUT/prepare.json (kind "lm"), OUT/tok/<split>.txt, OUT/bin (fairseq-preprocess --only-source),
    the data directory of ``--task language_modeling``; blank lines stay (one EOS), so a model is scored on
    every character of the text, newlines included.
    """
    _check_output_dir(out_dir, overwrite)
    sources = {"train": train, "valid": valid, **({"test": test} if test else {})}
    char = CharTokenizer()
    texts = {}
    for split, path in sources.items():
        texts[split] = {LM_STREAM: read_lines(path, allow_empty_lines=True)}
        _check_characters(char, texts[split][LM_STREAM], path)

    with _build_aside(out_dir) as build_dir:
        encoded = _tokenize_and_binarize(build_dir, texts, {LM_STREAM: char}, workers=1)
        manifest = {
            "version": MANIFEST_VERSION,
            "kind": "lm",
            "tokenizer": {"text": char.spec()},
            "splits": {split: {"lines": len(lines[LM_STREAM]),
                               "characters": sum(len(line.split()) for line in lines[LM_STREAM]),
                               "from": os.path.abspath(sources[split])} for split, lines in encoded.items()},
            "command": command or [],
        }
        _write_manifest(build_dir, manifest)
    return manifest


# ---- the subcommands: fairseq-plugins prepare, prepare-lm, detok ----

def add_prepare_parser(subparsers):
    p = subparsers.add_parser(
        "prepare",
        help="raw parallel text -> SentencePiece or character tokens -> fairseq-preprocess binaries",
        description="Tokenise a raw parallel corpus (Multi30k layout: train.L, val.L, test_2016_flickr.L) "
        "and binarise it with fairseq-preprocess into OUT/bin. See fairseq_plugins/tools/prepared.py.",
    )
    p.add_argument("raw_dir", help="directory of raw text files <split>.<lang>")
    p.add_argument("out_dir", help="output directory (built aside, renamed into place when complete)")
    p.add_argument("-s", "--source-lang", required=True, help="source language suffix, e.g. en")
    p.add_argument("-t", "--target-lang", required=True, help="target language suffix, e.g. de")
    p.add_argument("--tokenizer", choices=("sentencepiece", "char"), default="sentencepiece",
                   help="subword (SentencePiece) or character tokens (spaces become a visible symbol)")
    p.add_argument("--char", dest="tokenizer", action="store_const", const="char",
                   help="shorthand for --tokenizer char")
    p.add_argument("--vocab-size", type=positive_int, default=8000, help="SentencePiece vocabulary size per model")
    p.add_argument("--separate", dest="joint", action="store_false",
                   help="one SentencePiece model and dictionary per language (default: joint, shared)")
    p.add_argument("--spm-model-type", choices=("unigram", "bpe"), default="unigram",
                   help="SentencePiece model type")
    for split in ("train", "valid", "test"):
        p.add_argument(f"--{split}-name", default=None,
                       help=f"file stem of the {split} split (default: Multi30k names, then '{split}')")
    p.add_argument("--train-limit", type=non_negative_int, default=0,
                   help="use only the first N training pairs (0: all)")
    p.add_argument("--workers", type=positive_int, default=1, help="fairseq-preprocess worker processes")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.set_defaults(run=_run_prepare)


def _run_prepare(args, argv):
    stems = {split: getattr(args, f"{split}_name") for split in ("train", "valid", "test")}
    manifest = prepare(
        args.raw_dir, args.out_dir, args.source_lang, args.target_lang,
        tokenizer=args.tokenizer, vocab_size=args.vocab_size, joint=args.joint,
        spm_model_type=args.spm_model_type, split_stems=stems, train_limit=args.train_limit,
        workers=args.workers, overwrite=args.overwrite, command=["fairseq-plugins"] + argv,
    )
    # The result line: fairseq-preprocess's own figures are INFO logs, shown with -v (and in bin/preprocess.log).
    splits = ", ".join(f"{split} {info['lines']}" for split, info in manifest["splits"].items())
    sizes = ", ".join(f"{lang} {_dictionary_size(os.path.join(args.out_dir, 'bin', f'dict.{lang}.txt'))}"
                      for lang in (args.source_lang, args.target_lang))
    print(f"prepared {args.raw_dir} -> {args.out_dir}: {splits} sentence pairs; dictionary {sizes} types")


def _dictionary_size(path: str) -> int:
    """The size of a fairseq-preprocess dictionary file as a fairseq Dictionary."""
    with open(path, encoding="utf-8") as f:
        return sum(1 for _ in f) + NUM_SPECIAL_SYMBOLS


def add_prepare_lm_parser(subparsers):
    p = subparsers.add_parser(
        "prepare-lm",
        help="raw text -> character tokens -> fairseq-preprocess binaries for --task language_modeling",
        description="One token per character (spaces as a visible symbol), one sample line per text line with "
        "fairseq's EOS standing for the newline. See prepare_lm in fairseq_plugins/tools/prepared.py.",
    )
    p.add_argument("train", help="training text file")
    p.add_argument("valid", help="validation text file")
    p.add_argument("out_dir", help="output directory (built aside, renamed into place when complete)")
    p.add_argument("--test", default=None, help="test text file (optional)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.set_defaults(run=_run_prepare_lm)


def _run_prepare_lm(args, argv):
    manifest = prepare_lm(args.train, args.valid, args.out_dir, test=args.test, overwrite=args.overwrite,
                          command=["fairseq-plugins"] + argv)
    splits = ", ".join(f"{split} {info['lines']} lines ({info['characters']} characters)"
                       for split, info in manifest["splits"].items())
    print(f"prepared character LM data -> {args.out_dir}: {splits}; dictionary "
          f"{_dictionary_size(os.path.join(args.out_dir, 'bin', 'dict.txt'))} symbols")


def add_detok_parser(subparsers):
    p = subparsers.add_parser(
        "detok", help="tokens (or fairseq-generate output) -> text, with a prepared directory's tokenizer",
    )
    p.add_argument("data", help="prepared data directory (has prepare.json)")
    p.add_argument("--lang", default=None, help="language whose tokenizer to use (default: the target)")
    # --inputs: average-checkpoints' spelling, so either works for both
    p.add_argument("--input", "--inputs", dest="input", default="-", help="input file ('-': standard input)")
    p.add_argument("--from-generate", action="store_true",
                   help="input is fairseq-generate output: take its H- lines in sentence order")
    p.add_argument("--keep-pieces", action="store_true",
                   help="write the tokens as they are (e.g. fairseq-generate hypotheses in corpus order, "
                        "for distillation) instead of detokenizing them")
    p.set_defaults(run=_run_detok)


def _run_detok(args, argv):
    data = PreparedData(args.data)
    lang = args.lang or data.target_lang
    # Read (and check) the whole input before writing a line.
    if args.input == "-":
        where, lines = "standard input", list(decode_lines(sys.stdin.buffer, "standard input"))
    else:
        if not os.path.isfile(args.input):
            raise InputError(f"--input {args.input}: no such file")
        with open(args.input, "rb") as f:
            where, lines = args.input, list(decode_lines(f, args.input))
    detokenize_stream(data, lang, lines, args.from_generate, keep_pieces=args.keep_pieces, where=where)
