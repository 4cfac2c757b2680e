"""The fast path's one configuration: :class:`FastPathOptions`, frozen and checked when it is made.

Every option of the fast path lives here, whatever reads it: the patches (``apply_patches``), the planner and the
pack layout (``score_fast``), the packed forward (``PackContext.options``). The pipeline's call options, the
server, warm-up and the benchmark's JSON options all build one of these (``from_mapping`` for a mapping of names)
and pass it along. Pure Python (no torch), so a command line can check options before loading anything.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass

from .checkpoint.fp8_scheme import FP8_MODES
from .packing.planner import DEFAULT_MAX_SEQUENCES, DEFAULT_MAX_TOKENS, DEFAULT_MIN_SHARED_TOKENS, DEFAULT_SHARE_TAILS

# A level of one sequence this long or longer, with no prefix, runs its attention as one dense causal call
# (ops.packed_attention.causal_attention: cuDNN on CUDA): cuDNN is faster than FA2 on long single sequences and
# slower on short ones, so the threshold sits where it starts to win (recipes/RESULTS.md). 0 turns it off.
DENSE_ATTENTION_TOKENS = 2048
# A graphed pack has at most this many tokens; a longer one runs eagerly: its GPU time hides its launches' host
# time, and its activations would be large in the graphs' shared pool. Lower cuts lose speed: at 27B a pack of
# 2,049-4,096 tokens run eagerly is host-bound (recipes/RESULTS.md s30)
GRAPH_TOKENS = 4096

# the options a packed forward reads (PackContext.options): a captured CUDA graph depends on them (its key holds them)
FORWARD_FIELDS = ("final_row_mlp", "compile_elementwise", "fused_elementwise", "gdn_fp32", "packed_attention",
                  "residual_fp32")
_MINIMUM = {"min_shared_tokens": 1, "max_sequences": 1, "max_tokens": 1, "dense_attention_tokens": 0,
            "graph_tokens": 1}
# the kernels a packed level's attention can run on CUDA (ops.packed_attention.PACKED_KERNELS)
PACKED_ATTENTION_KERNELS = ("flash", "efficient")
_CHOICES = {"fp8": tuple(FP8_MODES), "packed_attention": PACKED_ATTENTION_KERNELS}  # options that take one of a few names


def check_int(name: str, value, minimum: int) -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``; else a ValueError naming the option."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else "a non-negative integer (0: never)"
        raise ValueError(f"{name} must be {kind}, got {value!r}")
    return value


def check_bool(name: str, value) -> bool:
    """``value`` if it is True or False; else a ValueError naming the option."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value


def check_choice(name: str, value, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``; else a ValueError naming the option and the choices."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")
    return value


@dataclass(frozen=True)
class FastPathOptions:
    """Every fast-path option, with its default; a bad value raises ValueError naming the option."""

    # -- the patches: what the packed forward does ----------------------------------------------------------------
    packed_candidates: bool = True  # pack several candidates into one varlen forward (False: one per pack)
    shared_prefix: bool = True  # compute shared prefixes once and hand their states on
    final_row_mlp: bool = True  # last layer: post-norm + MLP + final norm on the scored rows only
    # one GEMM for GDN qkv|z|b|a, attention q|k|v, MLP gate|up (no weight copies); read by apply_patches, which
    # stacks the weights (the layout stays for the model's life)
    stacked_projections: bool = True
    # on CUDA, replay packed forwards as CUDA graphs per shape bucket (cuda_graphs.py); apply_patches creates the
    # graph cache of a CUDA model when this is on; per call, False runs eagerly
    cuda_graphs: bool = True
    # the longest pack (tokens, before padding) replayed as a CUDA graph; longer packs run eagerly. A lower value
    # means fewer graphs and a shorter warm-up, at a cost in speed (27B, 2,048: ~5 s off a warm warm-up, 9% of the
    # mean and 27% of p95 lost; recipes/RESULTS.md s30)
    graph_tokens: int = GRAPH_TOKENS
    # on CUDA, norms / SiLU-mul / gates / RoPE through torch.compile: faster than the plain code, but its decisions
    # drift further from stock Transformers' (recipes/RESULTS.md), so opt-in
    compile_elementwise: bool = False
    # on CUDA, the elementwise group as Triton kernels that round like the plain code (compiled_elementwise.py);
    # compile_elementwise wins when both are on
    fused_elementwise: bool = True
    # feed the GDN kernel fp32 q/k/v, for parity with the stock fp32 fallback. Opt-in: at 2B it passes the fidelity
    # gate on one set of weights of three, where the default passes on another (recipes/RESULTS.md, s18)
    gdn_fp32: bool = False
    # carry the decoder layers' residual stream in fp32 (stock Transformers keeps it in the model dtype): each layer's
    # output is added without rounding, the norms and projections still read the model dtype, and the head reads the
    # final norm in fp32. Closer to the fp32 oracle than stock bf16, not bit-equal to it; opt-in until it has been
    # through the fidelity gate (recipes/RESULTS.md s31)
    residual_fp32: bool = False
    # FP8 projections, opt-in: "all" (MLP, attention and GDN projections), "no-gdn" (the GDN's in bf16) or "off".
    # About half the weights and faster, but neither mode passes the fidelity gate against the fp32 oracle
    # (recipes/RESULTS.md).
    # Read by apply_patches, which swaps the targeted nn.Linear modules for Fp8Linear (weights from the FP8 export
    # the model was loaded from, else quantized from its own weights, in place). One way: an FP8 model cannot go
    # back to bf16 without loading it again
    fp8: str = "off"
    # on CUDA, the kernel of a packed level's attention (several sequences, no prefix; bf16/fp16): "flash" (FA2
    # varlen) or "efficient" (the memory-efficient kernel's varlen path: it rounds as stock's padded batch does, yet
    # packing the 2B with it failed the gate on one of its weights; recipes/varlen_attention_probe.py, RESULTS.md s22)
    packed_attention: str = "flash"
    # -- the plan and the pack layout (hf_openjev.packing.planner.plan_requests) -------------------------------
    min_shared_tokens: int = DEFAULT_MIN_SHARED_TOKENS  # the shortest prefix worth sharing (16: best with tails)
    max_sequences: int = DEFAULT_MAX_SEQUENCES  # candidates per pack
    max_tokens: int = DEFAULT_MAX_TOKENS  # tokens per pack (a longer sequence runs alone, untruncated)
    share_tails: bool = DEFAULT_SHARE_TAILS  # share exact common prefixes (False: only up to a multiple of 64 tokens)
    # a pack level of one sequence at least this long, with no prefix, runs its attention as one dense causal call
    # (cuDNN on CUDA); 0: never
    dense_attention_tokens: int = DENSE_ATTENTION_TOKENS
    # graphed packs padded to the cheapest measured row count of the model's shape (packing/bucket_policy.py; shapes
    # without a table keep the steps); False: the fixed 32-token steps of packing/graph_buckets.py. Opt-in: other
    # padding changes the GEMMs' rounding, and this has not been through the fidelity gate yet (recipes/RESULTS.md)
    measured_buckets: bool = False

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _MINIMUM:
                check_int(f.name, value, _MINIMUM[f.name])
            elif f.name in _CHOICES:
                check_choice(f.name, value, _CHOICES[f.name])
            else:
                check_bool(f.name, value)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """Every option name, in field order."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_mapping(cls, mapping: Mapping, *, base: FastPathOptions | None = None) -> FastPathOptions:
        """``base`` (default: the defaults) with the options of ``mapping`` (name -> value, e.g. parsed JSON)
        changed; a name that is no option raises ValueError listing the known ones."""
        if not isinstance(mapping, Mapping):
            raise ValueError(f"fast-path options must be a mapping of option names to values, got {mapping!r}")
        unknown = sorted(set(mapping) - set(cls.names()))
        if unknown:
            raise ValueError(f"unknown fast-path option(s): {', '.join(map(str, unknown))}; "
                             f"known: {', '.join(cls.names())}")
        return dataclasses.replace(base if base is not None else cls(), **mapping)

    def replace(self, **changes) -> FastPathOptions:
        """A copy with ``changes`` (checked like a new one)."""
        return self.from_mapping(changes, base=self)

    def to_dict(self, *, changed_only: bool = False) -> dict:
        """``{name: value}`` of every option, or of those that differ from the defaults (``changed_only``)."""
        default = FastPathOptions()
        return {name: getattr(self, name) for name in self.names()
                if not changed_only or getattr(self, name) != getattr(default, name)}

    def forward_key(self) -> tuple:
        """The values of :data:`FORWARD_FIELDS`: packed forwards with equal keys run the same code."""
        return tuple(getattr(self, name) for name in FORWARD_FIELDS)


# The family members whose fast-path defaults differ from the package's, chosen by the fidelity gate (docs/design.md
# "Numerics"). At 2B the package defaults flipped more decisions than stock bf16 on two of three random weights: the
# packed attention kernel (FA2 varlen) rounds unlike stock's dense one from the first full-attention layer on. Every
# candidate alone with dense attention passes on all three; it costs about 2.7x the packed path's mean time there
# (recipes/RESULTS.md, s19-s20). The packed 2B path stays opt-in: PACKED_2B.
MEMBER_DEFAULTS = {"Open-Jev-2B": {"dense_attention_tokens": 1, "packed_candidates": False, "shared_prefix": False}}
PACKED_2B = {"dense_attention_tokens": DENSE_ATTENTION_TOKENS, "packed_candidates": True, "shared_prefix": True}


def options_for(of=None, changes: Mapping | None = None, *, fp8: str = "off") -> FastPathOptions:
    """The fast path's options for a model: ``changes`` (option names to values, checked) over the defaults of the
    family member ``of`` (a :class:`~hf_openjev.family.FamilyMember`, a model's config, text or composite; None or a
    shape no Open-Jev model has: the package's alone), :data:`MEMBER_DEFAULTS`, over the package's, with ``fp8``.
    The one door through which a member's own defaults enter: ``apply_patches`` and ``read_options`` for a model
    given no options, the commands for ``--fast-options``."""
    from .family import FamilyMember, member_with_shape, shape_of

    member = of
    if of is not None and not isinstance(of, FamilyMember):
        member = member_with_shape(shape_of(getattr(of, "text_config", None) or of))
    own = MEMBER_DEFAULTS.get(member.name, {}) if member is not None else {}
    return FastPathOptions.from_mapping(dict(changes or {}), base=FastPathOptions.from_mapping({**own, "fp8": fp8}))


def options_mapping_from_json(text: str, *, flag: str) -> dict:
    """The option names and values of ``text``, a JSON object such as ``'{"cuda_graphs": false}'``, checked against
    :class:`FastPathOptions` (names and values); a one-line ValueError naming ``flag`` otherwise. For a command
    line's option, before anything loads."""
    try:
        mapping = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: not JSON ({exc.msg} at character {exc.pos}); give an object of option names, "
                         f"e.g. '{{\"cuda_graphs\": false}}'") from None
    if not isinstance(mapping, dict):
        raise ValueError(f"{flag}: give a JSON object of option names, e.g. '{{\"cuda_graphs\": false}}', "
                         f"got {text!r}")
    try:
        FastPathOptions.from_mapping(mapping)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None
    return mapping


FAST_OPTIONS_HELP = ("the fast path's options other than the model's defaults, a JSON object of "
                     "hf_openjev.FastPathOptions names, e.g. '{\"cuda_graphs\": false}'; a 2B's own defaults run "
                     "every candidate alone, '{\"packed_candidates\": true, \"shared_prefix\": true, "
                     "\"dense_attention_tokens\": 2048}' packs them (faster, fails the fidelity gate there; "
                     "docs/usage.md \"Fidelity\"); selects the fast path (on the CPU too); checked before anything "
                     "loads; FP8 has its own --fp8")


def fast_options_argument(text: str) -> dict:
    """``--fast-options``' argparse type: :func:`options_mapping_from_json`, its error one line of argparse's."""
    import argparse

    try:
        return options_mapping_from_json(text, flag="--fast-options")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--fast-options: ")) from None


def resolve_fast_options(mapping, *, fp8: str, fast: bool | None,
                         reference_flag: str) -> tuple[FastPathOptions | None, bool | None]:
    """A command's fast-path options and path from ``--fast-options``' ``mapping`` and its ``fp8`` mode, checked
    before anything loads: (both over the package's defaults, or None when ``mapping`` is empty: the model's own;
    once the model is known, :func:`options_for` puts ``mapping`` over its defaults; ``fast``, True when ``mapping``
    names any option: they are the fast path's, so they select it, on the CPU too, as ``--fp8`` does). A one-line
    :class:`~hf_openjev.errors.UsageError` for ``fp8`` given in ``mapping`` (it has its own option), for options with
    the reference path (``fast`` False, asked by ``reference_flag``) or for a name or value refused."""
    from .errors import UsageError

    mapping = dict(mapping or {})
    if not mapping:
        return None, fast
    if "fp8" in mapping:
        raise UsageError("--fast-options: fp8 has its own option: --fp8 MODE")
    if fast is False:
        raise UsageError(f"--fast-options are the fast path's options but {reference_flag} asks for the reference "
                         "path; drop one of them")
    try:
        return options_for(None, mapping, fp8=fp8), True
    except ValueError as exc:
        raise UsageError(f"--fast-options: {exc}") from None
