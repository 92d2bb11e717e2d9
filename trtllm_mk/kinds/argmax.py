"""ARGMAX: the step's last task: next tokens from the tiles' maxima; advances pos and the step."""
from . import KindDef

DEF = KindDef("ARGMAX", streams_weights=False, args=())
