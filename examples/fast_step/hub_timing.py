"""The fast step as a Python user calls it: ``hub.translate`` one sentence a call (fairseq's hub interface builds
a new generator each call) against one generator built once, on the same sentences, alternating sentence by
sentence in one process, one thread. Both encode, decode and detokenise the same way (the hub's own
``encode``/``decode``); only who builds the generator differs. The ratio (hub time / prebuilt time) is the
median of the runs' ratios, with its spread: 1.0 means a translate call costs what the prebuilt generator does.

Usage: python examples/fast_step/hub_timing.py --checkpoint-dir DIR --data PREPARED [--precision int8]
       [--beam 5] [--limit 200] [--runs 3] [--json OUT]
"""

import argparse
import copy
import datetime
import json
import logging
import os
import statistics
import sys
import time

import torch
from omegaconf import open_dict

logging.disable(logging.WARNING)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint-dir", required=True, help="folder of checkpoint_best.pt (or --checkpoint-file)")
    p.add_argument("--checkpoint-file", default="checkpoint_best.pt")
    p.add_argument("--data", required=True, help="the prepared data directory (fairseq-plugins prepare)")
    p.add_argument("--precision", choices=("fp32", "int8"), default="fp32")
    p.add_argument("--beam", type=int, default=5)
    p.add_argument("--limit", type=int, default=200, help="the first N test sentences")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args()
    torch.set_num_threads(1)

    import fairseq_plugins
    from fairseq.models.transformer import TransformerModel
    from fairseq_plugins.bench import report
    from fairseq_plugins.bench.measure import speed_ratio_figures
    from fairseq_plugins.bench.provenance import file_sha256
    from fairseq_plugins.tools.prepared import PreparedData

    data = PreparedData(args.data)
    hub = TransformerModel.from_pretrained(
        args.checkpoint_dir, checkpoint_file=args.checkpoint_file, data_name_or_path=data.bin_dir,
        user_dir=fairseq_plugins.user_dir(), bpe="sentencepiece",
        sentencepiece_model=os.path.join(args.data, "spm.model"), source_lang=data.source_lang,
        target_lang=data.target_lang, task="fast_step_translation", fast_step=True,
        fast_step_precision=args.precision)
    hub.eval()
    with open(data.raw_path("test", data.source_lang), encoding="utf-8") as f:
        sentences = [line.rstrip("\n") for line in f][:args.limit]
    settings = copy.deepcopy(hub.cfg.generation)  # (what translate(beam=...) builds its generator from)
    with open_dict(settings):
        settings.beam = args.beam
    prebuilt = hub.task.build_generator(hub.models, settings)

    def by_prebuilt(sentence: str) -> str:
        batch = next(iter(hub._build_batches([hub.encode(sentence)], False)))
        with torch.no_grad():
            hypotheses = hub.task.inference_step(prebuilt, hub.models, batch)
        return hub.decode(hypotheses[0][0]["tokens"])

    def by_translate(sentence: str) -> str:
        return hub.translate(sentence, beam=args.beam)

    ways = {"hub.translate": by_translate, "prebuilt generator": by_prebuilt}
    for way in ways.values():  # warm-up: the first translate builds the engine
        way(sentences[0])
    seconds = {name: [] for name in ways}
    outputs = {name: [] for name in ways}
    for run in range(args.runs):
        totals = dict.fromkeys(ways, 0.0)
        for index, sentence in enumerate(sentences):
            order = list(ways) if (run + index) % 2 == 0 else list(ways)[::-1]
            for name in order:
                start = time.perf_counter()
                text = ways[name](sentence)
                totals[name] += time.perf_counter() - start
                if run == 0:
                    outputs[name].append(text)
        for name in ways:
            seconds[name].append(totals[name])
    # hub time / prebuilt time, per run (speed_ratio_figures takes (reference, method): here the prebuilt
    # generator is the method whose time the hub's is compared with)
    figures = speed_ratio_figures(seconds["hub.translate"], seconds["prebuilt generator"])
    result = {
        "precision": args.precision, "beam": args.beam, "sentences": len(sentences), "threads": 1,
        "ms_per_sentence": {name: 1000 * statistics.median(s) / len(sentences) for name, s in seconds.items()},
        "run_seconds": seconds,
        "hub_over_prebuilt": figures["speed_ratio"], "hub_over_prebuilt_runs": figures["speed_ratio_runs"],
        "hub_over_prebuilt_spread": figures["speed_ratio_spread"], "flagged": figures["speed_ratio_flagged"],
        "same_translations": sum(a == b for a, b in zip(outputs["hub.translate"], outputs["prebuilt generator"])),
        "checkpoint_sha256": file_sha256(os.path.join(args.checkpoint_dir, args.checkpoint_file)),
        "device": report.device_name(torch.device("cpu")), "git_commit": report.git_commit(),
        "command": "python " + " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    print(f"{args.precision} beam {args.beam}: hub.translate {result['ms_per_sentence']['hub.translate']:.2f} ms a "
          f"sentence, prebuilt {result['ms_per_sentence']['prebuilt generator']:.2f} ms: "
          f"{result['hub_over_prebuilt']:.3f}x ({min(figures['speed_ratio_runs']):.3f}-"
          f"{max(figures['speed_ratio_runs']):.3f}){' !' if result['flagged'] else ''}; "
          f"{result['same_translations']}/{len(sentences)} translations the same")
    if args.json:
        with open(args.json + ".tmp", "w", encoding="utf-8") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
        os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    main()
