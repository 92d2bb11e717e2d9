"""GATEUP: RMS-norms x (ln2) and computes silu(gate) * up for a row range of the MLP."""
from . import KindDef

DEF = KindDef("GATEUP", streams_weights=True, args=("layer", "r0", "r1", "stage"))
