"""Collect examples/lattice/run.sh's measurements into one summary (the paper's comparisons on our data).

Reads WORK/<system>/bleu.json (sacreBLEU on the whole test set; WORK/baseline/bleu.json is the baseline
transformer at beam 5), the bench results of stages bench and ks (each row against the baseline
transformer at beam 5 decoded in the same run), the lattice-recall JSONs and WORK/commands.txt.
Writes OUT.json and OUT.md.

The speed figure is the bench result's speed ratio: the baseline's time / lattice decoding's time on the same
sentences, the median of the runs' ratios, with their min-max; a spread over 10% of the median (and every other
reason `fairseq-plugins report` flags) is marked. Per-sentence latency (p50) and its phases are beside it.
"""

import argparse
import json
import os
import re
import sys

from fairseq_plugins.bench import report
from fairseq_plugins.common.plots import pyplot, save_png
from fairseq_plugins.common.textio import atomic_output

PHASES = ("encoder", "lattice", "scoring", "viterbi")

def bench_row(r):
    stats = r["stats"]
    row = {
        "label": r["label"],
        "bench_bleu": r["bleu"], "bench_baseline_bleu": r["baseline"]["bleu"],
        **report.speed_figures(r),
        "latency_ms_p50": round(r["latency_ms_p50"], 2), "baseline_latency_ms_p50": round(r["baseline"]["latency_ms_p50"], 2),
        # Secondary: baseline p50 latency / lattice p50 latency (medians of per-sentence times, not a time ratio).
        "latency_p50_ratio": round(r["baseline"]["latency_ms_p50"] / r["latency_ms_p50"], 2),
        "sentences_per_s_ratio": round(r["ratios"]["sentences_per_s"], 2),
        "lattice_recall": round(stats.get("lattice_recall", float("nan")), 4),
        "k": stats.get("k"), "normalization": stats.get("normalization"), "scorer_layers": stats.get("scorer_layers"),
    }
    row.update({f"{phase}_ms": round(stats[f"{phase}_ms_per_sentence"], 2) for phase in PHASES})
    return row


# The paper's distilled system against its autoregressive baseline (beam 5) on CPU, and the target.
PAPER_POINT = (19.6, 3.35)
TARGET = (10.0, 3.5)


def variant_rows(paths):
    """Bench rows of other systems (another scorer or encoder, --variants) whose whole-test BLEU the bench
    scored (``split_bleu``), with their gap to the baseline at beam 5 in the same run; rows without it (timed
    sentences only) are left out, with a warning."""
    rows = []
    for path in paths:
        for r in report.load_results(path):
            if r.get("batch_size", 1) != 1:
                continue
            split = r.get("split_bleu")
            if not split:
                print(f"{path}: {r.get('label', r['method'])}: no whole-test BLEU (split_bleu), not plotted",
                      file=sys.stderr)
                continue
            rows.append({**r, "bleu": split["method"]["bleu"], "bleu_gap_vs_baseline_beam5": -split["bleu_delta"]})
    return rows


def plot_frontier(systems, fast, path, variants=()):
    """BLEU gap to the baseline at beam 5 (whole test set) against the speed ratio (batch 1, log scale): every
    latency setting and system, the other systems' (``variant_rows``), the paper's point and the target region
    (>= x10 at a gap <= 3.5)."""
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(7, 4.8))
    variants = list(variants)
    points = [(r["speed_ratio"], r["bleu_gap_vs_baseline_beam5"]) for r in fast + systems + variants
              if "speed_ratio" in r]
    points.append(PAPER_POINT)
    left, right = min(x for x, _ in points) / 1.4, max(x for x, _ in points) * 1.4
    top, bottom = min(0.0, min(y for _, y in points)) - 0.3, max(TARGET[1], max(y for _, y in points)) + 0.3
    ax.fill_between([TARGET[0], right], top, TARGET[1], color="green", alpha=0.06)
    ax.axhline(TARGET[1], color="green", linewidth=0.8, linestyle="--",
               label=f"target: >= x{TARGET[0]:g} at a gap <= {TARGET[1]:g}")
    ax.axvline(TARGET[0], color="green", linewidth=0.8, linestyle="--")
    groups = [("Viterbi", [r for r in fast if not r.get("no_repeat_ngram_size")], "o"),
              ("no repeated trigrams", [r for r in fast if r.get("no_repeat_ngram_size")], "s"),
              ("systems at K = 64", [r for r in systems if "speed_ratio" in r], "^"),
              ("other scorers and encoders (int8, no repeated trigrams)", variants, "D")]
    for name, rows, marker in groups:
        rows = [r for r in rows if r.get("batch_size", 1) == 1]
        if not rows:
            continue
        ax.scatter([r["speed_ratio"] for r in rows], [r["bleu_gap_vs_baseline_beam5"] for r in rows], marker=marker,
                   alpha=0.8, label=name)
        for r in rows:
            ax.annotate(r.get("label", r.get("system", "")).replace("distill-1 ", ""), (r["speed_ratio"],
                        r["bleu_gap_vs_baseline_beam5"]), fontsize=6, xytext=(3, 3), textcoords="offset points")
    ax.scatter([PAPER_POINT[0]], [PAPER_POINT[1]], marker="*", s=120, color="black", label="the paper (distilled)")
    ax.set_xscale("log")
    ax.set_xlim(left, right)
    ax.set_ylim(bottom, top)  # the smaller gap up
    ax.set_xlabel("speed ratio: baseline beam 5 time / lattice time, same sentences, batch 1 (log scale)")
    ax.set_ylabel("BLEU gap to the baseline at beam 5 (whole test set)")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_png(fig, path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", required=True)
    p.add_argument("--systems", nargs="+", required=True)
    p.add_argument("--bench", required=True, help="bench JSON of stage bench")
    p.add_argument("--ks", help="bench JSON of stage ks")
    p.add_argument("--layers", help="bench JSON of stage layers")
    p.add_argument("--fast", help="bench JSON of stage fast (distill-1 at K x precision x no-repeat rule)")
    p.add_argument("--layers-epoch", type=int, default=3, help="the epoch stage layers compared")
    p.add_argument("--recall", nargs="*", default=[], help="lattice-recall JSONs")
    p.add_argument("--commands", required=True)
    p.add_argument("--out", required=True, help="output path without extension")
    p.add_argument("--plot", help="write the frontier plot here (PNG): BLEU gap against speed ratio, every setting")
    p.add_argument("--variants", nargs="*", default=[],
                   help="bench JSONs of other systems (e.g. a narrower scorer, a deeper encoder) to plot beside "
                        "them: their rows with a whole-test BLEU (split_bleu)")
    args = p.parse_args()

    def bleu_of(system):
        with open(os.path.join(args.work, system, "bleu.json"), encoding="utf-8") as f:
            return json.load(f)["score"]

    def epochs_of(system):
        """The last epoch checkpoint the system's training wrote (patience may stop it before its --max-epoch);
        without epoch checkpoints, --max-epoch of the last fairseq-train command that wrote its checkpoints."""
        checkpoints = os.path.join(args.work, system, "checkpoints")
        epochs = [int(name[len("checkpoint"):-3]) for name in (os.listdir(checkpoints) if os.path.isdir(checkpoints)
                                                               else []) if re.fullmatch(r"checkpoint\d+\.pt", name)]
        if epochs:
            return max(epochs)
        found = None
        for line in report.read_provenance([args.commands]):
            words = line.split()
            if words[:1] == ["fairseq-train"] and f"{args.work.rstrip('/')}/{system}/checkpoints" in words:
                found = int(words[words.index("--max-epoch") + 1])
        return found

    baseline_bleu = bleu_of("baseline")
    benches = {r["label"]: r for r in report.load_results(args.bench)}
    systems = []
    for system in args.systems:
        row = {"system": system, "training_targets": "distilled" if system.startswith("distill") else "original",
               "epochs": epochs_of(system), "bleu": bleu_of(system)}
        row["bleu_gap_vs_baseline_beam5"] = round(baseline_bleu - row["bleu"], 2)
        if system in benches:
            row.update(bench_row(benches[system]))
        systems.append(row)
    extra = [bench_row(r) for label, r in benches.items() if label not in args.systems]
    ks = [bench_row(r) for r in report.load_results(args.ks)] if args.ks and os.path.exists(args.ks) else []
    layers = []
    if args.layers and os.path.exists(args.layers):
        for r in report.load_results(args.layers):
            system = r["label"].split()[0]
            row = bench_row(r)
            out = os.path.join(args.work, system, f"generate.epoch{args.layers_epoch}.out.bleu.json")
            with open(out, encoding="utf-8") as f:
                row["bleu"] = json.load(f)["score"]
            row["bleu_gap_vs_baseline_beam5"] = round(baseline_bleu - row["bleu"], 2)
            layers.append(row)
    fast = []
    if args.fast and os.path.exists(args.fast):
        for r in report.load_results(args.fast):
            system, k, precision, *search = r["label"].split()  # "distill-1 K=32 int8 [nr3]"
            row = {**bench_row(r), "scorer_precision": precision, "batch_size": r["batch_size"],
                   "no_repeat_ngram_size": int(search[0][2:]) if search else 0}
            slug = ".".join([f"k{k[2:]}", precision, *search])
            out = os.path.join(args.work, system, f"generate.{slug}.out.bleu.json")
            with open(out, encoding="utf-8") as f:
                bleu = json.load(f)
            row.update({"bleu": bleu["score"], "bleu_verbose": bleu["verbose_score"],
                        "bleu_gap_vs_baseline_beam5": round(baseline_bleu - bleu["score"], 2)})
            fast.append(row)
    recall = {}
    for path in args.recall:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        recall[os.path.basename(path)[len("lattice_recall_"):-len(".json")]] = data["recall"]

    any_bench = next(iter(benches.values()))
    result = {
        "method": "sequence-to-lattice (2021) on Multi30k en->de test_2016_flickr",
        "baseline": "examples/baseline transformer (3+3 layers, 256-d), beam 5",
        "baseline_bleu_beam5": baseline_bleu,
        "bleu_from": "fairseq-generate --batch-size 64 on the whole test set (lattice: --task lattice_translation), "
                     "detokenised, sacreBLEU",
        "speed_from": f"fairseq-plugins bench: first {any_bench['sentences']} test sentences, batch 1, "
                      f"{any_bench['threads']} thread(s), median of {any_bench['runs']} runs, lattice decoding and "
                      "the baseline at beam 5 alternating in the same process (bench_bleu: those sentences only)",
        "speed_ratio_definition": any_bench["speed_ratio_definition"],
        "device": any_bench["device"],
        "systems": systems,
        "other_settings": extra,
        "k_sweep": ks,
        "scorer_layers_at_equal_epochs": layers,
        "latency_settings": fast,
        "lattice_recall_test": recall,
        "commands": report.read_provenance([args.commands]),
    }
    with atomic_output(args.out + ".json") as f:
        json.dump(result, f, indent=2, ensure_ascii=False)
        f.write("\n")

    lines = [f"# Sequence-to-lattice on Multi30k en->de ({result['device']})", "",
             f"Baseline transformer, beam 5: BLEU {baseline_bleu:.1f} (whole test set). {result['speed_from']}.", "",
             "| system | targets | layers | epochs | BLEU | gap | speed ratio (min-max) | latency ms | baseline ms | "
             "recall | encoder / lattice / scoring / Viterbi ms |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in systems:
        lines.append(f"| {row['system']} | {row['training_targets']} | {row.get('scorer_layers', '')} | {row['epochs']} | "
                     f"{row['bleu']:.1f} | "
                     f"{row['bleu_gap_vs_baseline_beam5']:.1f} | {report.speed_cell(row) if 'speed_ratio' in row else ''} | "
                     f"{row.get('latency_ms_p50', '')} | {row.get('baseline_latency_ms_p50', '')} | "
                     f"{row.get('lattice_recall', '')} | " + " / ".join(str(row.get(f'{p}_ms', '')) for p in PHASES) + " |")
    lines += report.flag_note_lines([(row["system"], row) for row in systems if "speed_ratio" in row])
    for title, rows in (("Other settings", extra), ("K (distill-1)", ks)):
        if not rows:
            continue
        lines += ["", f"## {title}", "", "| setting | bench BLEU | baseline bench BLEU | speed ratio (min-max) | "
                  "latency ms | baseline ms | recall | encoder / lattice / scoring / Viterbi ms |",
                  "|---|---|---|---|---|---|---|---|"]
        for row in rows:
            lines.append(f"| {row['label']} | {row['bench_bleu']:.1f} | {row['bench_baseline_bleu']:.1f} | "
                         f"{report.speed_cell(row)} | {row['latency_ms_p50']} | {row['baseline_latency_ms_p50']} | "
                         f"{row['lattice_recall']} | " + " / ".join(str(row[f'{p}_ms']) for p in PHASES) + " |")
        lines += report.flag_note_lines([(row["label"], row) for row in rows])
    if fast:
        lines += ["", "## Latency settings (distill-1: K x precision x nrN = --no-repeat-ngram-size N, hoisted scorer)", "",
                  "| setting | batch | BLEU (whole test) | gap | precisions, BP, ratio | speed ratio (min-max) | "
                  "latency ms | baseline ms | encoder / lattice / scoring / Viterbi or search ms |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for row in fast:
            lines.append(f"| {row['label']} | {row['batch_size']} | {row['bleu']:.1f} | "
                         f"{row['bleu_gap_vs_baseline_beam5']:.1f} | "
                         f"{row['bleu_verbose']} | {report.speed_cell(row)} | {row['latency_ms_p50']} | "
                         f"{row['baseline_latency_ms_p50']} | " + " / ".join(str(row[f'{p}_ms']) for p in PHASES) + " |")
        lines += report.flag_note_lines([(row["label"], row) for row in fast])
    if layers:
        lines += ["", f"## Scorer layers after {args.layers_epoch} epochs each (distilled targets; paper Table 3)", "",
                  "| setting | BLEU (whole test) | gap | speed ratio (min-max) | latency ms | baseline ms | "
                  "scoring ms |",
                  "|---|---|---|---|---|---|---|"]
        for row in layers:
            lines.append(f"| {row['label']} | {row['bleu']:.1f} | {row['bleu_gap_vs_baseline_beam5']:.1f} | "
                         f"{report.speed_cell(row)} | {row['latency_ms_p50']} | {row['baseline_latency_ms_p50']} | "
                         f"{row['scoring_ms']} |")
        lines += report.flag_note_lines([(row["label"], row) for row in layers])
    if recall:
        ks_recall = sorted({int(k) for r in recall.values() for k in r})
        lines += ["", "## Lattice recall on test (reference length; paper Fig. 1)", "",
                  "| table | " + " | ".join(f"K={k}" for k in ks_recall) + " |", "|---|" + "---|" * len(ks_recall)]
        for name, r in recall.items():
            lines.append(f"| {name} | " + " | ".join(f"{r[str(k)]:.3f}" for k in ks_recall) + " |")
    lines += ["", "Commands:", "", "```"] + result["commands"] + ["```", ""]
    with atomic_output(args.out + ".md") as f:
        f.write("\n".join(lines))
    if args.plot:
        plot_frontier(systems, fast, args.plot, variant_rows(args.variants))


if __name__ == "__main__":
    main()
