"""``hf-openjev fidelity``: the decision-fidelity gate (docs/design.md "Numerics") on a user's own checkpoint and data.

:func:`check_fidelity` (``run.py``) builds or extends the fp32 oracle of an export on task files or the
benchmark's workload (``oracle.py``, placed by ``placement.py``), answers them with B (the reference path in
bf16) and each configuration asked for (``configs.py``, ``requests.py``; kept as each finishes and reused by the
next run into the same folder: ``answers.py``) and judges them
(``report.py``: :func:`judge_against_oracle`, which the benchmark driver's ``--oracle`` mode calls too). The
statistics and the gate itself are :mod:`hf_openjev.fidelity_check.gate`'s.
"""

from .report import judge_against_oracle, select_oracle_entries
from .requests import FidelityItem, entries_from_responses, items_from_workload
from .run import check_fidelity

__all__ = ["FidelityItem", "check_fidelity", "entries_from_responses", "items_from_workload", "judge_against_oracle",
           "select_oracle_entries"]
