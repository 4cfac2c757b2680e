"""Patches of the Qwen3.5 modeling classes: packed candidates, shared prefixes, final-row last layer.

```python
from hf_openjev.patches import apply_patches, revert_patches, patched
```
"""

from .record import PatchOptions, PatchRecord, apply_patches, patch_record, patched, revert_patches

__all__ = ["PatchOptions", "PatchRecord", "apply_patches", "patch_record", "patched", "revert_patches"]
