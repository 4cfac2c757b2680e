"""What the benchmark scripts of ``recipes/`` share: shapes, the seeded random model, the workload, timing,
provenance and result files. Scripts run as ``python recipes/<script>.py`` have ``recipes/`` on ``sys.path`` and
import ``benchlib.<module>``; they are not part of the installed package."""
