"""How far two arms' answers to the same requests are apart (max |dp|, decision flips)."""

from __future__ import annotations


def probabilities(response) -> list[float]:
    answer = response["answers"]["q"]
    if answer["type"] == "noul":
        return [1 - answer["noul"], answer["noul"]]
    return list(answer["probabilities"].values())


def parity(ref_responses, fast_responses) -> dict:
    max_dp, flips, near_tie_flips = 0.0, 0, 0
    for a, b in zip(ref_responses, fast_responses):
        pa, pb = probabilities(a), probabilities(b)
        max_dp = max(max_dp, max(abs(x - y) for x, y in zip(pa, pb)))
        ia, ib = pa.index(max(pa)), pb.index(max(pb))
        if ia != ib:
            top = sorted(pa, reverse=True)
            if len(top) > 1 and top[0] - top[1] < 0.01:
                near_tie_flips += 1
            else:
                flips += 1
    return {"max_abs_dp": max_dp, "decision_flips": flips, "near_tie_flips": near_tie_flips, "n": len(ref_responses)}
