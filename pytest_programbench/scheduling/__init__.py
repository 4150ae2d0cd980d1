"""In what order a run's tasks start: expected durations (``estimates.py``) and, under xdist, the scheduler that
hands tasks out in that order (one strategy per module, behind xdist's scheduler protocol, like xdist's own
``scheduler/`` package)."""
