"""ATTN: one KV group and split of paged decode attention (QK-norm, RoPE, cache store, partials)."""
from . import KindDef

DEF = KindDef("ATTN", streams_weights=False, args=("layer", "group", "split"))
