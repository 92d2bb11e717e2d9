"""DOWN: the MLP down projection, a K-split GEMV that adds into x."""
from . import KindDef

DEF = KindDef("DOWN", streams_weights=True, args=("layer", "r0", "r1", "k0", "k1", "stage"))
