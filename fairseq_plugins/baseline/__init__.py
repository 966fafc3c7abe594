"""The baseline every method is measured against: fairseq's stock transformer, in named presets."""

from . import model  # noqa: F401
