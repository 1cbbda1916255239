"""MyCluster's jobgen site: its profile (sites/), template overrides (templates/) and the LSF scheduler (lsf.py)."""
