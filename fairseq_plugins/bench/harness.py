"""``fairseq-plugins bench``: a method's generator against fairseq's stock generator, same model, same run.

Flags this module does not define go to fairseq's own generation parser (``--task``, the task's and the
method's generator flags, ``--lenpen``, ``--max-len-a/b``, ``--fp16`` ...), so a method's decoding
options are given exactly as to ``fairseq-generate``, and an unknown flag is an error naming it.

A generator may keep method-specific figures (``common.generation.GenerationStats``: ``generation_stats() ->
dict``, cumulative, and ``reset_generation_stats()``); the harness resets them after warm-up and stores them under
``stats``.
``step_cost_figures(batches) -> dict`` (batches of the bench's --batch-size): the cost of one of its model calls
against a stock greedy step on the same rows, also stored under ``stats``.
The JSON schema is documented in docs/bench.md.
"""

import argparse
import ast
import copy
import datetime
import logging
import os
import shlex
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from .. import user_dir
from ..common.generation import GenerationStats
from ..common.textio import InputError, atomic_output, check_output_path, read_lines, read_parallel, write_lines
from ..tools.prepared import PreparedData
from . import report
from .ctranslate2_reference import COMPUTE_TYPES
from .measure import (Decoder, Measurement, PeakMemory, RunnableSampler, alternating_runs, load_average, oversubscribed,
                      percentile, runnable_beside, speed_ratio_figures, usable_cores)
from .profile import profile_decoders
from .provenance import model_hashes

logger = logging.getLogger(__name__)

# At batch 1 a figure is latency-bound and a whole test set takes long for both generators: time this many
# sentences unless --limit says otherwise (larger batches decode the whole split by default).
DEFAULT_LIMIT = 200
# Batches (of the bench's --batch-size) on which a generator's step_cost_figures hook times one call against a
# greedy step.
STEP_COST_BATCHES = 10


def bench_methods() -> Dict[str, str]:
    """Method name -> the fairseq task whose ``build_generator`` builds that method's generator."""
    import fairseq_plugins

    return {package.__name__.rsplit(".", 1)[-1]: package.BENCH_TASK for package in fairseq_plugins.METHOD_PACKAGES}


def add_bench_parser(subparsers):
    p = subparsers.add_parser(
        "bench",
        help="measure a method's generator against fairseq's stock generator on the same model",
        description=__doc__.split("\n\n")[0],
        epilog="Other flags go to fairseq's generation parser (e.g. --task, --lenpen, --max-len-b, method flags).",
    )
    p.add_argument("--method", required=True, choices=sorted(bench_methods()), help="method whose generator to measure")
    p.add_argument("--path", required=True, help="model checkpoint (.pt)")
    p.add_argument("--baseline-path", default=None,
                   help="checkpoint the stock generator decodes instead of --path, loaded with the same task "
                        "and dictionaries (e.g. double_token: the single-token L2R system)")
    p.add_argument("--data", required=True, help="prepared data directory (from `fairseq-plugins prepare`)")
    p.add_argument("--split", default="test", help="binarised split to decode (train, valid or test)")
    p.add_argument("--source-file", help="decode this raw source text instead of a split (tokenised as prepared)")
    p.add_argument("--reference-file", help="raw references for --source-file")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where to decode")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--batch-size", type=int, default=1, help="sentences per batch for the throughput runs")
    p.add_argument("--beam", type=int, default=5, help="beam size of the method's generator (1: greedy)")
    p.add_argument("--baseline-beam", type=int, default=None,
                   help="beam size of the stock generator (default: --beam; 1: greedy)")
    p.add_argument("--baseline-no-repeat-ngram-size", type=int, default=None,
                   help="fairseq's --no-repeat-ngram-size for the stock generator (default: the method's); 0 "
                        "compares a method decoding with the rule against the plain stock beam search")
    p.add_argument("--baseline-no-cache", action="store_true",
                   help="the stock generator decodes without incremental state (fairseq's path for a decoder "
                        "without a cache: the whole prefix through the model at every step); the comparison for "
                        "a method whose gain is its cache (ByteNet)")
    p.add_argument("--reference", choices=("ctranslate2",), default=None,
                   help="also decode with CTranslate2 (the stock side's checkpoint converted by its fairseq "
                        "converter, cached beside it), alternating with both generators batch by batch, with the "
                        "same beam, length limit and threads; its figures and speed ratio go under 'ctranslate2'")
    p.add_argument("--reference-compute-type", default=None, choices=COMPUTE_TYPES,
                   help="CTranslate2's compute type for --reference ctranslate2 (default float32: the same model as "
                        "stock fairseq's; int8: its int8 weights and products)")
    p.add_argument("--runs", type=int, default=3,
                   help="timed runs over all sentences; within a run the two generators alternate batch by batch, "
                        "and the speed ratio is the median of the runs' ratios (fewer than 3 is flagged)")
    p.add_argument("--warmup", type=int, default=2, help="batches each generator decodes before timing")
    p.add_argument("--limit", type=int, default=None,
                   help=f"decode only the first N sentences (0: all; default: {DEFAULT_LIMIT} at --batch-size 1, "
                        "all at larger batches)")
    p.add_argument("--whole-split-bleu", action=argparse.BooleanOptionalAction, default=True,
                   help="when --limit times fewer sentences than the split (or --source-file) has, decode the "
                        "others too, once, untimed, at the same batch size, with both generators, and report "
                        "BLEU on all of them as split_bleu (the speed figures stay those of the timed sentences)")
    p.add_argument("--latency-limit", type=int, default=100,
                   help="sentences timed one at a time for latency when --batch-size > 1 (0: none, no latency "
                        "figures)")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="after the timed runs, decode the first N timed sentences once more with each generator "
                        "under torch.profiler and record, per output token, the device's kernel time against the "
                        "gaps between kernels (CUDA) or the time inside aten operators against the rest (CPU) "
                        "as the result's profile (0: no profile)")
    p.add_argument("--label", default=None, help="name of this configuration in tables (default: the method)")
    p.add_argument("--model-note", default=None,
                   help="one line on what the model is (e.g. 'warm-started from the baseline, 3 min'), for tables")
    p.add_argument("--provenance", nargs="*", default=[],
                   help="files listing the commands that produced the checkpoint (one per line)")
    p.add_argument("--json", help="write the result here (JSON)")
    p.add_argument("--append", action="store_true", help="append to the results already in --json")
    p.add_argument("--markdown", help="write a Markdown table of the results in --json (or of this run)")
    p.add_argument("--append-markdown", action="store_true", help="with --markdown: write all results in --json")
    p.add_argument("--plot", help="write a PNG chart of speed against BLEU")
    p.add_argument("--hypotheses", help="write the method's detokenised outputs here, one per line")
    p.set_defaults(run=run_bench)

    r = subparsers.add_parser("report", help="print the summary table of bench JSON files, or write the README's "
                                             "results table and the cross-method plot from them")
    r.add_argument("results", nargs="*",
                   help="bench JSON files or directories of them (default with --readme/--overview-plot: "
                        "docs/results and docs/results/gpu)")
    r.add_argument("--markdown", action="store_true", help="full Markdown table instead of the summary")
    r.add_argument("--profile", action="store_true",
                   help="the table of where a token's time goes (the results of bench --profile) instead")
    r.add_argument("--readme", metavar="README", help="rewrite the block between the results markers of this file "
                                                      "with every method's best measured setting")
    r.add_argument("--check", action="store_true",
                   help="with --readme: change nothing, exit 1 if a generated block (the README's, a method page's "
                        "under docs/) is out of date")
    r.add_argument("--models", metavar="JSON",
                   help="the pinned model set (default: models.json in the results directory, docs/results)")
    r.add_argument("--check-models", action="store_true",
                   help="hash every pinned model present on this machine; exit 1 naming each whose file differs")
    r.add_argument("--require-all-models", action="store_true",
                   help="with --check-models: also fail where a pinned model is missing or its hash unrecorded "
                        "(what `make results` checks before it measures)")
    r.add_argument("--require-models", metavar="NAMES",
                   help="with --check-models: the same for these pinned models alone (comma-separated: what the "
                        "rows `make results ROWS=...` re-measures need)")
    r.add_argument("--pin", metavar="NAME",
                   help="record the checkpoint now under pinned model NAME's path in models.json: its sha256 and "
                        "weights_sha256 in an entry never trained or measured; a retrained copy of the pinned weights "
                        "in its 'retrained' list; else another model, pinned as NAME while the entry so far stays "
                        "as NAME-<its date>, superseded by it")
    r.add_argument("--pin-log", metavar="LOG",
                   help="with --pin: the fairseq-train log whose validation losses become the model's curve")
    r.add_argument("--overview-plot", metavar="PNG",
                   help="write the cross-method plot (ΔBLEU against speed ratio, every setting)")
    r.set_defaults(run=run_report)


def run_report(args, argv):
    if args.pin_log and not args.pin:
        raise InputError("--pin-log goes with --pin")
    if args.pin:
        from .pinned import MODELS_FILE, pin_model

        print(pin_model(args.models or MODELS_FILE, os.getcwd(), args.pin, args.pin_log))
        return
    if args.check_models:
        from .pinned import MODELS_FILE, run_check_models

        status = run_check_models(args.models or MODELS_FILE, os.getcwd(), args.require_all_models,
                                  [name for name in (args.require_models or "").split(",") if name])
        if status:
            raise SystemExit(status)
        return
    if args.check and not args.readme:
        raise InputError("--check goes with --readme")
    if args.readme or args.overview_plot:
        from .overview import DEFAULT_RESULTS, run_overview

        status = run_overview(args.results or [p for p in DEFAULT_RESULTS if os.path.isdir(p)], args.readme,
                              args.check, args.overview_plot, args.models)
        if status:
            raise SystemExit(status)
        return
    if not args.results:
        raise InputError("report: give bench JSON files (or --readme / --overview-plot)")
    results = [result for path in args.results for result in report.load_results(path)]
    if args.profile:
        print(report.profile_table(results), end="")
        return
    print(report.markdown_table(results) if args.markdown else report.summary_table(results), end="")


def _check_bench_args(args) -> None:
    for flag in ("batch_size", "beam", "runs"):
        if getattr(args, flag) < 1:
            raise InputError(f"--{flag.replace('_', '-')} must be at least 1, got {getattr(args, flag)}")
    for flag in ("threads", "warmup", "limit", "latency_limit", "profile"):
        if (getattr(args, flag) or 0) < 0:
            raise InputError(f"--{flag.replace('_', '-')} must not be negative, got {getattr(args, flag)}")
    if args.baseline_beam is not None and args.baseline_beam < 1:
        raise InputError(f"--baseline-beam must be at least 1, got {args.baseline_beam}")
    if args.baseline_no_repeat_ngram_size is not None and args.baseline_no_repeat_ngram_size < 0:
        raise InputError("--baseline-no-repeat-ngram-size must be at least 0, got "
                         f"{args.baseline_no_repeat_ngram_size}")
    for flag, path in (("--path", args.path), ("--baseline-path", args.baseline_path)):
        if path is not None and not os.path.isfile(path):
            raise InputError(f"{flag} {path}: no such checkpoint")
    if (args.source_file is None) != (args.reference_file is None):
        raise InputError("--source-file and --reference-file go together")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA device is available")
    if args.reference == "ctranslate2":  # before any model is loaded: the package, then the model's kind
        from .ctranslate2_reference import check_convertible, require_ctranslate2

        require_ctranslate2()
        check_convertible(args.baseline_path or args.path, "--baseline-path" if args.baseline_path else "--path")
    elif args.reference_compute_type is not None:
        raise InputError("--reference-compute-type goes with --reference ctranslate2")
    if args.append_markdown and not args.json:
        raise InputError("--append-markdown needs --json (the results to tabulate)")
    for flag in ("json", "markdown", "plot", "hypotheses"):  # writable now, not after the decoding
        if getattr(args, flag):
            check_output_path(getattr(args, flag), f"--{flag}")


def _parse_fairseq_args(args, data: PreparedData):
    """Build fairseq's generation config from our flags plus every flag we do not know."""
    from fairseq import options
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    parser = options.get_generation_parser(default_task=bench_methods()[args.method])

    def error(message):
        raise InputError(f"bench: {message} (flags bench does not know go to fairseq's generation parser)")

    parser.error = error
    fairseq_argv = [
        data.bin_dir, "--user-dir", user_dir(), "--path", args.path,
        "--beam", str(args.beam), "--batch-size", str(args.batch_size), "--gen-subset", args.split,
        "--source-lang", data.source_lang, "--target-lang", data.target_lang,
    ]
    if args.device == "cpu":
        fairseq_argv.append("--cpu")
    return convert_namespace_to_omegaconf(options.parse_args_and_arch(parser, fairseq_argv + args.rest))


def _load_models(cfg, path: str, task, device: torch.device, half: Optional[bool] = None):
    from fairseq import checkpoint_utils

    models, saved_cfg = checkpoint_utils.load_model_ensemble(
        [path], arg_overrides=ast.literal_eval(cfg.common_eval.model_overrides), task=task,
    )
    return _ready_for_inference(models, cfg, device, half), saved_cfg


def _ready_for_inference(models, cfg, device: torch.device, half: Optional[bool] = None):
    """The models on ``device`` in evaluation mode; in float16 with --fp16 (``half`` overrides the flag)."""
    for model in models:
        if cfg.common.fp16 if half is None else half:
            model.half()
        model.to(device).eval()
        model.prepare_for_inference_(cfg)
    return models


def _load_baseline(cfg, path: str, task, device: torch.device):
    """The --baseline-path model with the task it was trained with (on this data): a method whose task changes
    the dictionaries (double-token adds EOD) can be compared with the plain transformer it started from, as
    long as its dictionaries only append symbols to the baseline's (the shared ids then mean the same)."""
    from fairseq import checkpoint_utils

    overrides = {**ast.literal_eval(cfg.common_eval.model_overrides), "data": cfg.task.data}
    models, _saved_cfg, stock_task = checkpoint_utils.load_model_ensemble_and_task([path], arg_overrides=overrides)
    for ours, theirs, side in ((task.source_dictionary, stock_task.source_dictionary, "source"),
                               (task.target_dictionary, stock_task.target_dictionary, "target")):
        if ours.symbols[:len(theirs)] != theirs.symbols:
            raise InputError(f"--baseline-path {path}: its {side} dictionary is not the one of --path's task "
                             "(a model trained on other data?)")
    return stock_task, _ready_for_inference(models, cfg, device)


def _load(cfg, args, data: PreparedData, device: torch.device):
    """Task, models (on ``device``, ready for inference), dataset and raw references."""
    from fairseq import tasks

    task = tasks.setup_task(cfg.task)
    models, saved_cfg = _load_models(cfg, args.path, task, device)

    if args.source_file:
        sources, references = read_parallel(args.source_file, args.reference_file)
        tokenizer = data.tokenizer(data.source_lang)
        tokens = [
            task.source_dictionary.encode_line(tokenizer.encode(line), add_if_not_exist=False).long()
            for line in sources
        ]
        dataset = task.build_dataset_for_inference(tokens, [t.numel() for t in tokens])
    else:
        if args.split not in data.manifest["splits"]:
            raise InputError(f"--split {args.split}: {data.path} has splits {', '.join(data.manifest['splits'])}")
        task.load_dataset(args.split, task_cfg=saved_cfg.task)
        dataset = task.dataset(args.split)
        references = read_lines(data.raw_path(args.split, data.target_lang), allow_empty_lines=True)
        if len(references) != len(dataset):
            raise InputError(
                f"{data.raw_path(args.split, data.target_lang)} has {len(references)} lines but the binarised "
                f"{args.split} split has {len(dataset)} sentences"
            )
    return task, models, dataset, references


def _batches(dataset, ids: List[int], batch_size: int, device: torch.device) -> List[Dict]:
    """Collated batches, on ``device`` before any timing; batches of similar source length, as fairseq does."""
    from fairseq import utils

    if batch_size > 1:
        ids = sorted(ids, key=lambda i: (dataset.num_tokens(i), i))
    batches = []
    for start in range(0, len(ids), batch_size):
        batch = dataset.collater([dataset[i] for i in ids[start:start + batch_size]])
        batches.append(utils.move_to_cuda(batch, device) if device.type == "cuda" else batch)
    return batches


def _decoder(generate, name: str):
    """Wrap a generate call into batch -> {sentence id: best hypothesis tokens}.

    A generator that does not give every sentence of the batch a hypothesis is an error naming it and the
    sentences: the two generators' outputs are compared sentence by sentence (else an IndexError, or a
    comparison that silently skips sentences)."""

    def decode(batch):
        with torch.no_grad():
            hypos = generate(batch)
        ids = [int(sid) for sid in batch["id"]]
        without = [sid for sid, nbest in zip(ids, hypos) if not nbest] + ids[len(hypos):]
        if len(hypos) != len(ids) or without:
            shown = ", ".join(map(str, without[:20])) + (", ..." if len(without) > 20 else "")
            raise InputError(f"bench: {name} returned {len(hypos)} hypothesis lists for a batch of "
                             f"{len(ids)} sentences" + (f"; none for sentence ids {shown}" if without else "")
                             + ": its outputs cannot be compared with the other generator's sentence by sentence")
        return {sid: nbest[0]["tokens"].tolist() for sid, nbest in zip(ids, hypos)}

    return decode


def _generator_description(generator, beam: int, no_repeat_ngram_size: int, cfg, task_flags: Dict) -> Dict:
    description = "greedy" if beam == 1 else f"beam {beam}"
    if not getattr(getattr(generator, "model", None), "has_incremental", True):
        description += ", no cache"
    if no_repeat_ngram_size:
        description += f", no repeated {no_repeat_ngram_size}-grams"
    return {
        "class": f"{type(generator).__module__}.{type(generator).__name__}",
        "description": description,
        "beam": beam,
        "no_repeat_ngram_size": no_repeat_ngram_size,
        "lenpen": cfg.generation.lenpen,
        "max_len_a": cfg.generation.max_len_a,
        "max_len_b": cfg.generation.max_len_b,
        "min_len": cfg.generation.min_len,
        "task": cfg.task._name,
        **({"task_flags": task_flags} if task_flags else {}),
    }


def _method_task_flags(cfg) -> Dict:
    """The task's options beyond stock translation's: where a method keeps its generator flags."""
    from dataclasses import fields

    from fairseq.tasks.translation import TranslationConfig

    stock = {f.name for f in fields(TranslationConfig)}
    return {key: cfg.task[key] for key in cfg.task if key not in stock and key != "_name"}


def bleu_figures(texts: List[str], references: List[str]) -> Dict:
    """sacrebleu's corpus BLEU with what explains it: brevity penalty, n-gram precisions, lengths."""
    import sacrebleu

    bleu = sacrebleu.metrics.BLEU()
    score = bleu.corpus_score(texts, [references])
    return {
        "bleu": round(score.score, 2),
        "bleu_signature": str(bleu.get_signature()),
        "bleu_brevity_penalty": round(score.bp, 4),
        "bleu_precisions": [round(p, 2) for p in score.precisions],
        "hypothesis_length": score.sys_len,  # sacrebleu's 13a tokens, the unit of the brevity penalty
        "reference_length": score.ref_len,
        "length_ratio": round(score.sys_len / score.ref_len, 4) if score.ref_len else None,
    }


def _detokenized(hypotheses: Dict[int, List[int]], ids: List[int], tgt_dict, tokenizer) -> List[str]:
    eos = tgt_dict.eos()
    return [tokenizer.decode(tgt_dict.string(hypotheses[i], extra_symbols_to_ignore={eos})) for i in ids]


def _figures(measurement: Measurement, latencies: List[float], ids: List[int], tgt_dict, tokenizer,
             references: List[str], generator_info: Dict) -> Tuple[Dict, List[str]]:
    """One generator's figures, and its detokenised outputs."""
    eos = tgt_dict.eos()
    hypotheses = measurement.hypotheses
    texts = _detokenized(hypotheses, ids, tgt_dict, tokenizer)
    target_tokens = sum(len(hypotheses[i]) - (hypotheses[i][-1:] == [eos]) for i in ids)
    target_words = sum(len(text.split()) for text in texts)  # detokenised, as the papers count words
    seconds = measurement.median_run_seconds
    return {
        "generator": generator_info,
        **bleu_figures(texts, [references[i] for i in ids]),
        "sentences_per_s": len(ids) / seconds,
        "tokens_per_s": target_tokens / seconds,
        "words_per_s": target_words / seconds,
        "latency_ms_p50": 1000 * percentile(latencies, 50) if latencies else None,
        "latency_ms_p90": 1000 * percentile(latencies, 90) if latencies else None,
        "peak_memory_mb": measurement.peak_memory_mb,
        "sentences": len(ids),
        "target_tokens": target_tokens,
        "target_words": target_words,
        "run_seconds": measurement.run_seconds,
    }, texts


@dataclass
class Generators:
    """The two generators a bench compares, each wrapped as batch -> {sentence id: best hypothesis}."""

    method: object
    stock: object
    stock_beam: int
    stock_no_repeat_ngram_size: int
    decoders: Dict[str, Decoder]
    reference: Optional[Dict] = None  # --reference ctranslate2: its decoder and how its model was converted


def _ctranslate2_reference(args, stock_cfg, stock_task, stock_models, data: PreparedData,
                           device: torch.device) -> Dict:
    """CTranslate2 on the stock side's checkpoint, with the stock generator's beam and rules (converted before
    any timing; the conversion's seconds are reported, not timed)."""
    from .ctranslate2_reference import CTranslate2Decoder, converted_model, max_decoder_positions

    checkpoint = args.baseline_path or args.path
    conversion = converted_model(checkpoint, data.bin_dir, data.source_lang, data.target_lang, user_dir())
    decoder = CTranslate2Decoder(
        conversion["dir"], args.reference_compute_type or "float32",
        torch.get_num_threads() if device.type == "cpu" else 1, device, stock_task.source_dictionary,
        stock_task.target_dictionary, stock_cfg, stock_cfg.beam, max_decoder_positions(stock_models))
    return {"decoder": decoder, "checkpoint": os.path.abspath(checkpoint), **conversion}


def _build_generators(args, cfg, task, models, data: PreparedData, device: torch.device) -> Generators:
    """The method's generator (its task's ``build_generator``, from the fairseq-generate flags) and fairseq's
    stock SequenceGenerator (the base task's ``build_generator``) on the same model, or on --baseline-path."""
    from fairseq.tasks import FairseqTask

    method_generator = task.build_generator(models, cfg.generation)
    stock_cfg = copy.deepcopy(cfg.generation)
    stock_cfg.beam = args.baseline_beam or args.beam
    if args.baseline_no_repeat_ngram_size is not None:
        stock_cfg.no_repeat_ngram_size = args.baseline_no_repeat_ngram_size
    stock_task, stock_models = task, models
    if args.baseline_path:
        stock_task, stock_models = _load_baseline(cfg, args.baseline_path, task, device)
    stock_generator = FairseqTask.build_generator(stock_task, stock_models, stock_cfg)
    if args.baseline_no_cache:
        stock_generator.model.has_incremental = False  # SequenceGenerator then feeds the whole prefix each step
    decoders = {  # the order the first batch of the first run is decoded in; alternated from there
        "method": _decoder(lambda batch: task.inference_step(method_generator, models, batch),
                           f"the {args.method} generator ({type(method_generator).__name__})"),
        "stock": _decoder(lambda batch: stock_generator.generate(stock_models, batch),
                          f"the stock generator ({type(stock_generator).__name__})"),
    }
    reference = None
    if args.reference == "ctranslate2":
        reference = _ctranslate2_reference(args, stock_cfg, stock_task, stock_models, data, device)
        decoders["ctranslate2"] = reference["decoder"]
    return Generators(
        method=method_generator,
        stock=stock_generator,
        stock_beam=stock_cfg.beam,
        stock_no_repeat_ngram_size=stock_cfg.no_repeat_ngram_size,
        decoders=decoders,
        reference=reference,
    )


def sentence_ids(dataset_size: int, limit: Optional[int], batch_size: int) -> List[int]:
    """The sentences timed: the first --limit (default: DEFAULT_LIMIT at batch 1, all at larger batches)."""
    if limit is None:
        limit = DEFAULT_LIMIT if batch_size == 1 else 0
    return list(range(dataset_size if not limit else min(limit, dataset_size)))


@dataclass
class Timings:
    measurements: Dict[str, Measurement]
    latencies: Dict[str, List[float]]  # seconds per sentence at batch 1
    timing: Dict  # how the timing ran: runs, threads, load, oversubscription
    method_stats: Dict  # the method generator's own figures over the timed runs (not the batch-1 latency pass)


def _time(args, generators: Generators, dataset, ids: List[int], device: torch.device, load_before) -> Timings:
    """Warm up, then the timed runs (generators alternating batch by batch), then batch-1 latency."""
    from tqdm import tqdm

    decoders = generators.decoders
    batches = _batches(dataset, ids, args.batch_size, device)
    logger.info("bench %s: %d sentences in %d batches of up to %d on %s, %d runs", args.method, len(ids),
                len(batches), args.batch_size, device, args.runs)
    for decode in decoders.values():  # warm-up, not timed
        for batch in batches[: args.warmup]:
            decode(batch)
    keeps_stats = isinstance(generators.method, GenerationStats)
    if keeps_stats:
        generators.method.reset_generation_stats()

    memory = PeakMemory(device)
    beside = RunnableSampler()  # what else wanted a core while each batch was timed
    bar = lambda items, run: beside.each(tqdm(items, desc=f"run {run + 1}/{args.runs}", leave=False))  # noqa: E731
    measurements = alternating_runs(decoders, batches, device, args.runs, memory, progress=bar)
    for run in range(args.runs):
        logger.info("run %d: %s", run + 1, ", ".join(f"{name} {measurement.run_seconds[run]:.2f} s"
                                                      for name, measurement in measurements.items()))

    method_stats = dict(generators.method.generation_stats()) if keeps_stats else {}
    if args.batch_size == 1:
        latencies = {name: m.batch_seconds for name, m in measurements.items()}
    elif args.latency_limit == 0:
        latencies = {name: [] for name in measurements}
    else:  # latency is always at batch 1
        single = _batches(dataset, ids[: args.latency_limit], 1, device)
        latency_runs = alternating_runs(decoders, single, device, 1, memory)
        latencies = {name: m.batch_seconds for name, m in latency_runs.items()}

    threads = torch.get_num_threads() if device.type == "cpu" else None
    cores = usable_cores()
    timing = {
        "alternation": "per batch",
        "runs": args.runs,
        "warmup_batches": args.warmup,
        "sentences_timed": len(ids),
        "latency_sentences": len(latencies["method"]),
        "threads": threads,
        "cores": cores,
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "oversubscribed": device.type == "cpu" and oversubscribed(threads, load_before, cores),
    }
    if device.type == "cpu":
        sampled = beside.figures(cores)
        if sampled["oversubscribed"] is not None:  # sampled during the runs: better than the lagging load average
            timing.update(sampled)
    return Timings(measurements, latencies, timing, method_stats)


def _warn_if_busy(threads: int, load_before: Optional[float]) -> None:
    """Warn before any work when this run's threads and what runs beside it exceed the cores. Judged on the
    threads runnable now (the 1-minute load average still counts a training stopped seconds ago); the load
    average only where the platform does not say. The runs themselves are judged on samples taken during them."""
    cores = usable_cores()
    beside = runnable_beside()
    if beside is not None:
        if oversubscribed(threads, beside, cores):
            logger.warning("bench: %d thread(s) + %g other runnable thread(s) exceed the %d usable cores: timings "
                           "will be noisy (sampled again during the runs: timing.oversubscribed)",
                           threads, beside, cores)
    elif oversubscribed(threads, load_before, cores):
        logger.warning("bench: %d thread(s) + a load average of %.2f exceed the %d usable cores: timings will be "
                       "noisy (recorded as timing.oversubscribed)", threads, load_before, cores)


def run_bench(args, argv):
    _check_bench_args(args)
    load_before = load_average()  # before this process adds its own load
    # Read what we will add to before decoding, so a bad file fails at once.
    provenance = report.read_provenance(args.provenance)
    previous = report.load_results(args.json) if args.append and args.json and os.path.exists(args.json) else []
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cpu":
        _warn_if_busy(torch.get_num_threads(), load_before)

    data = PreparedData(args.data)
    prepare_argv = data.manifest.get("command")
    if prepare_argv and all(shlex.split(command) != prepare_argv for command in provenance):
        provenance = [shlex.join(prepare_argv)] + provenance  # how the data was made, unless recorded already
    cfg = _parse_fairseq_args(args, data)
    task, models, dataset, references = _load(cfg, args, data, device)
    generators = _build_generators(args, cfg, task, models, data, device)

    ids = sentence_ids(len(dataset), args.limit, args.batch_size)
    timings = _time(args, generators, dataset, ids, device, load_before)

    tokenizer = data.tokenizer(data.target_lang)
    method, method_texts = _figures(
        timings.measurements["method"], timings.latencies["method"], ids, task.target_dictionary, tokenizer,
        references, _generator_description(generators.method, args.beam, cfg.generation.no_repeat_ngram_size, cfg,
                                           _method_task_flags(cfg)),
    )
    stock, _ = _figures(
        timings.measurements["stock"], timings.latencies["stock"], ids, task.target_dictionary, tokenizer,
        references, _generator_description(generators.stock, generators.stock_beam,
                                           generators.stock_no_repeat_ngram_size, cfg, {}),
    )
    stats = timings.method_stats
    if hasattr(generators.method, "step_cost_figures"):  # the model work of one call against a greedy step
        stats.update(generators.method.step_cost_figures(
            _batches(dataset, ids[:STEP_COST_BATCHES * args.batch_size], args.batch_size, device)))
    method_outputs, stock_outputs = (timings.measurements[n].hypotheses for n in ("method", "stock"))
    stats["outputs_identical_to_baseline"] = outputs_agreement(method_outputs, stock_outputs, ids)
    if cfg.common.fp16:  # that the row decoded in float16, and what it cost against float32
        stats["outputs_identical_to_float32"] = outputs_agreement(
            method_outputs, _float32_outputs(args, cfg, task, dataset, ids, device), ids)

    result = _result(args, argv, device, method, stock, stats, timings, provenance,
                     _hashes(args, data, _method_task_flags(cfg)), model_dtype(models))
    if generators.reference:
        result["ctranslate2"] = _ctranslate2_figures(generators.reference, timings, ids, task.target_dictionary,
                                                     tokenizer, references, method)
    if args.profile:  # after everything timed: the profiler slows what it records
        result["profile"] = profile_decoders(generators.decoders,
                                             _batches(dataset, ids[: args.profile], args.batch_size, device), device)
    if args.whole_split_bleu and len(ids) < len(dataset):
        result["split_bleu"] = _whole_split_bleu(args, generators, dataset, ids, timings, device,
                                                 task.target_dictionary, tokenizer, references)
    _write_outputs(args, previous + [result], method_texts)
    print(report.markdown_table([result]), end="")
    if result["speed_ratio_flagged"]:
        logger.warning("bench: %s", "; ".join(report.flag_reasons(result)))
    return result


def outputs_agreement(outputs: Dict[int, List[int]], reference: Dict[int, List[int]], ids: List[int]) -> float:
    """The share of sentences ``ids`` whose output (best hypothesis' tokens) is the reference's, token for token."""
    return sum(outputs[i] == reference[i] for i in ids) / len(ids)


def _float32_outputs(args, cfg, task, dataset, ids: List[int], device: torch.device) -> Dict[int, List[int]]:
    """With --fp16: the method's outputs from a float32 copy of its checkpoint (untimed, the same batches), to
    compare the float16 outputs with."""
    models, _ = _load_models(cfg, args.path, task, device, half=False)
    generator = task.build_generator(models, cfg.generation)
    decode = _decoder(lambda batch: task.inference_step(generator, models, batch),
                      f"the {args.method} generator in float32 ({type(generator).__name__})")
    outputs = {}
    for batch in _batches(dataset, ids, args.batch_size, device):
        outputs.update(decode(batch))
    return outputs


def model_dtype(models) -> str:
    """The dtype the models' parameters hold (what a --fp16 row really decoded in), e.g. "float16"."""
    dtypes = sorted({str(p.dtype).replace("torch.", "") for model in models for p in model.parameters()})
    return "/".join(dtypes)


def _ctranslate2_figures(reference: Dict, timings: Timings, ids: List[int], tgt_dict, tokenizer,
                         references: List[str], method: Dict) -> Dict:
    """CTranslate2's figures beside the stock generator's, with the speed ratio CTranslate2 time / method time
    (same sentences, same runs) and how many of its outputs are stock fairseq's, token for token."""
    decoder = reference["decoder"]
    figures, _ = _figures(timings.measurements["ctranslate2"], timings.latencies["ctranslate2"], ids, tgt_dict,
                          tokenizer, references, decoder.description())
    outputs, stock_outputs = (timings.measurements[n].hypotheses for n in ("ctranslate2", "stock"))
    return {
        **figures,
        "version": decoder.version,
        "compute_type": decoder.compute_type,
        "checkpoint": reference["checkpoint"],
        "model_dir": reference["dir"],
        "conversion_seconds": reference["conversion_seconds"],  # None: converted by an earlier run
        "outputs_identical_to_stock": outputs_agreement(outputs, stock_outputs, ids),
        **speed_ratio_figures(figures["run_seconds"], method["run_seconds"]),
        "speed_ratio_definition": "CTranslate2 time / method time on the same input sentences, median over the "
                                  "same runs (the method is faster above 1)",
        "bleu_delta": round(method["bleu"] - figures["bleu"], 2),  # the method's BLEU minus CTranslate2's
    }


def _whole_split_bleu(args, generators: Generators, dataset, timed_ids: List[int], timings: Timings,
                      device: torch.device, tgt_dict, tokenizer, references: List[str]) -> Dict:
    """BLEU of both generators on every sentence of the split: the timed sentences' outputs as timed, the
    others decoded once, untimed, at the same batch size (the headline BLEU is the whole split's)."""
    from tqdm import tqdm

    timed = set(timed_ids)
    untimed = _batches(dataset, [i for i in range(len(dataset)) if i not in timed], args.batch_size, device)
    every = list(range(len(dataset)))
    figures = {}
    for name, decode in generators.decoders.items():
        hypotheses = dict(timings.measurements[name].hypotheses)
        for batch in tqdm(untimed, desc=f"{name}: untimed sentences, for BLEU", leave=False):
            hypotheses.update(decode(batch))
        figures[name] = bleu_figures(_detokenized(hypotheses, every, tgt_dict, tokenizer),
                                      [references[i] for i in every])
    logger.info("bench: BLEU on all %d sentences: %.2f (stock %.2f)", len(every), figures["method"]["bleu"],
                figures["stock"]["bleu"])
    whole = {"sentences": len(every), "method": figures["method"], "stock": figures["stock"],
             "bleu_delta": round(figures["method"]["bleu"] - figures["stock"]["bleu"], 2)}
    if "ctranslate2" in figures:
        whole["ctranslate2"] = figures["ctranslate2"]
        whole["ctranslate2_bleu_delta"] = round(figures["method"]["bleu"] - figures["ctranslate2"]["bleu"], 2)
    return whole


def _hashes(args, data: PreparedData, task_flags: Dict) -> Dict:
    """Content hashes of the checkpoints, the files the task flags name and the decoded data (docs/bench.md)."""
    if args.source_file:
        decoded = [args.source_file, args.reference_file]
    else:
        pair = f"{data.source_lang}-{data.target_lang}"
        decoded = [data.raw_path(args.split, data.source_lang), data.raw_path(args.split, data.target_lang)] + [
            os.path.join(data.bin_dir, f"{args.split}.{pair}.{lang}.bin") for lang in (data.source_lang,
                                                                                       data.target_lang)]
    decoded += [os.path.join(data.bin_dir, f"dict.{lang}.txt") for lang in (data.source_lang, data.target_lang)]
    return model_hashes(args.path, args.baseline_path or args.path, task_flags, decoded)


def _result(args, argv, device, method: Dict, stock: Dict, stats: Dict, timings: Timings,
            provenance: List[str], hashes: Dict, dtype: str) -> Dict:
    """One bench result (the JSON schema of docs/bench.md)."""
    return {
        "method": args.method,
        **({"label": args.label} if args.label else {}),
        **({"model_note": args.model_note} if args.model_note else {}),
        "device": report.device_name(device),
        "device_type": device.type,
        "threads": timings.timing["threads"],
        "batch_size": args.batch_size,
        "beam": args.beam,
        "model_dtype": dtype,  # the method's model as decoded (float16 with --fp16)
        **method,
        "stats": stats,
        "baseline": stock,
        **speed_ratio_figures(stock["run_seconds"], method["run_seconds"]),
        "ratios": {  # secondary columns: method / stock (tokens/s rewards longer outputs)
            key: (method[key] / stock[key]) if stock.get(key) else None
            for key in ("sentences_per_s", "tokens_per_s", "words_per_s", "latency_ms_p50", "latency_ms_p90",
                        "peak_memory_mb")
        },
        "bleu_delta": round(method["bleu"] - stock["bleu"], 2),
        "timing": timings.timing,
        "peak_memory_note": None if device.type == "cuda" else "process peak RSS during each batch",
        "data": {"dir": os.path.abspath(args.data), "split": None if args.source_file else args.split,
                 "source_file": args.source_file, "reference_file": args.reference_file},
        "checkpoint": os.path.abspath(args.path),
        "baseline_checkpoint": os.path.abspath(args.baseline_path or args.path),
        "hashes": hashes,
        "runs": args.runs,
        "warmup_batches": args.warmup,
        "commands": provenance + [report.command_line(argv)],
        "git_commit": report.git_commit(),
        "versions": report.versions(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _write_outputs(args, results: List[Dict], method_texts: List[str]) -> None:
    """Write the results (earlier ones first, this run's last) and this run's outputs."""
    if args.json:
        report.save_results(args.json, results)
    if args.markdown:
        with atomic_output(args.markdown) as f:
            f.write(report.markdown_table(results if args.append_markdown else results[-1:]))
    if args.plot:
        report.plot_speed_against_bleu(results, args.plot)
    if args.hypotheses:
        write_lines(args.hypotheses, method_texts)
