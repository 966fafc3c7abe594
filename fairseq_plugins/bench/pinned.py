"""The pinned model set (docs/results/models.json): every model the README's and the method pages' figures use,
named by its sha256, with the recipe command that trains it, its data, date and validation curve.

A bench result records the sha256 of the checkpoints it measured (``hashes``, docs/bench.md); ``report`` shows a
result only when both are in the set, shows results measured before hashes were recorded as "from an unpinned
model set", and refuses a result whose hashes are recorded but pinned nowhere. ``report --check-models`` hashes
the pinned files present on this machine and fails naming each model whose file no longer matches its pin. A model
``superseded_by`` another (an earlier model under a path that now holds a retrained, pinned one) keeps the names of
its figures and is neither hashed nor required.

A checkpoint file holds more than the model (training meters with wall-clock times, the optimiser's state), so a
recipe retrained on a new machine writes another file even where it writes the same weights. A model's
``weights_sha256`` is the hash of its weights alone (``provenance.weights_sha256``); a retrained file with those
weights is the same model, and its file hash goes into the model's ``retrained`` list ({"sha256", "date",
"evidence"}), so figures measured on either file are that model's.
"""

import os
import re
from typing import Dict, List, Optional, Tuple

from ..common.textio import InputError, read_json
from .provenance import SHORT_HASH, file_sha256, weights_sha256

MODELS_FILE = os.path.join("docs", "results", "models.json")
UNPINNED = "unpinned"
PINNED = "pinned"
REQUIRED_KEYS = ("name", "what", "path", "recipe", "data", "date", "sha256")


def load_models(path: str) -> Dict:
    """models.json, checked: a list of models, each with REQUIRED_KEYS, names unique, sha256 64 hex digits or
    null (with the reason in ``sha256_note``)."""
    data = read_json(path, "pinned model set")
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, list) or not models:
        raise InputError(f"{path}: needs a non-empty list 'models'")
    names = set()
    for number, model in enumerate(models):
        missing = [key for key in REQUIRED_KEYS if not isinstance(model, dict) or key not in model]
        if missing:
            raise InputError(f"{path}: model {number} lacks {', '.join(missing)}")
        if model["name"] in names:
            raise InputError(f"{path}: model name {model['name']!r} is pinned twice")
        names.add(model["name"])
        digest = model["sha256"]
        if digest is None and not model.get("sha256_note"):
            raise InputError(f"{path}: model {model['name']!r} has no sha256 and no sha256_note saying why")
        if digest is not None and not re.fullmatch(r"[0-9a-f]{64}", str(digest)):
            raise InputError(f"{path}: model {model['name']!r}: sha256 must be 64 lowercase hex digits or null")
        weights = model.get("weights_sha256")
        if weights is not None and not re.fullmatch(r"[0-9a-f]{64}", str(weights)):
            raise InputError(f"{path}: model {model['name']!r}: weights_sha256 must be 64 lowercase hex digits")
        retrained = model.get("retrained", [])
        if (weights is not None or retrained) and digest is None:
            raise InputError(f"{path}: model {model['name']!r}: weights_sha256 and 'retrained' go with a recorded "
                             "sha256 (the file they were taken from)")
        if not isinstance(retrained, list) or not all(
                isinstance(copy, dict) and re.fullmatch(r"[0-9a-f]{64}", str(copy.get("sha256")))
                and copy.get("date") and copy.get("evidence") for copy in retrained):
            raise InputError(f"{path}: model {model['name']!r}: 'retrained' must list files of the same weights, "
                             "each {\"sha256\": 64 hex digits, \"date\": ..., \"evidence\": why they are the same}")
        files = file_hashes(model)
        if len(set(files)) != len(files):
            raise InputError(f"{path}: model {model['name']!r}: a file sha256 is listed twice (its pin and "
                             "'retrained')")
    return data


def file_hashes(model: Dict) -> List[str]:
    """The sha256 of every file that holds this model: its pin, then its retrained copies'."""
    return ([model["sha256"]] if model["sha256"] else []) + [copy["sha256"] for copy in model.get("retrained", [])]


def pinned_hashes(models: Dict) -> Dict[str, str]:
    """sha256 -> model name, for every file of a model whose hash is recorded (retrained copies included)."""
    return {digest: model["name"] for model in models["models"] for digest in file_hashes(model)}


def work_path(path: Optional[str]) -> Optional[str]:
    """A checkpoint path as the recipes name it, relative to the repository (``work/...``), whichever machine's
    absolute path a result recorded (``/work/main/work/baseline/...``, ``/root/work/...``)."""
    if not path:
        return path
    path = path.replace(os.sep, "/")
    starts = [m.start(1) for m in re.finditer(r"(?:^|/)(work/)", path)]
    return path[starts[-1]:] if starts else path


def model_set(result: Dict, models: Optional[Dict]) -> str:
    """PINNED when both checkpoints' hashes are in the set, UNPINNED when the result recorded no hashes (measured
    before they were); a result with hashes outside the set raises (``refused``)."""
    hashes = result.get("hashes")
    if not hashes:
        return UNPINNED
    problem = refused(result, models)
    if problem:
        raise InputError(problem)
    return PINNED


def refused(result: Dict, models: Optional[Dict], where: str = "") -> Optional[str]:
    """Why a result with recorded hashes cannot be shown (a checkpoint pinned nowhere), or None."""
    hashes = result.get("hashes")
    if not hashes:
        return None
    known = pinned_hashes(models) if models else {}
    label = result.get("label") or result.get("method")
    for role in ("checkpoint", "baseline_checkpoint"):
        digest = hashes.get(role)
        if digest not in known:
            return (f"{where}{label}: its {role.replace('_', ' ')} (sha256 {str(digest)[:SHORT_HASH]}..., "
                    f"{result.get(role)}) is not in the pinned model set {MODELS_FILE}: re-measure it from the "
                    "pinned models (make results) or pin that model (its recipe command, data, date, curve and "
                    "sha256) before it goes into a generated block")
    return None


def stock_side_key(result: Dict) -> Tuple[str, str]:
    """(kind, key) identifying the stock side of a result: ("sha256", hash) when recorded, else ("path", its
    work path): results are grouped by it, and a BLEU delta is against it."""
    hashes = result.get("hashes") or {}
    if hashes.get("baseline_checkpoint"):
        return "sha256", hashes["baseline_checkpoint"]
    return "path", work_path(result.get("baseline_checkpoint")) or "?"


def results_name(path: str) -> str:
    """A results file as models.json's "figures" name it: relative to docs/results (``gpu/lattice.json``)."""
    path = path.replace(os.sep, "/")
    return path.split("docs/results/", 1)[1] if "docs/results/" in path else os.path.basename(path)


def model_paths(model: Dict) -> List[str]:
    """Where a pinned model was read from: its path, and the other paths a copy of it was benched under."""
    return [work_path(model["path"])] + [work_path(other.split(" (")[0]) for other in model.get("other_paths", [])]


def figure_files(model: Dict) -> List[str]:
    """The results files a model's "figures" entry names (each word ending in .json)."""
    return [word.strip("(),;") for text in model.get("figures", []) for word in text.split()
            if word.strip("(),;").endswith(".json")]


def model_name(result: Dict, role: str, models: Optional[Dict], results_file: Optional[str] = None) -> str:
    """The pinned name of a result's checkpoint (role "checkpoint" or "baseline_checkpoint"): by hash when the
    result recorded one; else (an unpinned result) by path, and only where models.json lists the result's file
    among that model's figures, since a path held other models at other times; else the path itself."""
    digest = (result.get("hashes") or {}).get(role)
    if digest and models:
        name = pinned_hashes(models).get(digest)
        if name:
            return name
    path = work_path(result.get(role))
    for model in (models or {}).get("models", []):
        if path in model_paths(model) and results_file and results_name(results_file) in figure_files(model):
            return model["name"]
    return path or "?"


def model_file(model: Dict, root: str) -> str:
    """Where a pinned model's file is on this machine: its path, relative to the checkout ``root``."""
    return model["path"] if os.path.isabs(model["path"]) else os.path.join(root, model["path"])


def check_models(models: Dict, root: str, require_all: bool = False,
                 required: Optional[List[str]] = None) -> Tuple[List[str], List[str]]:
    """Hash every pinned model's file present under ``root``. Returns (lines to print, problems): a file whose
    sha256 differs from its pin is a problem; with ``require_all`` (before re-measuring) so is a missing file or
    a model whose hash was never recorded, or with ``required`` (the models some rows need) for those alone:
    then another model's changed file is only reported, since make retrain may be training it under its path."""
    names = {model["name"] for model in models["models"]}
    unknown = [name for name in required or [] if name not in names]
    if unknown:
        raise InputError(f"--require-models {','.join(unknown)}: not in the pinned model set ({', '.join(names)})")
    lines, problems = [], []
    for model in models["models"]:
        require = require_all or model["name"] in (required or [])
        checked = require or not required  # a changed file fails the check, unless other models are required
        if model.get("superseded_by"):  # an earlier model under a path that now holds another: nothing to hash
            kept = (f"its figures stay pinned to its sha256 {model['sha256'][:SHORT_HASH]}..." if model["sha256"]
                    else "its figures stay from an unpinned model set")
            lines.append(f"{model['name']}: superseded by {model['superseded_by']} ({kept} until re-measured)")
            continue
        path = model_file(model, root)
        if not os.path.isfile(path):
            line = f"{model['name']}: {model['path']} is not on this machine"
            if require:
                problems.append(line + f" (train it: {model['recipe']})")
            lines.append(line)
            continue
        actual = file_sha256(path)
        if model["sha256"] is None:
            line = (f"{model['name']}: {model['path']} has sha256 {actual}{_weights_note(path)}, but models.json "
                    f"records none ({model.get('sha256_note')})")
            if require:
                problems.append(line + ": pin it first")
            lines.append(line)
            continue
        if actual == model["sha256"]:
            unrecorded = "" if model.get("weights_sha256") else _weights_note(path, "; not in models.json yet")
            lines.append(f"{model['name']}: {model['path']} matches its pin ({actual[:SHORT_HASH]}...){unrecorded}")
            continue
        if actual in file_hashes(model):
            (copy,) = [c for c in model["retrained"] if c["sha256"] == actual]
            lines.append(f"{model['name']}: {model['path']} matches its pin's copy retrained {copy['date']} "
                         f"({actual[:SHORT_HASH]}...)")
            continue
        # another file than the pinned one: a problem, unless only other models are required
        if model.get("weights_sha256") and _weights(path) == model["weights_sha256"]:
            line = (f"{model['name']}: {model['path']} is retrained with its pin's weights (weights sha256 "
                    f"{model['weights_sha256'][:SHORT_HASH]}...) in another file (sha256 {actual}): the same model; "
                    "add that sha256 to its 'retrained' list (with the date), so figures measured on it are its")
        else:
            line = (f"{model['name']}: {model['path']} changed: sha256 {actual}{_weights_note(path)}, models.json "
                    f"pins {model['sha256']}")
        if checked:
            problems.append(line)
        lines.append(line if checked else line + " (not needed by the models required)")
    return lines, problems


def _weights(path: str) -> Optional[str]:
    try:
        return weights_sha256(path)
    except Exception:  # noqa: BLE001 - no checkpoint, or one whose tensors cannot be read as bytes: no such hash
        return None


def _weights_note(path: str, why: str = "") -> str:
    """`` (weights sha256 ...)`` to pin beside the file's hash; nothing for a file that is no checkpoint."""
    weights = _weights(path)
    return f" (weights sha256 {weights}{why})" if weights else ""


def run_check_models(models_path: str, root: str, require_all: bool, required: Optional[List[str]] = None) -> int:
    models = load_models(models_path)
    lines, problems = check_models(models, root, require_all, required)
    print("\n".join(lines))
    if problems:
        print(f"{models_path}: {len(problems)} pinned model(s) do not match:\n" + "\n".join(problems))
        return 1
    return 0


VALID_LINE = re.compile(r"epoch (\d+) \| valid on 'valid' subset \| loss ([0-9.]+)")


def validation_curve(log: str) -> List[float]:
    """fairseq-train's validation loss per epoch from its log (--log-format simple), the last line of an epoch
    where a resume validated it again."""
    if not os.path.isfile(log):
        raise InputError(f"--pin-log {log}: no such file")
    with open(log, encoding="utf-8", errors="replace") as f:
        losses = {int(epoch): float(loss) for epoch, loss in VALID_LINE.findall(f.read())}
    if not losses:
        raise InputError(f"--pin-log {log}: no \"valid on 'valid' subset\" line (a fairseq-train log with "
                         "--log-format simple?)")
    return [losses[epoch] for epoch in sorted(losses)]


def pin_model(models_path: str, root: str, name: str, log: Optional[str] = None,
              date: Optional[str] = None) -> str:
    """Record the file now under pinned model ``name``'s path in models.json, and say what was done: its hashes
    where none were recorded; the file's sha256 in ``retrained`` where its weights are the pinned ones; else it
    is another model: the entry so far is kept as ``<name>-<its date>``, superseded by ``name``, which now names
    the new file (its figures none yet). ``log``: the fairseq-train log whose validation losses become its curve."""
    import copy
    import json
    import time

    from ..common.textio import atomic_output

    data = load_models(models_path)
    by_name = {model["name"]: model for model in data["models"]}
    model = by_name.get(name)
    if model is None:
        raise InputError(f"--pin {name}: no such model in {models_path} ({', '.join(by_name)})")
    if model.get("superseded_by"):
        raise InputError(f"--pin {name}: superseded by {model['superseded_by']}; pin that one")
    path = model_file(model, root)
    if not os.path.isfile(path):
        raise InputError(f"--pin {name}: {model['path']} is not on this machine (train it: {model['recipe']})")
    curve = validation_curve(log) if log else None
    digest, weights = file_sha256(path), weights_sha256(path)
    date = date or time.strftime("%Y-%m-%d")

    def with_curve(entry):
        if curve is not None:
            entry["validation_curve"] = {"from": log, "loss": "validation loss per epoch (the log's valid lines)",
                                         "curve": curve}
        return entry

    if digest in file_hashes(model):
        if model.get("weights_sha256"):
            return f"{name}: {model['path']} is already pinned ({digest[:SHORT_HASH]}...)"
        model["weights_sha256"] = weights
        done = f"{name}: already pinned; its weights_sha256 recorded ({weights[:SHORT_HASH]}...)"
    elif model.get("weights_sha256") == weights:
        model.setdefault("retrained", []).append({
            "sha256": digest, "date": date,
            "evidence": "its weights_sha256 is the pinned one (the file differs in what training records beside "
                        "the weights)"})
        done = f"{name}: {model['path']} is a retrained copy of the pinned weights; its sha256 added to 'retrained'"
    elif model["sha256"] is None and not model.get("figures"):  # never trained or measured: filled in place
        model.pop("sha256_note", None)
        model.update(sha256=digest, weights_sha256=weights, date=f"{date} (trained on this machine)")
        with_curve(model)
        done = f"{name}: pinned {model['path']} (sha256 {digest[:SHORT_HASH]}..., weights {weights[:SHORT_HASH]}...)"
    else:  # another model than the one the entry describes (and its figures measured), hashed or not
        stamp = re.match(r"\d{4}-\d{2}-\d{2}", str(model["date"]))
        earlier_name = f"{name}-{stamp.group(0) if stamp else 'earlier'}"
        while earlier_name in by_name:
            earlier_name += "-earlier"
        earlier = {**copy.deepcopy(model), "name": earlier_name, "superseded_by": name}
        for measured in ("retrained", "evaluate", "validation_curve", "validation_curve_note", "sha256_note",
                         "other_paths", "task_files"):  # the earlier model's, not this one's
            model.pop(measured, None)
        model.update(sha256=digest, weights_sha256=weights, date=f"{date} (trained on this machine)", figures=[],
                     history=f"Retrained on {date} by its recipe; the model under this name before, and its "
                             f"figures, are '{earlier_name}'.")
        if earlier["sha256"] and earlier.get("weights_sha256") is None:
            model["history"] += " (Its weights' hash was not recorded: whether they differ is not known.)"
        with_curve(model)
        data["models"].insert(data["models"].index(model) + 1, earlier)
        done = (f"{name}: {model['path']} is another model (sha256 {digest[:SHORT_HASH]}...): pinned as {name}; the "
                f"earlier one is now {earlier_name}, superseded by it (its figures keep its sha256)")
    with atomic_output(models_path) as f:
        json.dump(data, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return done
