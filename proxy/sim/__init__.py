"""The engine simulator: a small real engine that speaks vLLM, SGLang, llama.cpp, mindnano or OpenAI.

Public API (the team codes against these names):
`SimConfig`, `build_sim_app(config)`, `add_sim_arguments(parser)`,
`sim_config_from_args(ns)`, `run_sim(config, host, port)`, `running_sim(config)`.
"""

from __future__ import annotations

from proxy.sim.arguments import add_sim_arguments, parse_listen, sim_config_from_args
from proxy.sim.config import DIALECTS, SimConfig
from proxy.sim.run import run_sim, running_sim
from proxy.sim.server import SIM_ENGINE, build_sim_app

__all__ = [
    "DIALECTS",
    "SIM_ENGINE",
    "SimConfig",
    "add_sim_arguments",
    "build_sim_app",
    "parse_listen",
    "run_sim",
    "running_sim",
    "sim_config_from_args",
]
