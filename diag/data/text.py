"""Records -> prompt -> tokens: `format_prompt` renders a record, `encode_pairs` tokenizes many;
`load_tokenizer` reads a tokenizer.json with `tokenizers` alone (no transformers, no torch),
`hf_tokenizer` with transformers (the naive dataset).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

# Alpaca's template (most instruction-tuning recipes'); no input block for a record without one
PROMPT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
PROMPT_TEMPLATE_NO_INPUT = "### Instruction:\n{instruction}\n\n### Response:\n"
IGNORE_INDEX = -100  # the label PyTorch's cross-entropy (and HF models) leave out of the loss


def format_prompt(record: dict[str, Any], tokenizer: Any = None) -> tuple[str, str]:
    """(prompt text, response text) of an Alpaca, prompt/response or chat record."""
    if "messages" in record:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("--messages-field: the tokenizer of --model has no chat template; "
                             "name --prompt-field/--response-field (or --text-field) instead")
        return (tokenizer.apply_chat_template(record["messages"][:-1], tokenize=False,
                                              add_generation_prompt=True),
                record["messages"][-1]["content"])
    if "prompt" in record:
        return record["prompt"], record["response"]
    template = PROMPT_TEMPLATE if record.get("input") else PROMPT_TEMPLATE_NO_INPUT
    return (template.format(instruction=record["instruction"], input=record.get("input", "")),
            record["output"])


SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
           "mask_token")  # the named special tokens a chat template sees, as transformers passes


class TextTokenizer:
    """A saved fast tokenizer read with `tokenizers` alone, as transformers reads it."""

    def __init__(self, folder: Path, config: dict[str, Any]) -> None:
        from tokenizers import Tokenizer

        self.backend_tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.special = {k: v["content"] if isinstance(v, dict) else v for k, v in config.items()
                        if k in SPECIAL and v}
        for name in ("bos", "eos", "pad"):
            token = self.special.get(f"{name}_token")
            setattr(self, f"{name}_token_id",
                    None if token is None else self.backend_tokenizer.token_to_id(token))
        template = folder / "chat_template.jinja"
        self.chat_template = template.read_text() if template.is_file() else \
            config.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: the default one
            self.chat_template = next((t["template"] for t in self.chat_template
                                       if t["name"] == "default"), None)
        self._render = _compiled(self.chat_template) if self.chat_template else None

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def apply_chat_template(self, messages: list[dict[str, str]], tokenize: bool = False,
                            add_generation_prompt: bool = False) -> str:
        assert not tokenize, "text only, as format_prompt asks"
        return self._render(messages=messages, tools=None, documents=None,
                            add_generation_prompt=add_generation_prompt, **self.special)


@lru_cache(maxsize=4)
def _compiled(template: str) -> Any:
    """The template's render, in the sandbox and with the helpers transformers gives it."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, \
        sort_keys=False: json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                                    separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=raise_exception, dict=dict,
                       strftime_now=lambda f: dt.datetime.now().strftime(f))
    return env.from_string(template).render


@lru_cache(maxsize=4)
def load_tokenizer(tokenizer_dir: str, version: str = "") -> Any:
    """tokenizer_dir's TextTokenizer, once per version, else transformers'."""
    folder = Path(tokenizer_dir)
    config: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # the latter wins
        if (folder / name).is_file():
            config.update(json.loads((folder / name).read_text()))
    with contextlib.suppress(Exception):  # jinja's, tokenizers', a file's: transformers' then
        tok = TextTokenizer(folder, config)
        if tok.eos_token_id is not None and tok.pad_token_id is not None:
            return tok
    return hf_tokenizer(tokenizer_dir, version)


@lru_cache(maxsize=4)
def hf_tokenizer(tokenizer_dir: str, version: str = "") -> Any:
    """transformers' fast tokenizer of tokenizer_dir, once per process."""
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir)
    if tok.eos_token_id is None or tok.pad_token_id is None:
        raise ValueError(f"tokenizer_dir={tokenizer_dir!r}: the tokenizer needs an eos and a pad "
                         "token (set tokenizer.pad_token = tokenizer.eos_token if it has none)")
    return tok


def encode_pairs(tokenizer: Any, records: list[dict[str, Any]]
                 ) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt ids, response ids) of each record, apart so the loss mask is exact."""
    pairs = [format_prompt(r, tokenizer) for r in records]
    rust = tokenizer.backend_tokenizer  # the Rust batch call: no BatchEncoding per row
    prompts: list[list[int]] = [[] for _ in records]
    for special in (True, False):  # one batch per kind; a chat template writes its own BOS
        rows = [i for i, r in enumerate(records) if ("messages" not in r) is special]
        encoded = rust.encode_batch_fast([pairs[i][0] for i in rows], add_special_tokens=special)
        for i, e in zip(rows, encoded):
            prompts[i] = e.ids
    responses = rust.encode_batch_fast([r for _, r in pairs], add_special_tokens=False)
    return prompts, [e.ids for e in responses]
