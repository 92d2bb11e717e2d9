"""LMHEAD: final RMS norm and one LM-head tile of logits, with the tile's max and first argmax."""
from . import KindDef

DEF = KindDef("LMHEAD", streams_weights=True, args=("r0", "r1", "tile", "stage"))
