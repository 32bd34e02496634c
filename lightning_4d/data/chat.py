"""Encoding one example with a Hugging Face tokenizer: a chat conversation through the tokenizer's own chat
template, with the tokens of the assistant's answers marked, or a plain-text document.

:func:`encode_chat` returns exactly the ids ``tokenizer.apply_chat_template(messages)`` returns, plus a mask
that is 1 on the tokens of assistant turns (their content and the end-of-turn marker the template writes
after it) and 0 on everything else (system and user turns, the template's role headers). Data pipelines turn
mask-0 targets into ``ignore_index``, so only answers are trained on.

How the answer tokens are found:

- templates with ``{% generation %}`` markers: transformers' own ``return_assistant_tokens_mask``;
- any other template: the conversation is rendered once as text, and for each assistant turn ``k`` the text
  of the first ``k`` messages with the generation prompt (where the answer starts) and of the first ``k + 1``
  messages (where it ends); both must be prefixes of the whole text, which holds for templates that render
  a conversation turn by turn (ChatML, Llama 3, Mistral, ...). The whole text is tokenized once and a token
  belongs to the answer when its first character does. A template that rewrites earlier turns (one that
  drops the reasoning of past answers, say) is refused with a clear error.

Example:
    >>> # not run: needs files (a tokenizer with a chat template)
    >>> ids, mask = encode_chat(tokenizer, [{"role": "user", "content": "hi"},
    ...                                     {"role": "assistant", "content": "hello"}])  # doctest: +SKIP
    >>> ids == tokenizer.apply_chat_template(messages)["input_ids"]  # doctest: +SKIP
    True
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Optional, Union

import numpy as np

if TYPE_CHECKING:
    from transformers import BatchEncoding, PreTrainedTokenizerBase

__all__ = ["ChatTemplateError", "encode_chat", "encode_chats", "encode_texts", "to_messages"]

Message = Mapping[str, Any]


class ChatTemplateError(ValueError):
    """A conversation or chat template that cannot be encoded as asked; the message names the example and a fix.

    Example:
        >>> str(ChatTemplateError("no template"))
        'no template'
    """


def _has_generation_markers(template: Optional[str]) -> bool:
    return isinstance(template, str) and "generation" in template and "endgeneration" in template


def _ids(encoded: Union[BatchEncoding, Sequence[int]]) -> list[int]:
    ids = encoded["input_ids"] if isinstance(encoded, Mapping) or hasattr(encoded, "keys") else encoded
    return [int(i) for i in ids]


def _render(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message], generation_prompt: bool = False) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)


def to_messages(example: Mapping[str, Any], messages_field: str = "messages", prompt_field: str = "prompt",
                response_field: str = "response", system_prompt: Optional[str] = None) -> list[dict[str, Any]]:
    """The conversation of one row: its ``messages_field`` (a list of ``{"role", "content"}``), or a user turn
    from ``prompt_field`` and an assistant turn from ``response_field`` (instruction data); ``system_prompt``
    (if given) is prepended when the conversation has no system turn.

    Raises:
        ChatTemplateError: the row has neither the messages field nor both instruction fields, or a message
            lacks ``role`` / ``content``.

    Example:
        >>> to_messages({"prompt": "2+2?", "response": "4"})
        [{'role': 'user', 'content': '2+2?'}, {'role': 'assistant', 'content': '4'}]
    """
    if example.get(messages_field) is not None:
        messages = [dict(m) for m in example[messages_field]]
    elif example.get(prompt_field) is not None and example.get(response_field) is not None:
        messages = [{"role": "user", "content": example[prompt_field]},
                    {"role": "assistant", "content": example[response_field]}]
    else:
        raise ChatTemplateError(
            f"a row has neither {messages_field!r} (a list of {{'role', 'content'}} messages) nor both "
            f"{prompt_field!r} and {response_field!r}; its fields are {sorted(example)}. Set data.messages_field, "
            f"or data.prompt_field and data.response_field, to the names your data uses."
        )
    for m in messages:
        if "role" not in m or "content" not in m:
            raise ChatTemplateError(f"message {m!r} needs a 'role' and a 'content'.")
    if system_prompt is not None and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def _check(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message]) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ChatTemplateError(
            f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template, so chat data cannot be "
            f"rendered. Use a tokenizer with one (tokenizer.chat_template = ...; save_pretrained), or data=hf_text "
            f"for plain text."
        )
    answers = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if not answers:
        raise ChatTemplateError(
            f"a conversation has no assistant turn, so nothing in it would be trained on: {list(messages)!r:.200}")
    return answers


def _answer_spans(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message],
                  answers: Sequence[int]) -> tuple[str, list]:
    """The rendered conversation and the character span of each answer (see the module docstring)."""
    text = _render(tokenizer, messages)
    spans: list[tuple[int, int]] = []
    for k in answers:
        start_text = _render(tokenizer, messages[:k], generation_prompt=True) if k else ""
        end_text = text if k == len(messages) - 1 else _render(tokenizer, messages[: k + 1])
        if not (text.startswith(start_text) and text.startswith(end_text) and len(start_text) <= len(end_text)):
            raise ChatTemplateError(
                f"the chat template renders the first {k + 1} messages of a conversation differently from the start "
                f"of the whole conversation (it rewrites earlier turns, e.g. drops past reasoning), so the answer "
                f"tokens cannot be located. Use a template with {{% generation %}} markers, or data.mask_prompt=false "
                f"to train on every token."
            )
        spans.append((len(start_text), len(end_text)))
    return text, spans


def encode_chats(tokenizer: PreTrainedTokenizerBase, conversations: Sequence[Sequence[Message]],
                 mask_prompt: bool = True) -> list[tuple[list[int], list[int]]]:
    """:func:`encode_chat` of many conversations, tokenized in one batched call.

    Example:
        >>> # not run: needs files (a tokenizer with a chat template)
        >>> [ids for ids, _ in encode_chats(tok, [conversation_a, conversation_b])]  # doctest: +SKIP
        [[1, 87, ...], [1, 92, ...]]
    """
    answers = [_check(tokenizer, messages) for messages in conversations]
    if mask_prompt and _has_generation_markers(tokenizer.chat_template):
        out = []
        for messages in conversations:
            enc = tokenizer.apply_chat_template(list(messages), return_assistant_tokens_mask=True, return_dict=True)
            out.append((_ids(enc), [int(m) for m in enc["assistant_masks"]]))
        return out
    if not mask_prompt:
        texts = [_render(tokenizer, messages) for messages in conversations]
        return [(ids, [1] * len(ids)) for ids in
                ([int(i) for i in x] for x in tokenizer(texts, add_special_tokens=False)["input_ids"])]
    rendered = [_answer_spans(tokenizer, messages, k) for messages, k in zip(conversations, answers)]
    encoded = tokenizer([text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
    out = []
    for (_, spans), ids, offsets in zip(rendered, encoded["input_ids"], encoded["offset_mapping"]):
        starts = np.asarray([begin for begin, _ in offsets], dtype=np.int64)
        mask = np.zeros(len(starts), dtype=bool)
        for begin, end in spans:  # a token belongs to the answer whose span holds its first character
            mask |= (starts >= begin) & (starts < end)
        out.append(([int(i) for i in ids], mask.astype(int).tolist()))
    return out


def encode_chat(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Message],
                mask_prompt: bool = True) -> tuple[list[int], list[int]]:
    """``(ids, mask)`` of one conversation: ``ids`` are what ``tokenizer.apply_chat_template(messages)`` returns,
    ``mask`` is 1 on the tokens of assistant turns (all 1 with ``mask_prompt=False``). See the module docstring;
    :func:`encode_chats` does many at once.

    Args:
        tokenizer: a ``transformers`` tokenizer with a chat template (a fast one without ``{% generation %}``
            markers: offsets are needed).
        messages: the conversation, ``[{"role": ..., "content": ...}, ...]``.
        mask_prompt: mark only the answers (``False``: every token).

    Raises:
        ChatTemplateError: no chat template; no assistant turn; a template that rewrites earlier turns.

    Example:
        >>> # not run: needs files (a tokenizer with a chat template)
        >>> ids, mask = encode_chat(tok, [{"role": "user", "content": "hi"},
        ...                               {"role": "assistant", "content": "yo"}])  # doctest: +SKIP
        >>> tok.decode([i for i, m in zip(ids, mask) if m])  # doctest: +SKIP
        'yo<|im_end|>\\n'
    """
    return encode_chats(tokenizer, [messages], mask_prompt)[0]


def encode_texts(tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], eos_id: int) -> list[list[int]]:
    """Plain-text documents as the model reads them, in one batched call: the tokenizer's own special tokens
    (a BOS for Llama-style tokenizers), then the text, then ``eos_id`` (once, also when the tokenizer appends it
    itself).

    Example:
        >>> def tok(texts, add_special_tokens):  # a stand-in: BOS 1, then one id per character
        ...     return {"input_ids": [[1, *map(ord, t)] for t in texts]}
        >>> encode_texts(tok, ["hi", "yo"], eos_id=2)
        [[1, 104, 105, 2], [1, 121, 111, 2]]
    """
    out = []
    for ids in tokenizer(list(texts), add_special_tokens=True)["input_ids"]:
        ids = [int(i) for i in ids]
        if not ids or ids[-1] != eos_id:
            ids.append(int(eos_id))
        out.append(ids)
    return out
