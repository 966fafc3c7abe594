"""Collect examples/rnn_fc/run.sh's measurements into the paper's tables on our data, with the targets checked.

Reads RESULTS/rnn_fc_{table1,table2_epochN,baseline,lists,vs_baseline,ctranslate2}.json (bench results; each method row has
fairseq's stock generator measured in the same run) and WORK/eval/<row>.bleu.json (sacreBLEU of fairseq-generate
on the whole test set). Writes OUT.json and OUT.md.

Speedups are given two ways: the raw ratio of words/s to the plain decoder's row, and the same ratio with each
row first divided by the stock generator measured in its own run (which cancels drift in machine load between
runs; the stock generator and the model are the same in every Table 1 run).
"""

import argparse
import glob
import json
import os

from fairseq_plugins.bench import report
from fairseq_plugins.common.textio import atomic_output


def load(path):
    return report.load_results(path) if os.path.exists(path) else []


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", required=True)
    p.add_argument("--results", required=True)
    p.add_argument("--out", required=True, help="output path without extension")
    args = p.parse_args()

    def bleu(name):
        path = os.path.join(args.work, "eval", f"{name}.bleu.json")
        if not os.path.exists(path):
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)["score"]

    def row(r, bleu_name):
        stats = r["stats"]
        return {
            "label": r.get("label", r["method"]),
            "bleu": bleu(bleu_name),
            "bench_bleu": r["bleu"],
            "words_per_s": round(r["words_per_s"], 1),
            "sentences_per_s": round(r["sentences_per_s"], 2),
            "latency_ms_p50": round(r["latency_ms_p50"], 2),
            "stock_words_per_s": round(r["baseline"]["words_per_s"], 1),
            "stock_bench_bleu": r["baseline"]["bleu"],
            "ratio_to_stock": round(r["ratios"]["words_per_s"], 3),
            "outputs_identical_to_stock": stats.get("outputs_identical_to_baseline"),
            "model_calls_per_step": round(stats.get("model_calls_per_step", 0), 2),
            "stopped_early": stats.get("stopped_early"),
            "candidates_per_sentence": round(stats["candidates_per_sentence"], 1)
            if "candidates_per_sentence" in stats else None,
        }

    table1 = [row(r, f"table1-{i}") for i, r in enumerate(load(os.path.join(args.results, "rnn_fc_table1.json")))]
    if table1:
        plain = table1[0]
        for r in table1:
            r["speedup_raw"] = round(r["words_per_s"] / plain["words_per_s"], 2)
            r["speedup_stock_normalised"] = round(r["ratio_to_stock"] / plain["ratio_to_stock"], 2)
    table2 = []
    for path in sorted(glob.glob(os.path.join(args.results, "rnn_fc_table2_epoch*.json"))):
        for r in load(path):
            system, _, epoch = r["label"].split()  # "<system> epoch <N>"
            entry = row(r, f"table2-{system}-e{epoch}")
            entry.update(system=system, epochs=int(epoch))
            table2.append(entry)
    baseline = [row(r, f"baseline-{i}") for i, r in enumerate(load(os.path.join(args.results, "rnn_fc_baseline.json")))]
    lists = []
    for r in load(os.path.join(args.results, "rnn_fc_lists.json")):
        frequent = r["label"].split("top 20, ")[1].split()[0]
        lists.append(dict(row(r, f"lists-f{frequent}"), frequent=int(frequent)))
    versus = []
    for r in load(os.path.join(args.results, "rnn_fc_vs_baseline.json")):
        entry = row(r, "table1-4" if "exact" in r["label"] else f"table1-{len(table1) - 1}")
        entry["baseline_transformer_words_per_s"] = entry.pop("stock_words_per_s")
        entry["baseline_transformer_bench_bleu"] = entry.pop("stock_bench_bleu")
        entry["ratio_to_baseline_transformer"] = entry.pop("ratio_to_stock")
        versus.append(entry)
    ctranslate2 = []
    if os.path.exists(os.path.join(args.results, "rnn_fc_ctranslate2.json")):
        with open(os.path.join(args.results, "rnn_fc_ctranslate2.json"), encoding="utf-8") as f:
            ctranslate2 = [json.load(f)]  # its own schema (not a bench result: no stock generator in its run)
    baseline_stock_bleu = bleu("baseline-stock")

    targets = {}
    if table1:
        exact = [r["bleu"] for r in table1[:5] if r["bleu"] is not None]
        targets["cumulative_speedup_all_switches"] = {"raw": table1[-1]["speedup_raw"],
                                                      "stock_normalised": table1[-1]["speedup_stock_normalised"],
                                                      "target": 4.4}
        targets["cumulative_speedup_exact_switches"] = {"raw": table1[4]["speedup_raw"],
                                                        "stock_normalised": table1[4]["speedup_stock_normalised"]}
        targets["exact_switches_bleu_spread"] = {"value": round(max(exact) - min(exact), 2) if exact else None,
                                                 "target": 0.1}
    if versus and baseline_stock_bleu is not None:
        fastest = max(versus, key=lambda r: r["ratio_to_baseline_transformer"])
        targets["fastest_rnn_fc_vs_baseline_transformer"] = {
            "label": fastest["label"], "words_per_s_ratio": fastest["ratio_to_baseline_transformer"],
            "bleu": fastest["bleu"], "baseline_bleu_beam6": baseline_stock_bleu,
            "bleu_below_baseline": round(baseline_stock_bleu - fastest["bleu"], 2) if fastest["bleu"] else None,
            "target": "ratio > 1 at no more than 1 BLEU below"}

    any_result = next(iter(load(os.path.join(args.results, "rnn_fc_table1.json"))), None)
    result = {
        "method": "fast CPU decoding (Devlin 2017) on Multi30k en->de test_2016_flickr",
        "bleu_from": "fairseq-generate --task rnn_fc_translation --beam 6 --batch-size 64 on the whole test set "
                     "(1000 sentences), detokenised, sacreBLEU",
        "speed_from": (f"fairseq-plugins bench: first {any_result['sentences']} test sentences, beam 6, batch 1, "
                       f"{any_result['threads']} thread, median of {any_result['runs']} runs alternating with "
                       "fairseq's stock generator in the same process") if any_result else None,
        "device": any_result["device"] if any_result else None,
        "targets": targets,
        "table1": table1,
        "table2": table2,
        "baseline_transformer": {"bleu_beam6_stock": baseline_stock_bleu, "rows": baseline,
                                 "candidate_list_sizes": lists},
        "versus_baseline_transformer": versus,
        "ctranslate2": ctranslate2,
        "commands": report.read_provenance([os.path.join(args.work, "commands.txt")]),
    }
    with atomic_output(args.out + ".json") as f:
        json.dump(result, f, indent=2, ensure_ascii=False)
        f.write("\n")

    def fmt(value, spec=".1f"):
        return "" if value is None else format(value, spec)

    lines = [f"# Fast CPU decoding (Devlin 2017) on Multi30k en->de ({result['device']})", "",
             f"BLEU: {result['bleu_from']}. Speed: {result['speed_from']}.", ""]
    lines += ["## Table 1: decoder switches, cumulative (fc4-tanh)", "",
              "| row | BLEU | words/s | speedup | speedup (stock-normalised) | stock words/s | = stock | calls/step |",
              "|---|---|---|---|---|---|---|---|"]
    for r in table1:
        lines.append(f"| {r['label']} | {fmt(r['bleu'])} | {r['words_per_s']} | x{r['speedup_raw']} | "
                     f"x{r['speedup_stock_normalised']} | {r['stock_words_per_s']} | "
                     f"{fmt(r['outputs_identical_to_stock'], '.2f')} | {r['model_calls_per_step']} |")
    lines += ["", "## Table 2: model variants at equal epochs (exact switches on)", "",
              "| system | epochs | BLEU | words/s | sentences/s | stock words/s (same model) |", "|---|---|---|---|---|---|"]
    for r in table2:
        lines.append(f"| {r['system']} | {r['epochs']} | {fmt(r['bleu'])} | {r['words_per_s']} | {r['sentences_per_s']} | "
                     f"{r['stock_words_per_s']} |")
    lines += ["", f"## The switches on the baseline transformer (stock fairseq beam 6: BLEU {fmt(baseline_stock_bleu)})", "",
              "| row | BLEU | words/s | stock words/s | ratio | candidates |", "|---|---|---|---|---|---|"]
    for r in baseline:
        lines.append(f"| {r['label']} | {fmt(r['bleu'])} | {r['words_per_s']} | {r['stock_words_per_s']} | "
                     f"x{r['ratio_to_stock']} | {fmt(r['candidates_per_sentence'])} |")
    if lists:
        lines += ["", "Candidate-list size (top 20 translations + N frequent pieces; baseline transformer, fp32):", "",
                  "| N frequent | BLEU | candidates a sentence | words/s | ratio to stock |", "|---|---|---|---|---|"]
        for r in lists:
            lines.append(f"| {r['frequent']} | {fmt(r['bleu'])} | {fmt(r['candidates_per_sentence'])} | "
                         f"{r['words_per_s']} | x{r['ratio_to_stock']} |")
    lines += ["", "## rnn_fc against the baseline transformer (same run)", "",
              "| row | BLEU | words/s | transformer words/s | ratio |", "|---|---|---|---|---|"]
    for r in versus:
        lines.append(f"| {r['label']} | {fmt(r['bleu'])} | {r['words_per_s']} | "
                     f"{r['baseline_transformer_words_per_s']} | x{r['ratio_to_baseline_transformer']} |")
    for r in ctranslate2:
        lines.append(f"| {r['label']} (own run) | bench sentences: {r['bleu']} | {r['words_per_s']:.1f} | | |")
    lines += ["", "Targets: `" + json.dumps(targets) + "`", "", "Commands:", "", "```"] + result["commands"] + ["```", ""]
    with atomic_output(args.out + ".md") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
