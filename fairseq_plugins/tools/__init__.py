"""The command-line tools' code (registers nothing): ``prepare``, ``prepare-lm`` and ``detok`` with the prepared
data they read and write and its tokenizers (prepared.py, tokenization.py), ``align`` (align.py),
``average-checkpoints`` (average.py), and the embedded synthetic corpus of the demo and the tests
(synthetic.py). cli.py lists every subcommand; the methods' own subcommands live with their methods."""
