"""Tokenizer: encode/decode with `tokenizers`, chat formatting with the model's own Jinja template."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer

from leanlm.errors import LeanLMError


class Tokenizer:
    def __init__(self, path: Path):
        path = Path(path)
        try:
            self._tok = _HFTokenizer.from_file(str(path / "tokenizer.json"))
        except Exception as e:
            raise LeanLMError(f"{path}: cannot read tokenizer.json ({e})") from None
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.exists() else {}
        template_file = path / "chat_template.jinja"
        self.chat_template = template_file.read_text() if template_file.exists() else cfg.get("chat_template")
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def same_vocabulary(self, other: Tokenizer) -> bool:
        return self._tok.get_vocab(with_added_tokens=True) == other._tok.get_vocab(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_spans(self, text: str) -> tuple[list[int], list[int]]:
        """Token ids of `text` (no special tokens) and where each token ends in it: token i is
        text[ends[i-1]:ends[i]], whitespace going with the token after it, so the spans tile the text."""
        enc = self._tok.encode(text, add_special_tokens=False)
        ends, last = [], 0
        for _, end in enc.offsets:  # pieces of one character share its offsets
            last = max(last, end)
            ends.append(last)
        if ends:
            ends[-1] = len(text)
        return enc.ids, ends

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_id(self, text: str) -> int | None:
        return self._tok.token_to_id(text)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render chat messages ([{"role": ..., "content": ...}]) into the prompt text the model was tuned on."""
        if not self.chat_template:
            raise LeanLMError("this model's tokenizer has no chat template; pass a plain prompt instead")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise LeanLMError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def _token_text(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok
