"""Collect examples/bytenet/run.sh's measurements into one JSON (and the time-against-length figure).

Usage: python examples/bytenet/summarize.py WORK RAW_DIR OUT.json
Reads WORK/<system>/{train.log, test.beam*.txt, eval-lm.log, checkpoints/checkpoint_avg.pt (else _best)} of the
systems trained (a language model scored on a device whose checkpoint did not come back: its train.log and
eval-lm.log alone, the parameter count from the log),
WORK/commands.txt, the references of RAW_DIR's test split (the corpus WORK/mt-data was prepared from, in the
languages of WORK/mt-data/prepare.json; Multi30k: test_2016_flickr.de) and the bench JSONs bytenet_length.json and
bytenet_speed.json beside OUT.json. Writes beside OUT.json the figures bytenet_length.png (time against length)
and bytenet_curves.png (validation loss against training time, translation and language models), and
bytenet_translation.md: the translation systems' curves and scores as the Markdown tables of docs/bytenet.md.
"""

import glob
import json
import os
import re
import sys

import torch

from fairseq_plugins.bench import report
from fairseq_plugins.bench.harness import bleu_figures
from fairseq_plugins.common.plots import pyplot, save_png
from fairseq_plugins.tools.prepared import MANIFEST, find_split_prefixes
from fairseq_plugins.common.textio import atomic_output, read_lines

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "results"))
# (a script beside this one, stdlib only)
from training_curves import read_log  # noqa: E402


def checkpoint_figures(checkpoint: str) -> dict:
    """The parameter count of a checkpoint and, for an average, the epoch checkpoints it averages."""
    saved = torch.load(checkpoint, map_location="cpu", weights_only=False)
    # Tied weights (shared embeddings) appear under several names but are one tensor; fairseq also keeps
    # a few non-parameter entries (version counters, sinusoid buffers) in the state dict.
    tensors = {t.data_ptr(): t for k, t in saved["model"].items()
               if t.is_floating_point() and not k.endswith("_float_tensor")}
    figures = {"parameters": sum(t.numel() for t in tensors.values()), "evaluated": os.path.basename(checkpoint)}
    averaged = (saved.get("extra_state") or {}).get("averaged_checkpoints")
    if averaged:
        figures["averaged"] = averaged
    return figures


def logged_parameters(log_path: str):
    """fairseq-train's own parameter count ("num. shared model params"), for a model whose checkpoint is elsewhere."""
    with open(log_path, encoding="utf-8", errors="replace") as f:
        match = re.search(r"num\. (?:shared )?model params: ([\d,]+)", f.read())
    return int(match.group(1).replace(",", "")) if match else None


def training(log_path: str) -> dict:
    """Updates, validations, wall-clock time and the validation curve of a fairseq-train log (``read_log``'s
    record of it: the training since its last start from scratch, a resumed run's log appended): per epoch its
    validation loss and the seconds of training so far at its end, counted across resumes."""
    if not os.path.isfile(log_path):
        raise SystemExit(f"{log_path}: missing: the summary reads the fairseq-train log of every system with a checkpoint")
    record = read_log(log_path)
    curve = [{"epoch": point["epoch"], "valid_loss_base2": point["loss"], "wall_seconds": point["wall_seconds"]}
             for point in record["curve"] if point["wall_seconds"] is not None]
    return {
        # (a GPU training's log names its device; a CPU training ran here, on this project's machines)
        "device": record["device"].get("name") if "capability" in record["device"]
        else report.device_name(torch.device("cpu")),
        "stopped_by": record["stopped_by"],
        "best_epoch": record["best_epoch"],
        "updates": record["updates"] or 0,
        "validations": len(record["validations"]),
        "wall_seconds": record["train_seconds"],
        "valid_loss_base2": [validation["loss"] for validation in record["validations"]],
        "curve": curve,
    }


SIDE_FIGURES = ("bleu", "sentences_per_s", "latency_ms_p50", "hypothesis_length")  # each side's, of a bench
CTRANSLATE2_FIGURES = ("compute_type", "version", "bleu", "sentences_per_s", "outputs_identical_to_stock")


def speed_against_transformer(path: str):
    """ByteNet against the character transformer timed in one run (the bench stage's bytenet_speed.json,
    --baseline-path): the speed ratio (transformer time / ByteNet time) with its runs and flags, and both sides'
    BLEU on the sentences timed; None without such a bench."""
    if not os.path.isfile(path):
        return None
    runs = [r for r in report.load_results(path) if r["method"] == "bytenet"
            and r.get("baseline_checkpoint") not in (None, r.get("checkpoint"))]
    if not runs:
        return None
    result = runs[-1]
    figures = report.speed_figures(result)
    return {
        "speed_ratio": result["speed_ratio"], "speed_ratio_min": result["speed_ratio_min"],
        "speed_ratio_max": result["speed_ratio_max"], "speed_ratio_runs": result["speed_ratio_runs"],
        "speed_ratio_flags": figures["speed_ratio_flags"],
        "definition": "transformer time / ByteNet time on the same sentences, one process, alternating batch by "
                      "batch (the bench's speed ratio with the transformer as its stock side)",
        "beam": result["beam"], "batch_size": result["batch_size"], "threads": result["threads"],
        "sentences": result["sentences"], "device": result["device"],
        "bytenet": {key: result[key] for key in SIDE_FIGURES},
        "transformer": {key: result["baseline"][key] for key in SIDE_FIGURES},
        # CTranslate2 on the transformer in the same runs (bench --reference ctranslate2): CTranslate2 time /
        # ByteNet time, with its compute type and how many of its outputs are the transformer's stock ones
        "ctranslate2": ({**report.speed_figures(report.reference_ratio(result)),
                         **{key: result["ctranslate2"][key] for key in CTRANSLATE2_FIGURES}}
                        if result.get("ctranslate2") else None),
    }


def bleu(hypotheses: str, references: list) -> dict:
    """sacreBLEU with its signature, brevity penalty, precisions and output/reference length ratio."""
    return bleu_figures(read_lines(hypotheses, allow_empty_lines=True), references)


def bits_per_character(log_path: str):
    if not os.path.isfile(log_path):
        return None  # not evaluated (yet)
    with open(log_path, encoding="utf-8", errors="replace") as f:
        match = re.search(r"Loss \(base 2\): ([\d.]+)", f.read())
    if not match:
        raise SystemExit(f"{log_path}: no 'Loss (base 2)' line (did fairseq-eval-lm finish?)")
    return float(match.group(1))


CACHED_SPEEDUP_DEFINITION = (
    "recompute time / cached time on the same sentences, from the bench result's speed ratio (stock time / "
    "method time, the median of the paired runs' ratios): its inverse where the stock generator is the cached "
    "side (--bytenet-decoding recompute on the method side), itself where the stock generator runs without its "
    "cache (--baseline-no-cache); min-max over runs"
)


def _cached_side(result: dict):
    """(cached figures, recomputed figures or None, whether the speed ratio must be inverted) of a length bench."""
    method_recomputes = result["generator"].get("task_flags", {}).get("bytenet_decoding", "cached") == "recompute"
    stock_recomputes = "no cache" in result["baseline"]["generator"]["description"]
    if method_recomputes and not stock_recomputes:
        return result["baseline"], result, True
    if stock_recomputes and not method_recomputes:
        return result, result["baseline"], False
    return result["baseline"], None, False  # cached against cached: no speedup to state


def length_scaling(bench_json: str) -> dict:
    if not os.path.isfile(bench_json):
        return {}
    results = report.load_results(bench_json)
    if not results:
        return {}  # an empty list: the bench stage started the file and timed nothing
    rows = {}
    for result in results:
        length = result["generator"]["min_len"]
        cached, recomputed, invert = _cached_side(result)
        rows[length] = {
            "output_characters": length,
            "cached_seconds_per_sentence": 1 / cached["sentences_per_s"],
            "cached_ms_per_character": 1000 / cached["sentences_per_s"] / length,
        }
        if recomputed is not None:
            ratio, low, high = result["speed_ratio"], result["speed_ratio_min"], result["speed_ratio_max"]
            rows[length].update({
                "recompute_seconds_per_sentence": 1 / recomputed["sentences_per_s"],
                "cached_speedup": 1 / ratio if invert else ratio,
                "cached_speedup_min": 1 / high if invert else low,
                "cached_speedup_max": 1 / low if invert else high,
                "speed_ratio": ratio,
                "speed_ratio_spread": result["speed_ratio_spread"],
                "flags": report.flag_reasons(result),  # why the ratio should not be taken at face value
                "runs": len(result["speed_ratio_runs"]),
            })
    summary = {"by_length": [rows[k] for k in sorted(rows)], "device": result["device"], "threads": result["threads"],
               "cached_speedup_definition": CACHED_SPEEDUP_DEFINITION}
    if 200 in rows and 800 in rows:
        summary["time_800_over_200"] = rows[800]["cached_seconds_per_sentence"] / rows[200]["cached_seconds_per_sentence"]
    return summary


def plot_length(summary: dict, path: str) -> None:
    plt = pyplot()

    rows = summary["by_length"]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.plot([r["output_characters"] for r in rows], [r["cached_seconds_per_sentence"] for r in rows], "o-",
            label="cached (incremental_state)")
    recomputed = [r for r in rows if "recompute_seconds_per_sentence" in r]
    ax.plot([r["output_characters"] for r in recomputed], [r["recompute_seconds_per_sentence"] for r in recomputed],
            "s--", label="recomputed every step")
    ax.set_xlabel("output length (characters)")
    ax.set_ylabel("seconds per sentence")
    ax.set_title(f"ByteNet decoding time, {summary['device']}, {summary['threads']} thread(s)", fontsize=9)
    ax.legend()
    fig.tight_layout()
    save_png(fig, path, dpi=120)


def plot_curves(result: dict, path: str) -> None:
    """Validation loss (base 2) against training time, one panel for the translation systems and one for the
    language models: each point an epoch's end, at fairseq's training seconds counted across resumes (a cool-down's
    after its source's)."""
    panels = [(title, systems) for title, systems in (
        ("character MT (Multi30k en-de valid)", result["translation"]),
        ("character LM (Tiny Shakespeare valid)", result["language_model"])) if any(
            system["training"]["curve"] for system in systems.values())]
    if not panels:
        return
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 3.8), squeeze=False)
    for ax, (title, systems) in zip(axes[0], panels):
        for name, system in systems.items():
            curve, start = system["training"]["curve"], system["training"].get("source_wall_seconds") or 0
            if curve:
                ax.plot([(start + point["wall_seconds"]) / 3600 for point in curve],
                        [point["valid_loss_base2"] for point in curve], "o-", markersize=3,
                        label=f"{name} ({system['training']['device']})")
        ax.set_xlabel("training time (hours)")
        ax.set_ylabel("validation loss (bits per character)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=6)
    fig.tight_layout()
    save_png(fig, path, dpi=120)


def _averaged_epochs(system: dict) -> str:
    """"epochs 11-15" for an average of consecutive epoch checkpoints, else the files' names."""
    averaged = system.get("averaged")
    if not averaged:
        return system["evaluated"]
    epochs = [int(m.group(1)) for m in (re.fullmatch(r"checkpoint(\d+)\.pt", os.path.basename(n)) for n in averaged) if m]
    if len(epochs) == len(averaged) and epochs == list(range(epochs[0], epochs[0] + len(epochs))):
        return f"epochs {epochs[0]}-{epochs[-1]}" if len(epochs) > 1 else f"epoch {epochs[0]}"
    return ", ".join(os.path.basename(n) for n in averaged)


def _bleu_cell(figures: dict) -> str:
    precisions = "/".join(f"{p:.1f}" for p in figures["bleu_precisions"])
    return (f"{figures['bleu']:.2f} ({precisions}, BP {figures['bleu_brevity_penalty']:.3f}, "
            f"ratio {figures['length_ratio']:.3f})")


def _decoding_label(run: str) -> str:
    beam, lenpen = re.fullmatch(r"beam(\d+)_lenpen(.+)", run).groups()
    return "greedy" if beam == "1" else f"beam {beam}, lenpen {lenpen}"


def _minutes_from_source_start(training: dict, seconds) -> float:
    """Training minutes counted from the start of the source's training (a cool-down goes on from its source's)."""
    return ((training.get("source_wall_seconds") or 0) + (seconds or 0)) / 60


def translation_markdown(result: dict) -> str:
    """The translation part of a summary as Markdown, for docs/bytenet.md: each system's validation curve with
    the training minutes at each epoch's end (best in bold; a cool-down's epochs after its source's, its minutes
    counted on from the source's), then each system's scores (sacreBLEU with precisions, brevity penalty and
    output/reference length ratio) and the speed of ByteNet against the transformer where the bench timed it."""
    systems = result["translation"]
    if not systems:
        return ""
    sources = [name for name in systems if not name.endswith("-anneal")]

    def cells(name, epoch):
        system = systems.get(name)
        training = system["training"] if system else {}
        point = next((p for p in training.get("curve", []) if p["epoch"] == epoch), None)
        if point is None:
            return ["", ""]
        loss = f"{point['valid_loss_base2']:.3f}"
        if min(p["valid_loss_base2"] for p in training["curve"]) == point["valid_loss_base2"]:
            loss = f"**{loss}**"
        return [loss, f"{_minutes_from_source_start(training, point['wall_seconds']):.0f}"]

    header = ["epoch"] + [f"`{name}` {column}" for name in sources
                          for column in ("validation loss (base 2)", "training minutes")]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    last = max((p["epoch"] for n in sources for p in systems[n]["training"]["curve"]), default=0)
    for epoch in range(1, last + 1):
        lines.append("| " + " | ".join([str(epoch)] + [c for n in sources for c in cells(n, epoch)]) + " |")
    cool_last = max((p["epoch"] for n in sources if f"{n}-anneal" in systems
                     for p in systems[f"{n}-anneal"]["training"]["curve"]), default=0)
    for epoch in range(1, cool_last + 1):
        lines.append("| " + " | ".join([f"cool-down {epoch}"] + [c for n in sources
                                                                 for c in cells(f"{n}-anneal", epoch)]) + " |")

    runs = sorted({key for system in systems.values() for key in system if re.fullmatch(r"beam\d+_lenpen.+", key)},
                  key=lambda run: (run.startswith("beam1_"), run))
    header = ["system", "parameters", "evaluated", "training minutes; stopped by"] + [
        f"BLEU {_decoding_label(run)}" for run in runs]
    lines += ["", "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for name, system in systems.items():
        training = system["training"]
        row = [f"`{name}`", f"{system['parameters'] / 1e6:.2f}M", _averaged_epochs(system),
               f"{_minutes_from_source_start(training, training['wall_seconds']):.0f}; {training['stopped_by']}"]
        row += [_bleu_cell(system[run]) if run in system else "-" for run in runs]
        lines.append("| " + " | ".join(row) + " |")
    signatures = sorted({system[run]["bleu_signature"] for system in systems.values() for run in runs if run in system})
    if signatures:
        lines += ["", f"sacreBLEU signature: `{'`, `'.join(signatures)}`."]
    speed = result.get("speed_against_transformer")
    if speed:
        lines += ["", f"Speed, {speed['definition']}: **{speed['speed_ratio']:.2f}** ({speed['speed_ratio_min']:.2f}-"
                      f"{speed['speed_ratio_max']:.2f}; runs {', '.join(f'{r:.2f}' for r in speed['speed_ratio_runs'])}"
                      f"{'; flagged: ' + ', '.join(speed['speed_ratio_flags']) if speed['speed_ratio_flags'] else ''}), "
                      f"beam {speed['beam']}, batch {speed['batch_size']}, {speed['threads']} thread(s), "
                      f"{speed['sentences']} sentences, {speed['device']}; ByteNet {speed['bytenet']['sentences_per_s']:.2f} "
                      f"sentences/s, the transformer {speed['transformer']['sentences_per_s']:.2f}."]
        reference = speed.get("ctranslate2")
        if reference:
            lines += ["", f"Against CTranslate2 {reference['compute_type']} ({reference['version']}) decoding the "
                          f"transformer in the same runs (CTranslate2 time / ByteNet time): "
                          f"**{report.speed_cell(reference)}**; CTranslate2 "
                          f"{reference['sentences_per_s']:.2f} sentences/s, BLEU {reference['bleu']:.2f}, its outputs "
                          f"the transformer's stock ones on {100 * reference['outputs_identical_to_stock']:.0f}% of "
                          "the sentences."]
    return "\n".join(lines) + "\n"


def test_split_references(work: str, raw_dir: str) -> (str, list):
    """The test split's file stem in ``raw_dir`` and its target side, found as `fairseq-plugins prepare` found
    them for WORK/mt-data (same languages, same split names: Multi30k's test_2016_flickr, else test)."""
    with open(os.path.join(work, "mt-data", MANIFEST), encoding="utf-8") as f:
        manifest = json.load(f)
    prefix = find_split_prefixes(raw_dir, manifest["source_lang"], manifest["target_lang"], {})["test"]
    return os.path.basename(prefix), read_lines(f"{prefix}.{manifest['target_lang']}")


MT_SYSTEMS = ("bytenet-mt", "transformer-mt", "bytenet-mt-anneal", "transformer-mt-anneal")
LM_SYSTEMS = ("bytenet-lm", "bytenet-lm-d25", "bytenet-lm-deep", "bytenet-lm-deep-reg", "bytenet-lm-deep-layerdrop",
              "bytenet-lm-deep-512", "bytenet-lm-wide", "bytenet-lm-deep-wide", "bytenet-lm-deep-wide-d50",
              "bytenet-lm-deep-anneal", "bytenet-lm-deep-reg-anneal", "transformer-lm", "nanogpt-lm")


def final_checkpoint(work: str, name: str):
    """What the recipe's later stages use: the average of the last epochs (the average stage), else the best
    checkpoint; None for a system not trained."""
    for candidate in ("checkpoint_avg.pt", "checkpoint_best.pt"):
        path = os.path.join(work, name, "checkpoints", candidate)
        if os.path.isfile(path):
            return path
    return None


def main(work: str, raw_dir: str, out: str) -> None:
    test_name, references = test_split_references(work, raw_dir)
    result = {"translation": {}, "language_model": {}}
    for name in MT_SYSTEMS:
        checkpoint = final_checkpoint(work, name)
        if checkpoint is None:
            continue  # not trained (yet)
        system = {**checkpoint_figures(checkpoint), "training": training(f"{work}/{name}/train.log")}
        for path in sorted(glob.glob(f"{work}/{name}/test.beam*.txt")):
            # test.beam12.txt: --lenpen 0; test.beam12.lenpen1.txt: --lenpen 1
            found = re.search(r"test\.beam(\d+)(?:\.lenpen(-?[0-9.]+))?\.txt$", path)
            if not found:
                continue  # not an evaluate-mt output
            if os.path.getmtime(path) < os.path.getmtime(checkpoint):
                # e.g. a beam no longer in BEAM/BEAM_LENPENS, from a checkpoint since averaged or cooled anew
                print(f"{path}: older than {checkpoint}, so not its translation: not scored "
                      f"(the evaluate-mt stage writes it anew)", file=sys.stderr)
                continue
            run = f"beam{found.group(1)}_lenpen{found.group(2) or 0}"
            figures = bleu(path, references)
            system[f"bleu_{run}"] = figures["bleu"]
            system[run] = figures
        result["translation"][name] = system
    for name in LM_SYSTEMS:
        checkpoint, log = final_checkpoint(work, name), f"{work}/{name}/train.log"
        scored_elsewhere = checkpoint is None and os.path.isfile(log) and os.path.isfile(f"{work}/{name}/eval-lm.log")
        if checkpoint is None and not scored_elsewhere:
            continue
        result["language_model"][name] = {
            **(checkpoint_figures(checkpoint) if checkpoint else {
                "evaluated": "checkpoint_avg.pt (where it was trained; not kept)",
                "parameters": logged_parameters(log)}),
            "training": training(log),
            "valid_bits_per_character": bits_per_character(f"{work}/{name}/eval-lm.log"),
        }
    for systems in result.values():  # a cool-down ("-anneal") trains on from its source's time
        for name, system in systems.items():
            source = systems.get(name[:-len("-anneal")]) if name.endswith("-anneal") else None
            if source:
                system["training"].update(cool_down_of=name[:-len("-anneal")],
                                          source_wall_seconds=source["training"]["wall_seconds"])
    results_dir = os.path.dirname(out) or "."
    result["length_scaling"] = length_scaling(os.path.join(results_dir, "bytenet_length.json"))
    result["speed_against_transformer"] = speed_against_transformer(os.path.join(results_dir, "bytenet_speed.json"))
    if result["length_scaling"]:
        plot_length(result["length_scaling"], os.path.join(results_dir, "bytenet_length.png"))
    plot_curves(result, os.path.join(results_dir, "bytenet_curves.png"))
    with atomic_output(os.path.join(results_dir, "bytenet_translation.md")) as f:
        f.write(translation_markdown(result))
    result.update({
        "bleu": f"sacreBLEU on {test_name} (detokenised characters, default signature)",
        "bits_per_character": "fairseq-eval-lm loss (base 2) on Tiny Shakespeare valid: one token per character, "
                              "newlines included; --tokens-per-sample 256 --context-window 192",
        "commands": read_lines(os.path.join(work, "commands.txt")),
        "device": report.device_name(torch.device("cpu")),  # where this summary ran; each training names its own
        "git_commit": report.git_commit(),
        "versions": report.versions(),
    })
    with atomic_output(out) as f:
        json.dump(result, f, indent=2)
        f.write("\n")
    print(json.dumps({k: result[k] for k in ("translation", "language_model")}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])
