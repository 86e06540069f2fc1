"""A run's processes and files: the data-parallel ranks (ranks.py) and the run directory and its atomic files
(files.py). Used by every layer above; imports nothing of the package but ``core``."""
