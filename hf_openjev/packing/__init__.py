"""The fast path's host-side layout: which tokens run in which forward, before any kernel runs.

- :mod:`.planner`: the prefix tree and the packs (pure Python);
- :mod:`.prefix_cuts`: where a token prefix can be cut cleanly (pure Python);
- :mod:`.pack_context`: one pack's tensors and state hand-offs on the device, and their builder;
- :mod:`.layout`: a pack's layout (what it is, and how the fast path builds a new shape's: one pass of plain lists,
  written straight into its input buffer), on the records and tensor-free steps of :mod:`.layout_steps`;
- :mod:`.naive_layout`: the reference of that layout, the same steps on tensors (tests and recipes only);
- :mod:`.layout_cache`: a pack's layout cached per shape (lengths and tree), so a repeated shape only writes its ids;
- :mod:`.input_buffer`: every input of a pack in one byte buffer, moved to the device in one copy;
- :mod:`.graph_buckets`: the padded shapes CUDA graphs are captured for;
- :mod:`.bucket_policy`: a pack's rows padded to the cheapest measured row count of its model's shape
  (:mod:`.gemm_costs`, the measured table ``recipes/bucket_table.py`` writes).
"""
