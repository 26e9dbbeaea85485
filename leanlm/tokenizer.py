"""Tokenizer: encode/decode with `tokenizers`, chat formatting with the model's own Jinja template."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2.ext
from jinja2 import meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
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

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        """Render chat messages ([{"role": ..., "content": ...}]) into the prompt text the model was tuned on.

        `tools` (OpenAI's list of {"type": "function", "function": {...}}) goes to the template as `tools`, as
        `transformers` passes it (Qwen2.5's template writes them into its system prompt). A template that never
        reads `tools` gets the fallback of `_tools_fallback` instead: the functions and Hermes-style calling
        instructions in the system message, earlier calls and results written into the messages as text."""
        if not self.chat_template:
            raise LeanLMError("this model's tokenizer has no chat template; pass a plain prompt instead")

        def raise_exception(message):
            raise LeanLMError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = _tojson  # jinja's own sorts keys and escapes <>&', unlike transformers'
        template = env.parse(self.chat_template)
        if "tools" not in meta.find_undeclared_variables(template):
            messages, tools = _tools_fallback(messages, tools), None
        return env.from_string(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools or None,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """The `tojson` filter as `transformers` defines it for chat templates."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


TOOLS_FALLBACK_PROMPT = (
    "# Tools\n\nYou may call one or more functions to assist with the user query. "
    "The functions, as JSON signatures:\n<tools>\n{tools}\n</tools>\n\n"
    "To call functions, answer with one block per call, each in this form:\n"
    "<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")


def _tools_fallback(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Tool use for a chat template that knows nothing of it: TOOLS_FALLBACK_PROMPT before the first system
    message's content (or as a new first system message), an assistant's tool_calls appended to its content as
    <tool_call> blocks, and each run of tool results as one user message of <tool_response> blocks (Qwen2.5's
    layout), so that any template renders them as plain text."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        content = m.get("content") or ""
        if m.get("role") == "assistant" and m.get("tool_calls"):
            blocks = []
            for call in m["tool_calls"]:
                fn = call.get("function", call)
                args = fn.get("arguments")
                args = args if isinstance(args, str) else json.dumps(args or {}, ensure_ascii=False)
                blocks.append(f'<tool_call>\n{{"name": {json.dumps(fn.get("name"), ensure_ascii=False)}, '
                              f'"arguments": {args}}}\n</tool_call>')
            m = {"role": "assistant", "content": "\n".join([content, *blocks] if content else blocks)}
        elif m.get("role") == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if i and messages[i - 1].get("role") == "tool":
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + response}
                continue
            m = {"role": "user", "content": response}
        out.append(m)
    if tools:
        prompt = TOOLS_FALLBACK_PROMPT.format(tools="\n".join(_tojson(t) for t in tools))
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": prompt + "\n\n" + (out[0].get("content") or "")}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _token_text(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok
