"""The baseline transformer in CTranslate2 (converted with its fairseq converter, int8), one thread, one sentence
at a time, on the sentences fairseq-plugins bench decodes (the first --limit of the prepared test split).

Prints and writes (--json) words/s, sentences/s, latency percentiles and sacreBLEU, in bench's field names,
with the command lines that made the model (--provenance) and this one.
"""

import argparse
import datetime
import json
import shlex
import sys
import time

import sacrebleu
import torch

from fairseq_plugins.bench import report
from fairseq_plugins.bench.measure import percentile
from fairseq_plugins.tools.prepared import PreparedData
from fairseq_plugins.common.textio import atomic_output, read_lines


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="CTranslate2 model directory (ct2-fairseq-converter output)")
    p.add_argument("--data", required=True, help="prepared data directory (from `fairseq-plugins prepare`)")
    p.add_argument("--split", default="test")
    p.add_argument("--beam", type=int, default=6)
    p.add_argument("--limit", type=int, default=200, help="the first N sentences (0: all)")
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--compute-type", default="int8")
    p.add_argument("--provenance", nargs="*", default=[])
    p.add_argument("--json", required=True)
    args = p.parse_args()

    import ctranslate2

    data = PreparedData(args.data)
    limit = args.limit or None
    sources = read_lines(data.raw_path(args.split, data.source_lang))[:limit]
    references = read_lines(data.raw_path(args.split, data.target_lang), allow_empty_lines=True)[:limit]
    source_tokenizer, target_tokenizer = data.tokenizer(data.source_lang), data.tokenizer(data.target_lang)
    pieces = [source_tokenizer.encode(line).split() + ["</s>"] for line in sources]  # fairseq's source EOS
    translator = ctranslate2.Translator(args.model, device="cpu", compute_type=args.compute_type, intra_threads=1,
                                        inter_threads=1)

    def translate(tokens):
        return translator.translate_batch([tokens], beam_size=args.beam, max_batch_size=1)[0].hypotheses[0]

    for tokens in pieces[:2]:  # warm-up, as bench
        translate(tokens)
    run_seconds, latencies, outputs = [], [], []
    for _ in range(args.runs):
        outputs, latencies_run = [], []
        start = time.perf_counter()
        for tokens in pieces:
            t0 = time.perf_counter()
            outputs.append(translate(tokens))
            latencies_run.append(time.perf_counter() - t0)
        run_seconds.append(time.perf_counter() - start)
        latencies.append(latencies_run)
    median_run = sorted(run_seconds)[len(run_seconds) // 2]
    median_index = run_seconds.index(median_run)
    texts = [target_tokenizer.decode(" ".join(tokens)) for tokens in outputs]
    bleu = sacrebleu.metrics.BLEU()
    words = sum(len(text.split()) for text in texts)
    result = {
        "method": "ctranslate2",
        "label": f"CTranslate2 {ctranslate2.__version__} {args.compute_type}, baseline transformer",
        "device": report.device_name(torch.device("cpu")),
        "threads": 1, "batch_size": 1, "beam": args.beam,
        "bleu": round(bleu.corpus_score(texts, [references]).score, 2),
        "bleu_signature": str(bleu.get_signature()),
        "sentences_per_s": len(pieces) / median_run,
        "tokens_per_s": sum(len(tokens) for tokens in outputs) / median_run,
        "words_per_s": words / median_run,
        "latency_ms_p50": 1000 * percentile(latencies[median_index], 50),
        "latency_ms_p90": 1000 * percentile(latencies[median_index], 90),
        "sentences": len(pieces), "target_words": words, "run_seconds": run_seconds, "runs": args.runs,
        "model": args.model, "compute_type": args.compute_type,
        "commands": report.read_provenance(args.provenance) + [shlex.join(["python"] + sys.argv)],
        "git_commit": report.git_commit(),
        "versions": {**report.versions(), "ctranslate2": ctranslate2.__version__},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
    with atomic_output(args.json) as f:
        json.dump(result, f, indent=2, ensure_ascii=False)
        f.write("\n")
    print(f"{result['label']}: {result['words_per_s']:.1f} words/s, {result['sentences_per_s']:.2f} sentences/s, "
          f"p50 {result['latency_ms_p50']:.1f} ms, BLEU {result['bleu']}")


if __name__ == "__main__":
    main()
