"""Task graph of one decode step: tiled tasks whose dependencies are event tensors."""
from .builder import build_step_graph, check_kernel_supported, check_model_supported, check_plan
from .tasks import HEAD, LAYER, MAX_BATCH, TAIL, Access, Dims, Event, EventRef, Kind, StepGraph, Task, TilePlan

__all__ = ["build_step_graph", "check_kernel_supported", "check_model_supported", "check_plan", "HEAD", "LAYER",
           "MAX_BATCH", "TAIL", "Access", "Dims", "Event", "EventRef", "Kind", "StepGraph", "Task", "TilePlan"]
