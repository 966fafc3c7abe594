"""Where a fast-step token's time goes, beside CTranslate2's per-token time on the same sentences.

Decodes the first --limit sentences of a prepared split one at a time with the fast step
(``--task fast_step_translation --fast-step``) and times each part of a sentence with wall-clock timers around
the engine's own methods: the encoder, the cross-attention keys and values (``start``), the embedding, each
decoder layer, the rest of the decoder step (final norm, Python between the calls), the output layer, the
log-softmax and fairseq's step rules, the cache reordering of a beam, and what is left of the generator's time:
the search's bookkeeping (fairseq's SequenceGenerator at beam > 1, the fast step's own loop at greedy). The
ctypes crossings are counted (native calls per token) and priced by a null ctypes call timed here. That is
``--search python``, the step-by-step search; ``--search native`` (the default path at batch 1) times the
whole search of a sentence in one native call (kernels/native/search.c: decoder, output layer, log-softmax,
search), whose parts are not visible from Python, beside the encoder and the cross-attention keys and values. Then
CTranslate2 (the same checkpoint converted by its fairseq converter, at --ctranslate2-compute-type) decodes the
same sentences with the same beam and length limit; its time per token is the whole sentence's (its parts are
not visible from Python). The timers cost about a microsecond a call: the profile's total is a little above a
bench's time, and the bench (`fairseq-plugins bench --reference ctranslate2`) is where speed is quoted.

Usage: python examples/fast_step/profile.py --path CKPT --data PREPARED [--precision int8] [--beam 5]
       [--limit 200] [--json OUT] [--markdown OUT]
"""

import argparse
import ctypes
import datetime
import json
import logging
import os
import time
from collections import defaultdict
from typing import Callable, Dict

import torch

logging.disable(logging.WARNING)

NATIVE_SEARCH = "the whole search in one native call (decoder, output layer, log-softmax, search)"


class Clock:
    """Seconds spent in each timed part, and how often each was called."""

    def __init__(self):
        self.seconds: Dict[str, float] = defaultdict(float)
        self.calls: Dict[str, int] = defaultdict(int)

    def wrap(self, function: Callable, name: Callable) -> Callable:
        """``function`` timed under ``name(*args)`` (a part's name; a function so that layers can be told apart)."""
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                part = name(*args)
                self.seconds[part] += time.perf_counter() - start
                self.calls[part] += 1
        return timed


def null_ctypes_call_seconds(calls: int = 200_000) -> float:
    """The cost of one ctypes call into C that does nothing worth timing (libc's abs): the crossing itself."""
    absolute = ctypes.CDLL(None).abs
    absolute.argtypes, absolute.restype = [ctypes.c_int], ctypes.c_int
    start = time.perf_counter()
    for value in range(calls):
        absolute(value)
    return (time.perf_counter() - start) / calls


def load(args):
    import fairseq_plugins  # noqa: F401  (registers the tasks; the fixes)
    from fairseq import checkpoint_utils, options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    from fairseq_plugins.tools.prepared import PreparedData

    data = PreparedData(args.data)
    parser = options.get_generation_parser(default_task="fast_step_translation")
    argv = [data.bin_dir, "--user-dir", fairseq_plugins.user_dir(), "--path", args.path, "--cpu",
            "--task", "fast_step_translation", "--fast-step", "--fast-step-precision", args.precision,
            "--beam", str(args.beam), "--batch-size", "1", "--gen-subset", args.split,
            "--source-lang", data.source_lang, "--target-lang", data.target_lang,
            "--max-len-a", str(args.max_len_a), "--max-len-b", str(args.max_len_b)]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(parser, argv))
    task = tasks.setup_task(cfg.task)
    models, _ = checkpoint_utils.load_model_ensemble([args.path], task=task)
    for model in models:
        model.eval()
    task.load_dataset(args.split)
    dataset = task.dataset(args.split)
    count = len(dataset) if not args.limit else min(args.limit, len(dataset))
    batches = [dataset.collater([dataset[i]]) for i in range(count)]
    return data, cfg, task, models, batches


def instrument(generator, clock: Clock) -> None:
    """Timers around the fast step's parts (instance attributes shadow the methods they wrap)."""
    ensemble, engine = generator.model, generator.model.engine
    ensemble.forward_encoder = clock.wrap(ensemble.forward_encoder, lambda *a: "encoder")
    engine.start = clock.wrap(engine.start, lambda *a: "cross-attention keys and values")
    engine._embed = clock.wrap(engine._embed, lambda *a: "embedding")
    engine.step = clock.wrap(engine.step, lambda *a: "decoder step")
    engine.group_step = clock.wrap(engine.group_step, lambda *a: "decoder step (group)")
    engine.logits = clock.wrap(engine.logits, lambda *a: "output layer")
    ensemble.next_list_lprobs = clock.wrap(ensemble.next_list_lprobs, lambda *a: "next log-probabilities")
    engine.reorder = clock.wrap(engine.reorder, lambda *a: "beam reordering")
    engine.greedy_search = clock.wrap(engine.greedy_search, lambda *a: NATIVE_SEARCH)
    engine.beam_search = clock.wrap(engine.beam_search, lambda *a: NATIVE_SEARCH)
    if engine.layer_step is not None:  # one native call a layer
        index = {id(layer): i for i, layer in enumerate(engine.native_layers)}
        engine.layer_step = clock.wrap(engine.layer_step, lambda layer, *a: f"decoder layer {index[id(layer)]}")
    else:  # the layers as torch operations: timed together
        engine._run = clock.wrap(engine._run, lambda *a: "decoder layers (torch operations)")


def profile_fast_step(args, task, models, batches) -> Dict:
    generator = task.build_generator(models, args.generation)
    if args.search == "python":  # the step-by-step search: no native whole-sentence search
        generator.model.engine.greedy_searcher = generator.model.engine.beam_searcher = None
    for batch in batches[:2]:  # warm-up
        generator.generate(models, batch)
    clock = Clock()
    instrument(generator, clock)
    total, tokens = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            start = time.perf_counter()
            hypotheses = generator.generate(models, batch)
            total += time.perf_counter() - start
            tokens += int(hypotheses[0][0]["tokens"].numel())  # the end token included: one step each
    s, calls = clock.seconds, clock.calls
    steps = calls["decoder step"]
    layers = {name: seconds for name, seconds in s.items() if name.startswith("decoder layer")}
    step_seconds = s["decoder step"]
    parts = {
        "encoder": s["encoder"],
        "cross-attention keys and values": s["cross-attention keys and values"],
    }
    if args.search == "native":
        parts[NATIVE_SEARCH] = s[NATIVE_SEARCH]
    else:
        parts.update({
            "embedding": s["embedding"],
            **dict(sorted(layers.items())),
            "rest of the decoder step": step_seconds - s["embedding"] - sum(layers.values()),
            "output layer": s["output layer"],
            "log-softmax and step rules": s["next log-probabilities"] - step_seconds - s["output layer"],
            "beam reordering": s["beam reordering"],
        })
    parts["search bookkeeping"] = total - sum(parts.values())
    native_calls = sum(calls[name] for name in layers) + calls[NATIVE_SEARCH]
    return {"seconds": total, "sentences": len(batches), "output_tokens": tokens, "decoder_steps": steps,
            "parts_seconds": parts, "native_calls": native_calls,
            "ms_per_token": {name: 1000 * seconds / tokens for name, seconds in parts.items()},
            "ms_per_token_total": 1000 * total / tokens}


def profile_ctranslate2(args, data, cfg, task, models, batches) -> Dict:
    from fairseq_plugins import user_dir
    from fairseq_plugins.bench.ctranslate2_reference import CTranslate2Decoder, converted_model

    conversion = converted_model(args.path, data.bin_dir, data.source_lang, data.target_lang, user_dir())
    decoder = CTranslate2Decoder(conversion["dir"], args.ctranslate2_compute_type, torch.get_num_threads(),
                                 torch.device("cpu"), task.source_dictionary, task.target_dictionary,
                                 cfg.generation, args.beam, min(m.max_decoder_positions() for m in models))
    for batch in batches[:2]:
        decoder(batch)
    total, tokens = 0.0, 0
    for batch in batches:
        start = time.perf_counter()
        outputs = decoder(batch)
        total += time.perf_counter() - start
        tokens += sum(len(hypothesis) for hypothesis in outputs.values())
    return {"seconds": total, "output_tokens": tokens, "ms_per_token_total": 1000 * total / tokens,
            "compute_type": decoder.compute_type, "version": decoder.version}


def markdown(result: Dict) -> str:
    fast, reference = result["fast_step"], result["ctranslate2"]
    crossing_ms = 1000 * result["null_ctypes_call_seconds"] * fast["native_calls"] / fast["output_tokens"]
    lines = ["| part | ms per token | share |", "|---|---|---|"]
    for name, ms in fast["ms_per_token"].items():
        lines.append(f"| {name} | {ms:.3f} | {100 * ms / fast['ms_per_token_total']:.0f}% |")
    lines.append(f"| **fast step {result['precision']}, total** | **{fast['ms_per_token_total']:.3f}** | 100% |")
    lines.append(f"| of which ctypes crossings ({fast['native_calls'] / fast['output_tokens']:.1f} native calls a "
                 f"token x {1e6 * result['null_ctypes_call_seconds']:.2f} us) | {crossing_ms:.3f} | "
                 f"{100 * crossing_ms / fast['ms_per_token_total']:.0f}% |")
    lines.append(f"| **CTranslate2 {reference['version']} {reference['compute_type']}, total** | "
                 f"**{reference['ms_per_token_total']:.3f}** | "
                 f"{100 * reference['ms_per_token_total'] / fast['ms_per_token_total']:.0f}% |")
    beam = "greedy" if result["beam"] == 1 else f"beam {result['beam']}"
    return (f"{beam}, {result['search']} search, batch 1, {result['threads']} thread(s), "
            f"{fast['sentences']} sentences, "
            f"{fast['output_tokens']} output tokens (fast step) and {reference['output_tokens']} (CTranslate2), "
            f"model sha256 {result['checkpoint_sha256'][:12]}\n\n" + "\n".join(lines) + "\n")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", required=True, help="a fairseq transformer checkpoint")
    p.add_argument("--data", required=True, help="its prepared data directory (fairseq-plugins prepare)")
    p.add_argument("--split", default="test")
    p.add_argument("--precision", choices=("fp32", "int8"), default="int8")
    p.add_argument("--ctranslate2-compute-type", default=None,
                   help="CTranslate2's compute type (default: int8 for --precision int8, else float32)")
    p.add_argument("--beam", type=int, default=1)
    p.add_argument("--search", choices=("native", "python"), default="native",
                   help="native: the whole search of a sentence in one native call (the fast step's path at batch "
                        "1); python: step by step, each part timed")
    p.add_argument("--limit", type=int, default=200, help="the first N sentences (0: all)")
    p.add_argument("--max-len-a", type=float, default=1.2)
    p.add_argument("--max-len-b", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="write the profile here")
    p.add_argument("--markdown", help="write the table here")
    args = p.parse_args()
    args.ctranslate2_compute_type = args.ctranslate2_compute_type or (
        "int8" if args.precision == "int8" else "float32")
    torch.set_num_threads(args.threads)

    from fairseq_plugins.bench import report
    from fairseq_plugins.bench.provenance import file_sha256

    data, cfg, task, models, batches = load(args)
    args.generation = cfg.generation
    result = {
        "checkpoint": os.path.abspath(args.path), "checkpoint_sha256": file_sha256(args.path),
        "precision": args.precision, "beam": args.beam, "search": args.search, "threads": args.threads,
        "length_limit": f"{args.max_len_a:g} * source + {args.max_len_b}",
        "null_ctypes_call_seconds": null_ctypes_call_seconds(),
        "fast_step": profile_fast_step(args, task, models, batches),
        "ctranslate2": profile_ctranslate2(args, data, cfg, task, models, batches),
        "device": report.device_name(torch.device("cpu")), "git_commit": report.git_commit(),
        "versions": report.versions(), "command": "python " + " ".join(os.sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    table = markdown(result)
    print(table, end="")
    if args.json:
        with open(args.json + ".tmp", "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        os.replace(args.json + ".tmp", args.json)
    if args.markdown:
        with open(args.markdown + ".tmp", "w", encoding="utf-8") as f:
            f.write(table)
        os.replace(args.markdown + ".tmp", args.markdown)


if __name__ == "__main__":
    main()
