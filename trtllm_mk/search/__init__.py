"""Offline schedule search: cost model, simulator, naive baseline, list scheduling, local improvement.

  calibration  measured / default constants of the cost model (Calibration, load_calibration)
  cost         roofline cost per task (bytes, FLOPs, overheads) in the simulator's terms
  simulate     discrete-event simulation of a schedule (loader / consumer per SM, event counters)
  naive        the baseline schedule (round-robin, barrier between phases)
  plans        the tile-plan space and its starting point
  listsched    initial task -> SM assignment (earliest finish time)
  improve      local improvement by simulated moves
  search       the whole search: search(spec, batch, gpu, ...) -> (Schedule, SearchStats)
"""
from .calibration import Calibration, load_calibration
from .naive import naive_plan, naive_programs, naive_schedule
from .search import SearchStats, predict, schedule_plan, search, search_candidates, search_deployment
from .simulate import SimResult, SimulationError, Simulator, simulate

__all__ = ["Calibration", "load_calibration", "naive_plan", "naive_programs", "naive_schedule", "SearchStats",
           "predict", "schedule_plan", "search", "search_candidates", "search_deployment", "SimResult", "SimulationError", "Simulator", "simulate"]
