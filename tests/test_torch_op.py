"""The decode-step custom op's host side on CPU: handles, the buffer check, dispatch to the decoder."""
from types import SimpleNamespace

import pytest
import torch

from trtllm_mk.runtime import torch_op


class FakeDecoder:
    """The attributes the op reads of a MegakernelDecoder; ``step`` counts calls."""

    def __init__(self):
        self.buf = SimpleNamespace(tokens=torch.zeros(2, dtype=torch.int32), pos=torch.zeros(2, dtype=torch.int32),
                                   logits=torch.zeros(2, 8))
        self.cache = SimpleNamespace(pool=torch.zeros(4))
        self.steps = 0

    def step(self):
        self.steps += 1


def test_op_steps_the_registered_decoder():
    dec = FakeDecoder()
    h = torch_op.register(dec)
    try:
        torch_op.step_op(dec, h)
        torch_op.step_op(dec, h)
        assert dec.steps == 2
    finally:
        torch_op.unregister(h)


def test_op_refuses_other_buffers_and_unknown_handles():
    dec = FakeDecoder()
    h = torch_op.register(dec)
    with pytest.raises(RuntimeError, match="own buffers"):
        torch.ops.trtllm_mk.decode_step(h, dec.buf.tokens.clone(), dec.buf.pos, dec.cache.pool, dec.buf.logits)
    torch_op.unregister(h)
    with pytest.raises(RuntimeError, match=f"no decoder registered under handle {h}"):
        torch_op.step_op(dec, h)
    assert dec.steps == 0


def test_handles_are_never_reused():
    a, b = FakeDecoder(), FakeDecoder()
    ha, hb = torch_op.register(a), torch_op.register(b)
    torch_op.unregister(ha)
    hc = torch_op.register(FakeDecoder())
    try:
        assert len({ha, hb, hc}) == 3
        torch_op.step_op(b, hb)
        assert b.steps == 1
    finally:
        torch_op.unregister(hb)
        torch_op.unregister(hc)
