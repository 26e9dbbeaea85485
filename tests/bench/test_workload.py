"""Timing prompts: passages of the built-in text, half chats; a user's JSONL."""

from __future__ import annotations

import pytest

from leanlm.bench.workload import INSTRUCTIONS, passage_prompts, read_prompts
from leanlm.errors import LeanLMError


def test_passages_are_deterministic_about_the_length_asked_and_half_chats(tiny_dir):
    from leanlm.tokenizer import Tokenizer

    tok = Tokenizer(tiny_dir)
    prompts = passage_prompts(tok, 8, 24)
    assert prompts == passage_prompts(tok, 8, 24) and prompts != passage_prompts(tok, 8, 24, seed=1)
    chats = prompts[::2] if tok.chat_template else []
    assert all(isinstance(p, list) and p[0]["content"].split("\n\n")[0] in INSTRUCTIONS for p in chats)
    texts = [p for p in prompts if isinstance(p, str)]
    # 24 tokens decoded (this test tokenizer's decode drops what it has no token for, so it re-encodes to fewer)
    assert len(texts) == 8 - len(chats) and all(0 < len(tok.encode(t, add_special_tokens=False)) <= 24 for t in texts)
    assert not set(texts) & {p for p in passage_prompts(tok, 8, 24, "calibration") if isinstance(p, str)}  # other split


def test_a_prompt_file_is_jsonl_with_prompt_or_messages(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hi"}\n{"messages": [{"role": "user", "content": "hey"}]}\n')
    assert read_prompts(f) == ["hi", [{"role": "user", "content": "hey"}]]
    (tmp_path / "p.txt").write_text("hi\n")
    with pytest.raises(LeanLMError, match="JSONL"):
        read_prompts(tmp_path / "p.txt")
    f.write_text('{"prompt": "hi"}\n{"completion": "x"}\n')
    with pytest.raises(LeanLMError, match="line 2"):
        read_prompts(f)
