"""``fairseq-plugins saliency``: the paper's Fig. 6 for one sentence pair and a ByteNet checkpoint.

For each target word w, the gradient of log P(w | source, target prefix) (the sum over w's characters)
with respect to every source and target input embedding; its magnitudes (L2 over channels) are summed
per input word and normalised per column (each target word's column sums to one over source and target
rows together). Written as a PNG heatmap: source words above, target words below, target words across.
"""

import os
from typing import Dict, List, Tuple

import torch

from ..common.plots import pyplot, save_png
from ..common.textio import InputError, atomic_output



def add_saliency_parser(subparsers):
    p = subparsers.add_parser(
        "saliency",
        help="ByteNet Fig. 6: gradient saliency of each target word on the source and target words (PNG)",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--path", required=True, help="ByteNet translation checkpoint (.pt)")
    p.add_argument("--data", required=True, help="prepared data directory of that model (fairseq-plugins prepare --char)")
    p.add_argument("--source", required=True, help="source sentence (raw text)")
    p.add_argument("--target", default=None,
                   help="target sentence (raw text; default: the model's own greedy translation of --source)")
    p.add_argument("--output", required=True, help="PNG to write")
    p.add_argument("--json", default=None, help="also write the matrix and word labels here")
    p.set_defaults(run=run_saliency)


def _words(characters: List[str], space: str) -> List[Tuple[str, List[int]]]:
    """Group character positions into words at the visible space symbol (which joins the word before it)."""
    words, current = [], []
    for position, char in enumerate(characters):
        current.append(position)
        if char == space:
            words.append(current)
            current = []
    if current:
        words.append(current)
    return [("".join(characters[i] for i in group if characters[i] != space) or space, group) for group in words]


def saliency_matrix(model, source: torch.Tensor, target: torch.Tensor, source_chars, target_chars, space: str) -> Dict:
    """Rows: source words then target words (inputs); columns: target words (outputs).

    ``source`` and ``target`` end with EOS, as in training; ``*_chars`` are their characters without it.
    """
    eos = model.decoder.dictionary.eos()
    prev_output = torch.cat([torch.tensor([eos]), target[:-1]]).unsqueeze(0)
    embedded = []  # the encoder embeds first, then the decoder (one module twice if embeddings are shared)

    def keep(module, inputs, output):
        output.retain_grad()
        embedded.append(output)

    modules = {model.encoder.embed_tokens, model.decoder.embed_tokens}
    handles = [module.register_forward_hook(keep) for module in modules]
    try:
        encoder_out = model.encoder(source.unsqueeze(0), torch.tensor([source.numel()]))
        logits, _ = model.decoder(prev_output, encoder_out)
    finally:
        for handle in handles:
            handle.remove()
    source_embedded, target_embedded = embedded
    log_probs = torch.log_softmax(logits.float(), dim=-1)[0]
    token_log_probs = log_probs.gather(1, target.unsqueeze(1)).squeeze(1)

    source_words = _words(source_chars, space)
    target_words = _words(target_chars, space)
    columns = []
    for _, output_positions in target_words:
        source_embedded.grad = target_embedded.grad = None
        token_log_probs[output_positions].sum().backward(retain_graph=True)
        source_norm = source_embedded.grad[0].norm(dim=-1)
        target_norm = target_embedded.grad[0].norm(dim=-1)
        column = [float(source_norm[positions].sum()) for _, positions in source_words]
        # target character p is the decoder's input at step p + 1 (step 0 reads EOS)
        column += [float(target_norm[[p + 1 for p in positions]].sum()) for _, positions in target_words]
        total = sum(column) or 1.0
        columns.append([value / total for value in column])
    return {
        "rows": [word for word, _ in source_words] + [word for word, _ in target_words],
        "source_rows": len(source_words),
        "columns": [word for word, _ in target_words],
        "matrix": torch.tensor(columns).T.tolist(),  # inputs x outputs
    }


def plot(result: Dict, output: str) -> None:
    plt = pyplot()

    matrix = torch.tensor(result["matrix"])
    rows, columns = result["rows"], result["columns"]
    fig, ax = plt.subplots(figsize=(1 + 0.45 * len(columns), 1 + 0.3 * len(rows)))
    ax.imshow(matrix.numpy(), cmap="Greys", aspect="auto", vmin=0)
    ax.set_xticks(range(len(columns)), columns, rotation=90)
    ax.set_yticks(range(len(rows)), rows)
    ax.axhline(result["source_rows"] - 0.5, color="tab:red", linewidth=1)
    ax.set_xlabel("target word (output)")
    ax.set_ylabel("source words (above the line), target words (below)")
    ax.set_title("ByteNet saliency (per word, normalised per column)", fontsize=9)
    fig.tight_layout()
    save_png(fig, output, dpi=120)


def run_saliency(args, argv):
    import json

    from fairseq import checkpoint_utils
    from fairseq.models import ARCH_MODEL_REGISTRY

    from ..tools.prepared import PreparedData
    from .model import ByteNetModel

    data = PreparedData(args.data)
    tokenizers = {lang: data.tokenizer(lang) for lang in (data.source_lang, data.target_lang)}
    if any(t.kind != "char" for t in tokenizers.values()):
        raise InputError(f"--data {args.data}: saliency is per character; prepare the data with --char")
    for line, flag, lang in ((args.source, "--source", data.source_lang), (args.target, "--target", data.target_lang)):
        if line is not None:
            if not line.strip():
                raise InputError(f"{flag}: empty sentence")
            tokenizers[lang].check(line, flag)
    if not os.path.isfile(args.path):
        raise InputError(f"--path {args.path}: no such checkpoint")
    # The model's class from the checkpoint's arguments, before fairseq builds its task (a language model's task
    # would look for another data directory's files and fail there).
    state = checkpoint_utils.load_checkpoint_to_cpu(args.path, arg_overrides={"data": data.bin_dir})
    model_cfg = state["cfg"]["model"]  # (load_checkpoint_to_cpu makes a cfg of an older checkpoint's args)
    arch = getattr(model_cfg, "arch", None) or getattr(model_cfg, "_name", None)
    model_class = ARCH_MODEL_REGISTRY.get(arch)
    if model_class is None or not issubclass(model_class, ByteNetModel):
        raise InputError(f"--path {args.path}: a {model_class.__name__ if model_class else arch} checkpoint "
                         f"(--arch {arch}), not a ByteNet translation model")
    models, _, task = checkpoint_utils.load_model_ensemble_and_task([args.path], state=state)
    model = models[0].float().eval()

    def encode(text, dictionary, lang):
        return dictionary.encode_line(tokenizers[lang].encode(text), add_if_not_exist=False).long()

    source = encode(args.source, task.source_dictionary, data.source_lang)
    if args.target is None:
        from fairseq.sequence_generator import SequenceGenerator

        generator = SequenceGenerator([model], task.target_dictionary, beam_size=1, max_len_a=1.5, max_len_b=10)
        sample = {"net_input": {"src_tokens": source.unsqueeze(0), "src_lengths": torch.tensor([source.numel()])}}
        with torch.no_grad():
            target = generator.generate([model], sample)[0][0]["tokens"]
        target_text = tokenizers[data.target_lang].decode(task.target_dictionary.string(target))
        print(f"target (greedy): {target_text}")
    else:
        target = encode(args.target, task.target_dictionary, data.target_lang)
    space = tokenizers[data.target_lang].space_symbol
    source_chars = [task.source_dictionary[i] for i in source[:-1].tolist()]
    target_chars = [task.target_dictionary[i] for i in target[:-1].tolist()]
    result = saliency_matrix(model, source, target, source_chars, target_chars, space)
    plot(result, args.output)
    if args.json:
        with atomic_output(args.json) as f:
            json.dump({**result, "source": args.source, "command": ["fairseq-plugins"] + argv}, f, indent=1,
                      ensure_ascii=False)
    print(f"wrote {args.output} ({len(result['columns'])} target words x {len(result['rows'])} input words)")
