"""The checkpoint's tokenizer: ``tokenizer.json`` through the ``tokenizers`` library (what
``transformers``' fast tokenizers run), its special tokens from ``tokenizer_config.json``, and
:class:`IncrementalDecoder`, which turns a stream of token ids into text without ever emitting
half a character or a piece of text that a later token would change.

The demo model's byte-level toy tokenizer (:class:`ByteTokenizer`: ids 0-255 are bytes) has
the same interface, so every tool can take either.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Sequence
from typing import Any

__all__ = ["TokenizerError", "TextTokenizer", "ByteTokenizer", "IncrementalDecoder", "load_tokenizer"]

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded, or a token it does not know."""


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` and its special tokens."""

    def __init__(self, tokenizer, config: dict[str, Any] | None = None, chat_template: str | None = None):
        self.tokenizer = tokenizer
        self.config = dict(config or {})
        template = chat_template if chat_template is not None else self.config.get("chat_template")
        self.chat_template = template if isinstance(template, str) and template.strip() else None
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int | None:
        """The most characters of text one token covers, for a BPE vocabulary that never
        stands one unknown token for a run of text (no ``unk_token``, or byte fallback): its
        longest entry, since each input character is spelled by at least one character of the
        entries (bytes in a byte-level vocabulary), so ``len(text) <= tokens * max_token_chars``.
        None for other models (WordPiece's ``[UNK]`` stands for a whole word)."""
        model = self.tokenizer.model
        if type(model).__name__ != "BPE" or (model.unk_token is not None and not model.byte_fallback):
            return None
        return max((len(t) for t in self.tokenizer.get_vocab(with_added_tokens=True)), default=1)

    def token_id(self, token: str) -> int:
        tid = self.tokenizer.token_to_id(token)
        if tid is None:
            raise TokenizerError(f"the tokenizer has no token {token!r}")
        return int(tid)

    @property
    def bos_id(self) -> int | None:
        return self.token_id(self.bos_token) if self.bos_token else None

    @property
    def eos_id(self) -> int | None:
        return self.token_id(self.eos_token) if self.eos_token else None

    def token_text(self, token_id: int) -> str:
        text = self.tokenizer.id_to_token(int(token_id))
        if text is None:
            raise TokenizerError(f"the tokenizer has no token id {token_id}")
        return text

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, special tokens written in it recognised, none added."""
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decoder(self, skip_special_tokens: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens)


class ByteTokenizer:
    """The demo model's tokenizer: UTF-8 bytes are ids 0-255; ``<PAGE>``, ``<image>`` and the
    end-of-sequence token are the config's ids (:func:`dash_trt.models.prompts.tokenize`)."""

    chat_template = None
    bos_id = None

    def __init__(self, config):
        self.config = config
        self.eos_id = config.eos_token_id
        self._special = {config.page_token_id: "<PAGE>", config.image_token_id: "<image>"}

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def max_token_chars(self) -> int:
        """The most characters one token covers: ``<image>`` (a byte token covers at most one)."""
        return max(len(t) for t in self._special.values())

    def token_id(self, token: str) -> int:
        for tid, text in self._special.items():
            if text == token:
                return tid
        raise TokenizerError(f"the byte-level tokenizer has no token {token!r}")

    def token_text(self, token_id: int) -> str:
        if token_id in self._special:
            return self._special[token_id]
        raise TokenizerError(f"the byte-level tokenizer has no special token id {token_id}")

    def encode(self, text: str) -> list[int]:
        from ..models.prompts import tokenize  # the demo model's tokenizer (imports torch)

        return tokenize(text, self.config)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        raw, out = bytearray(), []
        for i in ids:
            if 0 <= i < 256:
                raw.append(i)
                continue
            out.append(raw.decode("utf-8", "replace"))
            raw = bytearray()
            if not skip_special_tokens:
                out.append(self._special.get(i, f"<{i}>"))
        out.append(raw.decode("utf-8", "replace"))
        return "".join(out)

    def decoder(self, skip_special_tokens: bool = False) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens)


class IncrementalDecoder:
    """Text of a growing list of token ids, emitted only when it is final.

    The usual scheme (vLLM's ``detokenize_incrementally``, ``transformers``' ``TextStreamer``): the
    text of the last few tokens is decoded again with each new one; the part that extends the
    text already emitted is emitted, unless it ends in U+FFFD (a character whose bytes are not
    all there yet: a later token completes it). Joined, the pieces are the decode of all the
    ids."""

    #: tokens kept before the ones being decoded (a merge may change the text of their boundary)
    CONTEXT = 6

    def __init__(self, tokenizer, skip_special_tokens: bool = False):
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # start of the tokens whose text is decoded again
        self.read = 0  # tokens whose text has been emitted

    def push(self, token_id: int) -> str:
        """Add one token; the new final text (possibly empty)."""
        self.ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        """The text still held back (at the end of the sequence: an incomplete character comes
        out as U+FFFD, as a full decode gives it)."""
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        dec = self.tokenizer.decode
        before = dec(self.ids[self.prefix : self.read], self.skip)
        now = dec(self.ids[self.prefix :], self.skip)
        if len(now) <= len(before) or (now.endswith("\ufffd") and not final):
            return ""
        piece = now[len(before) :]
        self.read = len(self.ids)
        self.prefix = max(0, self.read - self.CONTEXT)
        return piece


def load_tokenizer(folder: str | os.PathLike) -> TextTokenizer:
    """The tokenizer of a checkpoint folder: ``tokenizer.json``, with ``tokenizer_config.json``
    (special tokens, ``chat_template``) and ``chat_template.jinja`` when present."""
    folder = os.fspath(folder)
    path = os.path.join(folder, TOKENIZER_FILE)
    if not os.path.isfile(path):
        raise TokenizerError(f"{folder} has no {TOKENIZER_FILE} (the checkpoint's tokenizer)")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise TokenizerError(
            "the tokenizer needs the 'tokenizers' package (pip install 'dash-trt[documents]')"
        ) from None
    try:
        tok = Tokenizer.from_file(path)
    except Exception as exc:  # noqa: BLE001 - the library raises its own Exception type
        raise TokenizerError(f"{path} is not a readable tokenizer: {exc}") from None
    config: dict[str, Any] = {}
    cfg_path = os.path.join(folder, TOKENIZER_CONFIG)
    if os.path.isfile(cfg_path):
        try:
            with open(cfg_path, encoding="utf-8") as fh:
                config = json.load(fh)
        except (OSError, json.JSONDecodeError) as exc:
            raise TokenizerError(f"{cfg_path} is not valid JSON: {exc}") from None
    template = None
    tpl_path = os.path.join(folder, CHAT_TEMPLATE_FILE)
    if os.path.isfile(tpl_path):
        with open(tpl_path, encoding="utf-8") as fh:
            template = fh.read()
    return TextTokenizer(tok, config, template)
