"""QKV: RMS-norms x (ln1) and multiplies the grouped q/k/v weight rows (plus bias for Qwen2)."""
from . import KindDef

DEF = KindDef("QKV", streams_weights=True, args=("layer", "r0", "r1", "stage"))
