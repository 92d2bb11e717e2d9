"""trtllm_mk: a hybrid LLM inference engine whose decode step is one persistent CUDA megakernel.

Data flow (one direction, one module per concept):
  config (DeploymentConfig) + model (ModelSpec) + gpus (GpuSpec)
    -> graph (tiled task graph with event tensors)
    -> smem + search (tile choices, task->SM assignment and order, predicted time)
    -> schedule (versioned per-SM program, JSON) -> verify (validator, CPU executor)
    -> codegen (config-specialized CUDA source -> cubin) -> runtime (HybridEngine, C++ launcher)
"""
__version__ = "0.1.0"
