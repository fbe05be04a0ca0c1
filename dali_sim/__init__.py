"""dali_sim: traces, model and hardware specs, policies and the simulator. Never imports torch."""

__version__ = "0.1.0"
