"""``quantize``: a round-to-nearest quantized copy of an HF checkpoint, in a standard layout.

    python -m trtllm_mk quantize --format gptq|awq|fp8|ct-w4a16|ct-fp8 [--bits 4|8] [--group-size N]
        [--sym | --zero-point] [--per-tensor] CKPT OUT

gptq: GPTQ's layout (4 or 8 bits, group 32/64/128 or -1 per channel); awq: AutoAWQ's GEMM layout (4 bits,
zero points); fp8: ModelOpt's FP8 naming, per-channel scales; ct-w4a16 / ct-fp8: compressed-tensors'
pack-quantized (4 or 8 bits) and float-quantized layouts, as llmcompressor writes them. The embedding,
norms and LM head stay unquantized; tokenizer and generation files are copied. OUT must be new, empty
or an earlier output of this command.
"""
from __future__ import annotations

import argparse


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trtllm_mk quantize",
                                 description="A round-to-nearest quantized copy of an HF checkpoint, in a standard "
                                             "layout.")
    from ..quant.writer import FORMATS, make_scheme, quantize_checkpoint
    ap.add_argument("--format", required=True, choices=FORMATS)
    ap.add_argument("--bits", type=int, help="integer formats: 4 (default) or 8")
    ap.add_argument("--group-size", type=int, help="inputs per scale: 32, 64, 128 (default) or -1 (per channel)")
    zp = ap.add_mutually_exclusive_group()
    zp.add_argument("--sym", action="store_true", help="symmetric integer weights (default)")
    zp.add_argument("--zero-point", action="store_true", help="asymmetric integer weights with zero points "
                                                             "(always for awq)")
    ap.add_argument("--per-tensor", action="store_true", help="ct-fp8: one scale per matrix (default per channel)")
    ap.add_argument("ckpt", help="HF checkpoint directory (config.json + safetensors)")
    ap.add_argument("out", help="output directory")
    args = ap.parse_args(argv)
    if args.format == "awq" and args.sym:
        from ..errors import UserError
        raise UserError("--format awq --sym: AutoAWQ's GEMM layout always has zero points")
    scheme = make_scheme(args.format, args.bits, args.group_size, args.zero_point or args.format == "awq",
                         args.per_tensor)
    out = quantize_checkpoint(args.ckpt, args.out, scheme)
    print(f"{out}: {scheme.describe()}")
    return 0
