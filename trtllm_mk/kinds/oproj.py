"""OPROJ: the output projection, a K-split GEMV that adds into x (optionally merging the splits itself)."""
from . import KindDef

DEF = KindDef("OPROJ", streams_weights=True, args=("layer", "r0", "r1", "k0", "k1", "stage"))
