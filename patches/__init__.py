"""Patches of the Qwen3.5 modeling classes: packed candidates, shared prefixes, final-row last layer.

```python
from hf_openjev.fast_options import FastPathOptions
from hf_openjev.patches import apply_patches, revert_patches, patched

apply_patches(model, FastPathOptions(share_tails=True))  # the model is set up for the fast path, in place
```
"""

from .record import (
                     PatchRecord,
                     apply_patches,
                     compiling_ahead,
                     patch_record,
                     patched,
                     read_graph_stats,
                     read_options,
                     require_patches,
                     revert_patches,
                     run_warm_up,
                     warming_up,
)

__all__ = ["PatchRecord", "apply_patches", "compiling_ahead", "patch_record", "patched", "read_graph_stats",
           "read_options", "require_patches", "revert_patches", "run_warm_up", "warming_up"]
