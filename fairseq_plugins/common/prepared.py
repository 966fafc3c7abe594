"""Prepared data directories: raw parallel text -> tokens -> fairseq binaries, and the way back.

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
import shutil
import sys
import tempfile
from typing import Dict, Iterator, List, Optional

from .textio import InputError, give_default_mode, read_lines, read_parallel, write_lines
from .tokenization import CharTokenizer, SentencePieceTokenizer, load_tokenizer, train_sentencepiece

logger = logging.getLogger(__name__)

MANIFEST = "prepare.json"
MANIFEST_VERSION = 1
FAIRSEQ_SPLITS = ("train", "valid", "test")
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
    if os.path.exists(out_dir) and os.listdir(out_dir) and not overwrite:
        raise InputError(f"{out_dir}: output directory exists and is not empty (pass --overwrite to replace it)")


@contextlib.contextmanager
def _build_aside(out_dir: str) -> Iterator[str]:
    """A hidden directory beside ``out_dir``, renamed into its place only if the block succeeds."""
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    build_dir = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(os.path.abspath(out_dir))}.")
    try:
        yield build_dir
        give_default_mode(build_dir)
        if os.path.exists(out_dir):
            shutil.rmtree(out_dir)
        os.replace(build_dir, out_dir)
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
                    path = f"{prefixes[split]}.{lang}"
                    for number, line in enumerate(texts[split][lang], start=1):
                        char.check(line, f"{path}:{number}")
            tokenizers = {lang: char for lang in langs}
            specs = {lang: char.spec() for lang in langs}
        elif tokenizer == "sentencepiece":
            tokenizers, specs = _train_sentencepiece_models(build_dir, langs, joint, vocab_size, spm_model_type)
        else:
            raise InputError(f"--tokenizer {tokenizer!r}: expected 'sentencepiece' or 'char'")

        for split in FAIRSEQ_SPLITS:
            for lang in langs:
                encoded = [tokenizers[lang].encode(line) for line in texts[split][lang]]
                write_lines(os.path.join(build_dir, "tok", f"{split}.{lang}"), encoded)

        joined_dictionary = joint or tokenizer == "char"
        _binarize(build_dir, source_lang, target_lang, joined_dictionary, workers)

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
        with open(os.path.join(build_dir, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2, ensure_ascii=False)
    logger.info("prepared %s -> %s", raw_dir, out_dir)
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


def _binarize(build_dir, source_lang, target_lang, joined_dictionary, workers):
    from fairseq import options
    from fairseq_cli import preprocess

    tok = os.path.join(build_dir, "tok")
    argv = [
        "--source-lang", source_lang, "--target-lang", target_lang,
        "--trainpref", os.path.join(tok, "train"),
        "--validpref", os.path.join(tok, "valid"),
        "--testpref", os.path.join(tok, "test"),
        "--destdir", os.path.join(build_dir, "bin"),
        "--workers", str(workers),
    ]
    if joined_dictionary:
        argv.append("--joined-dictionary")
    args = options.get_preprocessing_parser().parse_args(argv)
    preprocess.main(args)


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


def parse_generate_output(lines) -> List[str]:
    """Hypotheses (``H-<id>`` lines, first per id) of ``fairseq-generate`` output, in sentence-id order."""
    hypotheses = {}
    for line in lines:
        if line.startswith("H-"):
            head, _score, text = (line.rstrip("\n").split("\t", 2) + ["", ""])[:3]
            hypotheses.setdefault(int(head[2:]), text)
    return [hypotheses[i] for i in sorted(hypotheses)]


def detokenize_stream(data: PreparedData, lang: str, lines, from_generate: bool = False, out=sys.stdout,
                      keep_pieces: bool = False) -> None:
    tokenizer = data.tokenizer(lang)
    if from_generate:
        lines = parse_generate_output(lines)
    for line in lines:
        line = line.rstrip("\n")
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
    encoded = {}
    for split, path in sources.items():
        lines = read_lines(path, allow_empty_lines=True)
        for number, line in enumerate(lines, start=1):
            char.check(line, f"{path}:{number}")
        encoded[split] = [char.encode(line) for line in lines]

    with _build_aside(out_dir) as build_dir:
        from fairseq import options
        from fairseq_cli import preprocess

        tok = os.path.join(build_dir, "tok")
        for split, lines in encoded.items():
            write_lines(os.path.join(tok, f"{split}.txt"), lines)
        argv = ["--only-source", "--trainpref", os.path.join(tok, "train.txt"),
                "--validpref", os.path.join(tok, "valid.txt"), "--destdir", os.path.join(build_dir, "bin")]
        if test:
            argv += ["--testpref", os.path.join(tok, "test.txt")]
        preprocess.main(options.get_preprocessing_parser().parse_args(argv))
        manifest = {
            "version": MANIFEST_VERSION,
            "kind": "lm",
            "tokenizer": {"text": char.spec()},
            "splits": {split: {"lines": len(lines), "characters": sum(len(l.split()) for l in lines),
                               "from": os.path.abspath(sources[split])} for split, lines in encoded.items()},
            "command": command or [],
        }
        with open(os.path.join(build_dir, MANIFEST), "w", encoding="utf-8") as f:
            json.dump(manifest, f, indent=2, ensure_ascii=False)
    logger.info("prepared character LM data %s -> %s", ", ".join(sources.values()), out_dir)
    return manifest
