"""How far two arms' answers to the same requests are apart (max |dp|, decision flips), read through the contract's
table of question kinds: its decision rule and its near-tie rule, the fidelity gate's (docs/design.md "Numerics")."""

from __future__ import annotations

from hf_openjev.contract import KINDS


def probabilities(response) -> list[float]:
    """The one question ``"q"``'s probability per candidate (noul: ``[p_yes]``)."""
    answer = response["answers"]["q"]
    return KINDS[answer["type"]].probabilities(answer)


def parity(ref_responses, fast_responses) -> dict:
    """``max_abs_dp`` over every candidate probability; a flip when the decisions differ, a near-tie flip when the
    reference's decision was a near-tie."""
    max_dp, flips, near_tie_flips = 0.0, 0, 0
    for a, b in zip(ref_responses, fast_responses):
        kind = KINDS[a["answers"]["q"]["type"]]
        pa, pb = probabilities(a), probabilities(b)
        max_dp = max(max_dp, max(abs(x - y) for x, y in zip(pa, pb)))
        if kind.decide(pa) != kind.decide(pb):
            if kind.near_tie(pa):
                near_tie_flips += 1
            else:
                flips += 1
    return {"max_abs_dp": max_dp, "decision_flips": flips, "near_tie_flips": near_tie_flips, "n": len(ref_responses)}
