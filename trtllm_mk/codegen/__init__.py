"""Code generation: schedule.json -> config-specialized CUDA source -> cubin."""
from .compile import arch_sm, compile_cubin, cubin_sm, find_nvcc
from .diagnostics import Diagnostics
from .source import KERNEL_NAME, KernelLayout, generate_source, kernel_smem_bytes

__all__ = ["Diagnostics", "arch_sm", "compile_cubin", "cubin_sm", "find_nvcc", "KERNEL_NAME", "KernelLayout", "generate_source", "kernel_smem_bytes"]
