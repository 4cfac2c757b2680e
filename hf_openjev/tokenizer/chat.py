"""The chat template around a user prompt, rendered once (thinking off, generation prompt on)."""

from __future__ import annotations

from ..errors import CheckpointError

_SENTINEL = "\u2063HF_OPENJEV_PROMPT\u2063"


def render_chat_halves(tokenizer) -> tuple[str, str]:
    """Split the tokenizer's chat template around one user turn into ``(chat_prefix, chat_suffix)``.

    For Qwen3.5 this is ``"<|im_start|>user\\n"`` and
    ``"<|im_end|>\\n<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n"``.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise CheckpointError("the base tokenizer has no chat template; cannot render chat_prefix/chat_suffix")
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _SENTINEL}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )
    if text.count(_SENTINEL) != 1:
        raise CheckpointError("the chat template does not place the user message exactly once")
    prefix, suffix = text.split(_SENTINEL)
    return prefix, suffix
