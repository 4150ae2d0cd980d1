"""The pytest layer: the entry point, options, stash keys, markers, hookspecs, items, fixtures, the session's
state and collection, its reporting and xdist hooks, and the run record. Everything pytest-shaped lives here; the
pipeline steps it drives (tasks/, sandbox/, agents/, evaluation/, results/) know nothing of pytest's hooks."""
