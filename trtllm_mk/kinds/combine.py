"""COMBINE: merges one KV group's attention split partials into attn_out."""
from . import KindDef

DEF = KindDef("COMBINE", streams_weights=False, args=("group",))
