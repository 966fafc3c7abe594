"""Collect examples/double_token/run.sh's measurements into the paper's Table 2 (and the Fig. 3 plot).

Reads WORK/<system>/bleu.beamB.json (sacreBLEU on the whole test set, stage evaluate), the bench results of
stage bench (each system against single-token L2R decoded in the same run) and of stage beams, and
WORK/commands.txt. Writes OUT.json, OUT.md and, with --beams, OUT_beams.png.

The speed figure is the bench result's speed ratio: single-token L2R time / the system's time on the same
sentences, the median of the runs' ratios, with their min-max; a spread over 10% of the median (and every other
reason `fairseq-plugins report` flags) is marked. Tokens/s (the paper's measure, which rewards longer outputs)
is a secondary column.
"""

import argparse
import json
import os

from fairseq_plugins.bench import report
from fairseq_plugins.common.plots import pyplot, save_png
from fairseq_plugins.common.textio import atomic_output


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", required=True)
    p.add_argument("--beam", type=int, required=True)
    p.add_argument("--systems", nargs="+", required=True)
    p.add_argument("--bench", required=True, help="bench JSON of stage bench")
    p.add_argument("--beams", help="bench JSON of stage beams")
    p.add_argument("--stock-bleu", help="sacreBLEU JSON of the stock baseline transformer at the same beam and flags "
                                         "(stage evaluate): a row and the l2r-1 target's reference")
    p.add_argument("--batch-sizes", nargs="*", type=int, default=[],
                   help="bench batch sizes besides 1 (labelled 'SYSTEM batch N' in --bench): a speed column each")
    p.add_argument("--commands", required=True)
    p.add_argument("--out", required=True, help="output path without extension")
    args = p.parse_args()

    benches = {r["label"]: r for r in report.load_results(args.bench)}
    rows = []
    for system in args.systems:
        with open(os.path.join(args.work, system, f"bleu.beam{args.beam}.json"), encoding="utf-8") as f:
            bleu = json.load(f)
        row = {"system": system, **bleu_figures(bleu)}
        for batch in args.batch_sizes:
            if f"{system} batch {batch}" in benches:
                row.update({f"{key}_vs_l2r_1_batch_{batch}": value
                            for key, value in report.speed_figures(benches[f"{system} batch {batch}"]).items()})
        if system in benches:
            r = benches[system]
            row.update({f"{key}_vs_l2r_1": value for key, value in report.speed_figures(r).items()})
            row.update({
                "tokens_per_s": round(r["tokens_per_s"], 1),
                "l2r_1_tokens_per_s": round(r["baseline"]["tokens_per_s"], 1),
                "tokens_per_s_ratio_vs_l2r_1": round(r["ratios"]["tokens_per_s"], 3),  # secondary
                "sentences_per_s_ratio_vs_l2r_1": round(r["ratios"]["sentences_per_s"], 3),
                # Counted by the double-token generator only (fairseq's makes one call per output position).
                "decoder_invocations_per_sentence": (round(r["stats"]["decoder_invocations"] / r["stats"]["sentences"], 2)
                                                     if "decoder_invocations" in r["stats"] else None),
                "bench_sentences": r["sentences"], "bench_bleu": r["bleu"], "bench_l2r_1_bleu": r["baseline"]["bleu"],
            })
        rows.append(row)
    l2r = next((row["bleu"] for row in rows if row["system"] == "l2r-1"), None)
    for row in rows:
        row["bleu_delta_vs_l2r_1"] = round(row["bleu"] - l2r, 2) if l2r is not None else None
    stock = None
    if args.stock_bleu:
        with open(args.stock_bleu, encoding="utf-8") as f:
            stock = {"system": "stock transformer (baseline)", **bleu_figures(json.load(f))}
        stock["bleu_delta_vs_l2r_1"] = round(stock["bleu"] - l2r, 2) if l2r is not None else None

    any_bench = next(iter(benches.values()))
    result = {
        "table": "Imamura & Sumita 2020, Table 2, on Multi30k en->de test_2016_flickr",
        "beam": args.beam,
        "bleu_from": "fairseq-generate --beam B --batch-size 64 on the whole test set, detokenised, sacreBLEU",
        "speed_from": f"fairseq-plugins bench: {any_bench['sentences']} test sentences, batch 1, "
                      f"{any_bench['threads']} thread(s), median of {any_bench['runs']} runs, each system and "
                      "single-token L2R alternating in the same process",
        "speed_ratio_definition": any_bench["speed_ratio_definition"],
        "device": any_bench["device"],
        "rows": rows,
        "stock_baseline": stock,
        "commands": report.read_provenance([args.commands]),
    }
    if args.beams and os.path.isfile(args.beams):
        sweep = sorted(report.load_results(args.beams), key=lambda r: r["beam"])
        result["speed_ratio_against_beam"] = [
            {"label": r["label"], "beam": r["beam"], **report.speed_figures(r),
             "tokens_per_s_ratio": round(r["ratios"]["tokens_per_s"], 3),
             "sentences_per_s_ratio": round(r["ratios"]["sentences_per_s"], 3), "tokens_per_s": round(r["tokens_per_s"], 1),
             "l2r_1_tokens_per_s": round(r["baseline"]["tokens_per_s"], 1), "bleu": r["bleu"],
             "l2r_1_bleu": r["baseline"]["bleu"], "sentences": r["sentences"]} for r in sweep]
        plot_beams(result["speed_ratio_against_beam"], args.out + "_beams.png")

    with atomic_output(args.out + ".json") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    batch_columns = [batch for batch in args.batch_sizes if any(f"speed_ratio_vs_l2r_1_batch_{batch}" in row
                                                                 for row in rows)]
    lines = [f"| system (beam {args.beam}) | BLEU | vs l2r-1 | length ratio | speed ratio vs l2r-1 (min-max) | "
             + "".join(f"at batch {batch} | " for batch in batch_columns)
             + "tokens/s | l2r-1 tokens/s | tokens/s ratio | decoder calls/sentence |",
             "|---|---:|---:|---:|---:|" + "---:|" * len(batch_columns) + "---:|---:|---:|---:|"]

    def speed(row, suffix=""):
        if f"speed_ratio_vs_l2r_1{suffix}" not in row:
            return ""
        return report.speed_cell({key: row[f"{key}_vs_l2r_1{suffix}"] for key in report.SPEED_KEYS})

    for row in rows + ([stock] if stock else []):
        lines.append(f"| {row['system']} | {row['bleu']:.1f} | {row['bleu_delta_vs_l2r_1']:+.1f} | "
                     f"{row['length_ratio']:.3f} | {speed(row)} | "
                     + "".join(f"{speed(row, f'_batch_{batch}')} | " for batch in batch_columns)
                     + f"{row.get('tokens_per_s', '')} | {row.get('l2r_1_tokens_per_s', '')} | "
                     f"{row.get('tokens_per_s_ratio_vs_l2r_1', '')} | "
                     f"{row.get('decoder_invocations_per_sentence') or ''} |")
    lines += report.flag_note_lines(
        [(row["system"] + (f" batch {batch}" if batch != 1 else ""),
          {key: row[f"{key}_vs_l2r_1{'' if batch == 1 else f'_batch_{batch}'}"] for key in report.SPEED_KEYS})
         for batch in [1] + batch_columns for row in rows
         if f"speed_ratio_vs_l2r_1{'' if batch == 1 else f'_batch_{batch}'}" in row])
    sweep = result.get("speed_ratio_against_beam")
    if sweep:
        label = sweep[0]["label"]
        lines += ["", f"Speed ratio against beam width ({label} vs l2r-1, first {sweep[0]['sentences']} test "
                  "sentences; paper Fig. 3):", "",
                  f"| beam | speed ratio (min-max) | tokens/s ratio | BLEU {label} / l2r-1 |", "|---:|---:|---:|---:|"]
        for point in sweep:
            lines.append(f"| {point['beam']} | {report.speed_cell(point)} | {point['tokens_per_s_ratio']} | "
                         f"{point['bleu']:.1f} / {point['l2r_1_bleu']:.1f} |")
        lines += report.flag_note_lines([(f"beam {point['beam']}", point) for point in sweep])
    with atomic_output(args.out + ".md") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def bleu_figures(bleu: dict) -> dict:
    """BLEU, its brevity penalty, precisions and length ratio from sacreBLEU's JSON (-m bleu)."""
    # verbose_score: "69.0/44.6/31.0/21.5 (BP = 0.995 ratio = 0.995 hyp_len = 12051 ref_len = 12106)"
    precisions, _, rest = bleu["verbose_score"].partition(" (")
    fields = dict(zip(rest.rstrip(")").split()[::3], rest.rstrip(")").split()[2::3]))
    return {"bleu": bleu["score"], "bleu_signature": bleu.get("signature"), "precisions": precisions,
            "brevity_penalty": float(fields["BP"]), "length_ratio": float(fields["ratio"]),
            "hyp_len": int(fields["hyp_len"]), "ref_len": int(fields["ref_len"])}


def plot_beams(sweep, path):
    plt = pyplot()

    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.errorbar([s["beam"] for s in sweep], [s["speed_ratio"] for s in sweep],
                yerr=[[s["speed_ratio"] - s["speed_ratio_min"] for s in sweep],
                      [s["speed_ratio_max"] - s["speed_ratio"] for s in sweep]], marker="o", capsize=3)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks([s["beam"] for s in sweep], [str(s["beam"]) for s in sweep])
    ax.set_xlabel("beam width")
    ax.set_ylabel(f"l2r-1 time / {sweep[0]['label']} time, same sentences")
    ax.set_title("Speed ratio against beam width (paper Fig. 3)\nmedian of the runs' ratios, bars: min-max", fontsize=9)
    fig.tight_layout()
    save_png(fig, path, dpi=120)


if __name__ == "__main__":
    main()
