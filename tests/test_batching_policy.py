"""The batching policy (hf_openjev.serve.batching_policy.GroupPolicy): when the next group is taken. Times are
passed in (``now``), never read from the clock."""

from __future__ import annotations

from types import SimpleNamespace

from hf_openjev.serve.batching_policy import FairQueue, GroupPolicy


def _queue(*items):
    queue = FairQueue()
    for client, tokens, enqueued in items:
        queue.append(SimpleNamespace(client=client, tokens=tokens, enqueued=enqueued))
    return queue


def test_a_group_waits_for_company_until_its_oldest_request_has_waited_max_wait():
    policy = GroupPolicy(max_batch_tokens=100, max_wait_s=0.5)
    queue = _queue(("a", 10, 10.0), ("b", 10, 10.2))
    group, wait_s = policy.next_group(queue, now=10.1)
    assert [item.client for item in group] == ["a", "b"] and abs(wait_s - 0.4) < 1e-9  # the oldest arrived at 10.0
    assert policy.next_group(queue, now=10.7)[1] == 0.0  # past max_wait: taken now


def test_a_full_group_a_closing_batcher_or_no_company_coming_takes_the_group_at_once():
    queue = _queue(("a", 60, 10.0), ("b", 60, 10.0))
    group, wait_s = GroupPolicy(max_batch_tokens=100, max_wait_s=5.0).next_group(queue, now=10.0)
    assert len(group) == 1 and wait_s == 0.0  # the budget is full: no reason to wait
    small = _queue(("a", 1, 10.0))
    assert GroupPolicy(100, 5.0).next_group(small, closed=True, now=10.0)[1] == 0.0
    assert GroupPolicy(100, 5.0, company_hint=lambda: 0).next_group(small, now=10.0)[1] == 0.0  # a lone request
    assert GroupPolicy(100, 5.0, company_hint=lambda: 2).next_group(small, now=10.0)[1] == 5.0  # company on its way


def test_a_failing_company_hint_counts_as_company_coming():
    def broken():
        raise RuntimeError("state not bound yet")

    assert GroupPolicy(100, 5.0, company_hint=broken).company_coming()
    assert GroupPolicy(100, 5.0).company_coming()  # no hint: always


def test_only_eligible_requests_form_the_group_and_an_empty_queue_gives_nothing():
    policy = GroupPolicy(max_batch_tokens=100, max_wait_s=0.0)
    queue = _queue(("a", 10, 1.0), ("b", 10, 2.0))
    group, _ = policy.next_group(queue, lambda item: item.client == "b", now=3.0)
    assert [item.client for item in group] == ["b"]
    assert policy.next_group(FairQueue(), now=3.0) == ([], 0.0)
