"""Collect examples/rnn_fc/run.sh's measurements into the paper's tables on our data, with the targets checked.

Reads RESULTS/rnn_fc_{table1,table2 (else table2_epochN),baseline,lists,vs_baseline,ctranslate2}.json (bench results; each method row has
fairseq's stock generator measured in the same run) and WORK/eval/<row>.bleu.json (sacreBLEU of fairseq-generate
on the whole test set). Writes OUT.json and OUT.md.

Every speed figure is a time ratio on the same sentences. Each row's speed ratio is the bench result's: the stock
generator's time / the row's time in the same run (median of the runs' ratios, min-max; a spread over 10% of the
median, and every other reason `fairseq-plugins report` flags, is marked). Table 1's speedup over the plain
decoder is the row's speed ratio / the plain decoder's: both against the same stock generator on the same model
and sentences, which cancels drift in machine load between runs; its range is the row's min / the plain decoder's
max to the row's max / the plain decoder's min. Beside it, the plain decoder's time / the row's time from the two
runs' median timings (separate runs, not normalised). Words/s (the paper's measure, which rewards longer
outputs) is a secondary column.
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
            "stock_sentences_per_s": round(r["baseline"]["sentences_per_s"], 2),
            "stock_bench_bleu": r["baseline"]["bleu"],
            **report.speed_figures(r),  # against the stock generator of the same run
            "words_per_s_ratio_to_stock": round(r["ratios"]["words_per_s"], 3),  # secondary
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
            r["speedup_over_plain"] = round(r["speed_ratio"] / plain["speed_ratio"], 3)
            r["speedup_over_plain_min"] = round(r["speed_ratio_min"] / plain["speed_ratio_max"], 3)
            r["speedup_over_plain_max"] = round(r["speed_ratio_max"] / plain["speed_ratio_min"], 3)
            r["speedup_over_plain_separate_runs"] = round(r["sentences_per_s"] / plain["sentences_per_s"], 3)
            r["words_per_s_speedup_over_plain"] = round(r["words_per_s"] / plain["words_per_s"], 3)  # secondary
    table2 = []
    converged = os.path.join(args.results, "rnn_fc_table2.json")
    if os.path.exists(converged):  # each system at its plateau, averaged: "<system> (averaged at its plateau)"
        for r in load(converged):
            system = r["label"].split()[0]
            table2.append(dict(row(r, f"table2-{system}"), system=system, epochs="plateau"))
    else:  # the older tables at equal small epoch counts: "<system> epoch <N>"
        for path in sorted(glob.glob(os.path.join(args.results, "rnn_fc_table2_epoch*.json"))):
            for r in load(path):
                system, _, epoch = r["label"].split()
                table2.append(dict(row(r, f"table2-{system}-e{epoch}"), system=system, epochs=int(epoch)))
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
        entry["baseline_transformer_sentences_per_s"] = entry.pop("stock_sentences_per_s")
        entry["words_per_s_ratio_to_baseline_transformer"] = entry.pop("words_per_s_ratio_to_stock")
        versus.append(entry)
    ctranslate2 = []  # the same rows against CTranslate2 int8 on the baseline transformer, in the same runs
    for r in load(os.path.join(args.results, "rnn_fc_ctranslate2.json")):
        ctranslate2.append({"label": r.get("label", r["method"]), "bench_bleu": r["bleu"],
                            "ctranslate2_bench_bleu": r["ctranslate2"]["bleu"],
                            "speed_ratio_to_baseline_transformer": report.speed_figures(r),
                            "speed_ratio_to_ctranslate2": report.speed_figures(report.reference_ratio(r))})
    baseline_stock_bleu = bleu("baseline-stock")

    def cumulative(r):
        return {"speedup": r["speedup_over_plain"], "min": r["speedup_over_plain_min"],
                "max": r["speedup_over_plain_max"], "separate_runs": r["speedup_over_plain_separate_runs"],
                "words_per_s": r["words_per_s_speedup_over_plain"]}

    targets = {}
    if table1:
        exact = [r["bleu"] for r in table1[:5] if r["bleu"] is not None]
        # A flagged ratio (of either row) supports no "met" (docs/results/targets.json, the method page).
        flags = sorted(set(table1[-1]["speed_ratio_flags"] + table1[0]["speed_ratio_flags"]))
        targets["cumulative_speedup_all_switches"] = dict(cumulative(table1[-1]), target=4.4, flags=flags,
                                                          met=table1[-1]["speedup_over_plain"] >= 4.4 and not flags)
        targets["cumulative_speedup_exact_switches"] = cumulative(table1[4])
        spread = round(max(exact) - min(exact), 2) if exact else None
        targets["exact_switches_bleu_spread"] = {"value": spread, "target": 0.1,
                                                 "met": spread is not None and spread <= 0.1}
    if versus and baseline_stock_bleu is not None:
        fastest = max(versus, key=lambda r: r["speed_ratio"])
        below = round(baseline_stock_bleu - fastest["bleu"], 2) if fastest["bleu"] else None
        targets["fastest_rnn_fc_vs_baseline_transformer"] = {
            "label": fastest["label"], "speed_ratio": round(fastest["speed_ratio"], 3),
            "speed_ratio_min": round(fastest["speed_ratio_min"], 3),
            "speed_ratio_max": round(fastest["speed_ratio_max"], 3),
            "words_per_s_ratio": fastest["words_per_s_ratio_to_baseline_transformer"],
            "bleu": fastest["bleu"], "baseline_bleu_beam6": baseline_stock_bleu, "bleu_below_baseline": below,
            "target": "speed ratio > 1 at no more than 1 BLEU below",
            "met": fastest["speed_ratio"] > 1 and below is not None and below <= 1}

    any_result = next(iter(load(os.path.join(args.results, "rnn_fc_table1.json"))), None)
    result = {
        "method": "fast CPU decoding (Devlin 2017) on Multi30k en->de test_2016_flickr",
        "bleu_from": "fairseq-generate --task rnn_fc_translation --beam 6 --batch-size 64 on the whole test set "
                     "(1000 sentences), detokenised, sacreBLEU",
        "speed_from": (f"fairseq-plugins bench: first {any_result['sentences']} test sentences, beam 6, batch 1, "
                       f"{any_result['threads']} thread, median of {any_result['runs']} runs alternating with "
                       "fairseq's stock generator in the same process") if any_result else None,
        "speed_ratio_definition": any_result["speed_ratio_definition"] if any_result else None,
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
              "| row | BLEU | speed ratio to stock, same run (min-max) | speedup over the plain decoder (range) "
              "[separate runs] | sentences/s | words/s | words/s over plain | = stock | calls/step |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in table1:
        lines.append(f"| {r['label']} | {fmt(r['bleu'])} | {report.speed_cell(r)} | {r['speedup_over_plain']:.2f}x "
                     f"({r['speedup_over_plain_min']:.2f}-{r['speedup_over_plain_max']:.2f}) "
                     f"[{r['speedup_over_plain_separate_runs']:.2f}x] | {r['sentences_per_s']} | {r['words_per_s']} | "
                     f"{r['words_per_s_speedup_over_plain']:.2f}x | {fmt(r['outputs_identical_to_stock'], '.2f')} | "
                     f"{r['model_calls_per_step']} |")
    if table1:
        lines += ["", "Speedup over the plain decoder: the row's speed ratio / the plain decoder's (both against the "
                  "same stock generator, model and sentences); range: the row's min / the plain decoder's max to the "
                  "row's max / the plain decoder's min; [separate runs]: the plain decoder's median run time / the "
                  "row's, not normalised. Words/s over plain: secondary (it rewards longer outputs)."]
    lines += report.flag_note_lines([(r["label"], r) for r in table1])
    lines += ["", "## Table 2: model variants (exact switches on)", "",
              "| system | epochs | BLEU | speed ratio to stock, same model (min-max) | words/s | sentences/s | "
              "stock words/s (same model) |", "|---|---|---|---|---|---|---|"]
    for r in table2:
        lines.append(f"| {r['system']} | {r['epochs']} | {fmt(r['bleu'])} | {report.speed_cell(r)} | {r['words_per_s']} | "
                     f"{r['sentences_per_s']} | {r['stock_words_per_s']} |")
    lines += report.flag_note_lines([(r["label"], r) for r in table2])
    lines += ["", f"## The switches on the baseline transformer (stock fairseq beam 6: BLEU {fmt(baseline_stock_bleu)})", "",
              "| row | BLEU | speed ratio to stock (min-max) | words/s | stock words/s | words/s ratio | candidates |",
              "|---|---|---|---|---|---|---|"]
    for r in baseline:
        lines.append(f"| {r['label']} | {fmt(r['bleu'])} | {report.speed_cell(r)} | {r['words_per_s']} | "
                     f"{r['stock_words_per_s']} | {r['words_per_s_ratio_to_stock']} | "
                     f"{fmt(r['candidates_per_sentence'])} |")
    lines += report.flag_note_lines([(r["label"], r) for r in baseline])
    if lists:
        lines += ["", "Candidate-list size (top 20 translations + N frequent pieces; baseline transformer, fp32):", "",
                  "| N frequent | BLEU | candidates a sentence | speed ratio to stock (min-max) | words/s | "
                  "words/s ratio |", "|---|---|---|---|---|---|"]
        for r in lists:
            lines.append(f"| {r['frequent']} | {fmt(r['bleu'])} | {fmt(r['candidates_per_sentence'])} | "
                         f"{report.speed_cell(r)} | {r['words_per_s']} | {r['words_per_s_ratio_to_stock']} |")
        lines += report.flag_note_lines([(f"{r['frequent']} frequent", r) for r in lists])
    lines += ["", "## rnn_fc against the baseline transformer (same run)", "",
              "| row | BLEU | speed ratio: transformer time / rnn_fc time (min-max) | words/s | transformer words/s | "
              "words/s ratio |", "|---|---|---|---|---|---|"]
    for r in versus:
        lines.append(f"| {r['label']} | {fmt(r['bleu'])} | {report.speed_cell(r)} | {r['words_per_s']} | "
                     f"{r['baseline_transformer_words_per_s']} | {r['words_per_s_ratio_to_baseline_transformer']} |")
    lines += report.flag_note_lines([(r["label"], r) for r in versus])
    if ctranslate2:
        lines += ["", "## rnn_fc against CTranslate2 int8 on the baseline transformer (same run)", "",
                  "| row | bench BLEU | CTranslate2 bench BLEU | speed ratio to the transformer (stock) | "
                  "speed ratio to CTranslate2 int8 |", "|---|---|---|---|---|"]
        for r in ctranslate2:
            lines.append(f"| {r['label']} | {fmt(r['bench_bleu'])} | {fmt(r['ctranslate2_bench_bleu'])} | "
                         f"{report.ratio_cell(r['speed_ratio_to_baseline_transformer'])} | "
                         f"{report.ratio_cell(r['speed_ratio_to_ctranslate2'])} |")
    lines += ["", "Targets: `" + json.dumps(targets) + "`", "", "Commands:", "", "```"] + result["commands"] + ["```", ""]
    with atomic_output(args.out + ".md") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
