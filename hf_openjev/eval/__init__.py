"""``hf-openjev eval``: JevBench evaluation. ``tasks.py`` reads task files, ``evaluate.py`` scores them
(resumable), ``metrics.py`` and ``report.py`` summarise; ``cli.py`` is the command line."""
