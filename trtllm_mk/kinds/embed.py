"""EMBED: copies the token's embedding row range into the residual stream x."""
from . import KindDef

DEF = KindDef("EMBED", streams_weights=False, args=("r0", "r1"))
