"""Tensor parallelism over the GPUs of one host: which part each rank holds (``layout``), the weight
shards (``shard``), a CPU emulation of tensor-parallel decoding (``emulate``), a cost model of the
all-reduce (``allreduce_cost``), every rank's schedule on the CPU executor (``cpu_executor``) and the
rank kernels on GPUs, on one GPU's SMs or one per process over symmetric memory (``gpu_ranks``). How
the kernel's ranks exchange the residual, events and LM-head maxima: graph/builder.py."""
from .layout import TP_SIZES, RankLayout, check_tensor_parallel, rank_layout, rank_spec
from .shard import shard_all, shard_weights, unshard_weights

__all__ = ["TP_SIZES", "RankLayout", "check_tensor_parallel", "rank_layout", "rank_spec", "shard_all",
           "shard_weights", "unshard_weights"]
