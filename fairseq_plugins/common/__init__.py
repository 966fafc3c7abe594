"""What every method's training and decoding shares; registers nothing, so importing it is always safe.

Text I/O and the one error type for bad user input (textio.py), dictionaries and their fingerprints, progress
bars and plots, the transformer sizes presets start from (presets.py), warm starts from a trained checkpoint
(warm_start.py), several new tokens per incremental decoder call (incremental.py), and what the methods' own
generators share: the generation flags and statistics (generation.py), fairseq's step rules (step_rules.py)
and a beam search over a step model (beam_search.py). Imports nothing else of the package.
"""
