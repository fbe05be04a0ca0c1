"""dali_exec: the parts of dali that need torch (recorder, offloading executor, calibration).

Importing this package checks that torch is installed; :mod:`dali_sim` never imports it.
"""

try:
    import torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "dali_exec needs torch: on a CPU-only machine run `pip install torch==2.13.0` "
        "and then `pip install -e '.[exec]'`"
    ) from exc
