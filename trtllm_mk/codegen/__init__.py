"""Code generation: schedule.json -> config-specialized CUDA source -> cubin."""
from .compile import compile_cubin, find_nvcc
from .source import KERNEL_NAME, KernelLayout, generate_source, kernel_smem_bytes

__all__ = ["compile_cubin", "find_nvcc", "KERNEL_NAME", "KernelLayout", "generate_source", "kernel_smem_bytes"]
