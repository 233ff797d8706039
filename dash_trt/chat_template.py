"""A checkpoint's chat template rendered in jinja2's sandbox: the one place that renders one.

The document prompt (:mod:`dash_trt.documents.prompt`) and the OpenAI front door's chat
completions (:mod:`dash_trt.frontdoor.chat`) both come here, so the security rule (an
``ImmutableSandboxedEnvironment``: a template can neither reach Python internals nor change
state) has one owner. The environment is Hugging Face's: ``trim_blocks``, ``lstrip_blocks``, a
``raise_exception`` global, ``add_generation_prompt`` true, the tokenizer's special tokens
(``bos_token``, ``eos_token``) as variables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

__all__ = ["PromptError", "render_chat"]


class PromptError(ValueError):
    """A prompt that cannot be built (a template error, a missing token)."""


def render_chat(
    template: str,
    content: str | Sequence[Mapping[str, str]],
    special: Mapping[str, str | None],
) -> str:
    """``template`` rendered with ``add_generation_prompt`` true, in jinja2's
    ImmutableSandboxedEnvironment: templates cannot reach Python internals or change state.

    ``content`` is the text of one user message, or the messages themselves (``{"role": ...,
    "content": ...}`` each); ``special`` the tokenizer's special tokens (``None`` ones left out).
    A template error, ``raise_exception`` included, is a :class:`PromptError`."""
    try:
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise PromptError("chat templates need jinja2 (pip install 'dash-trt[documents]')") from None

    def raise_exception(message):
        raise TemplateError(message)

    messages = [{"role": "user", "content": content}] if isinstance(content, str) else list(content)
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    try:
        return env.from_string(template).render(
            messages=messages,
            add_generation_prompt=True,
            **{k: v for k, v in special.items() if v is not None},
        )
    except TemplateError as exc:
        raise PromptError(f"the chat template failed: {exc}") from None
