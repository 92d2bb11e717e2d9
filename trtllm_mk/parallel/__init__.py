"""Tensor parallelism over the GPUs of one host: which part each rank holds (``layout``), the weight
shards (``shard``), a CPU emulation of tensor-parallel decoding (``emulate``) and a cost model of the
all-reduce (``allreduce_cost``)."""
from .layout import TP_SIZES, RankLayout, check_tensor_parallel, rank_layout, rank_spec
from .shard import shard_all, shard_weights, unshard_weights

__all__ = ["TP_SIZES", "RankLayout", "check_tensor_parallel", "rank_layout", "rank_spec", "shard_all",
           "shard_weights", "unshard_weights"]
