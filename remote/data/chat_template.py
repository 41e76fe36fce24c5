"""The target's chat template and tokenizer: conversations -> (input_ids, loss_mask), as the target is served.

    chat = ChatTokenizer("/models/target")                 # BadInput: no tokenizer files, no chat template
    pieces, cut = chat.pieces(conv.turns)                  # [(text, written_by_assistant)], turns left out
    [(ids, mask)] = chat.encode([pieces])                  # mask: 1 on what the assistant wrote
    chat.identity()                                        # sha256 of vocabulary, rules and template
    turns, shortened = chat.within(conv.turns, 2048)       # what 2,048 tokens of it can hold, with a margin

A conversation's text is cut before it is rendered and tokenized (`within`): a token spells at most
`max_token_chars` characters (the longest entry of the vocabulary: a byte-level BPE's entries are one
character a byte, and a character is one byte or more), so text past (max_tokens + CUT_MARGIN_TOKENS) x
max_token_chars characters lies past the first max_tokens + CUT_MARGIN_TOKENS tokens, and cutting it changes
none of the first max_tokens: a record of any size costs what max_tokens can keep. (A tokenizer whose
normalizer removes characters breaks the bound: the prepare step checks the tokens it got, prepare.py.)

Used by the prepare step (the dataset's tokens and loss mask) and the regenerate step (its prompts and the
answers' control tokens). How the loss mask follows from rendering is in remote/data/prepare.py's docstring.
A conversation the template cannot render is a remote.data.chat_data.BadRecord with one of the reasons below.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from remote.data.chat_data import BadRecord
from remote.step import BadInput

# Bad data found only with the target's tokenizer.
SPECIAL_TOKEN_IN_TEXT = "special_token_in_text"  # text that would tokenize as a control token
TEMPLATE_ERROR = "template_error"  # the template refused the conversation (e.g. no system role)
TEMPLATE_NOT_INCREMENTAL = "template_not_incremental"  # no assistant turn renders as a growing prefix
# Tokens past max_tokens kept before a cut: a cut changes the tokens next to it (a word cut in two: a pre-token
# of a byte-level BPE is a word, a number, a run of spaces or of punctuation), not this many before it.
CUT_MARGIN_TOKENS = 256


class ChatTokenizer:
    """The target's tokenizer and chat template, turning conversations into (input_ids, loss_mask)."""

    def __init__(self, path: str, trust_remote_code: bool = False):
        # AutoTokenizer, as vLLM loads it, so the ids are the ones the target is served with.
        from transformers import AutoTokenizer

        if not Path(path, "tokenizer_config.json").is_file() and not Path(path, "tokenizer.json").is_file():
            raise BadInput(f"tokenizer {path}: no tokenizer files there (a target model folder is expected)")
        self.tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        if not self.tok.chat_template:
            raise BadInput(f"tokenizer {path} has no chat template: the loss mask needs the target's template")
        specials = {i: t.content for i, t in self.tok.added_tokens_decoder.items() if t.special}
        self.special_ids = frozenset(specials)
        longest_first = sorted(specials.values(), key=len, reverse=True)
        self._special_text = re.compile("|".join(map(re.escape, longest_first))) if specials else None
        self.max_token_chars = max(map(len, self.tok.get_vocab()), default=1)  # the most characters a token spells

    def within(self, turns: tuple[tuple[str, str], ...], max_tokens: int) -> tuple[tuple[tuple[str, str], ...], bool]:
        """(the turns cut where the conversation has surely passed max_tokens + CUT_MARGIN_TOKENS tokens, whether
        they were): the text there is cut; of the turns after it, those up to the next assistant turn stay, one
        character each (that reply's rendering is what puts the cut text into a piece), the rest are left out.
        The first max_tokens tokens stay the same."""
        left = (max_tokens + CUT_MARGIN_TOKENS) * self.max_token_chars
        for k, (role, text) in enumerate(turns):
            if len(text) > left:
                end = next((j for j in range(k, len(turns)) if turns[j][0] == "assistant"), len(turns) - 1)
                return turns[:k] + ((role, text[:left]),) + tuple((r, t[:1]) for r, t in turns[k + 1:end + 1]), True
            left -= len(text)
        return turns, False

    def identity(self) -> str:
        """sha256 of everything in the tokenizer that changes the tokens: vocabulary, rules, template."""
        backend = getattr(self.tok, "backend_tokenizer", None)
        body = backend.to_str() if backend is not None else json.dumps(sorted(self.tok.get_vocab().items()))
        return hashlib.sha256((body + "\0" + str(self.tok.chat_template)).encode()).hexdigest()

    def check_text(self, turns: tuple[tuple[str, str], ...]) -> None:
        """BadRecord when a text holds a control token of the tokenizer (a scan: no copy of a long text)."""
        for _, content in turns:
            if self._special_text is not None and (m := self._special_text.search(content)):
                raise BadRecord(SPECIAL_TOKEN_IN_TEXT, f"the text holds {m.group()!r}, a control token of the tokenizer")

    def pieces(self, turns: tuple[tuple[str, str], ...]) -> tuple[list[tuple[str, bool]], int]:
        """The rendered conversation as (text, written_by_assistant) pieces, and the turns cut off."""
        self.check_text(turns)
        msgs = [{"role": r, "content": c} for r, c in turns]
        out, done, kept = [], "", 0  # pieces so far, their text, the turns they cover
        for j in (j for j, (role, _) in enumerate(turns) if role == "assistant"):
            prompt, reply = self._render(msgs[:j], True), self._render(msgs[: j + 1], False)
            if not (prompt.startswith(done) and reply.startswith(prompt) and len(reply) > len(prompt)):
                if not out:
                    raise BadRecord(TEMPLATE_NOT_INCREMENTAL, f"turn {j}: the template does not render the "
                                    "reply as an extension of its prompt")
                break  # keep the turns the template renders as a growing prefix
            out += [(prompt[len(done):], False), (reply[len(prompt):], True)]
            done, kept = reply, j + 1
        return out, len(turns) - kept

    def _render(self, msgs: list[dict], generation_prompt: bool) -> str:
        from jinja2 import TemplateError

        try:
            return self.tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=generation_prompt)
        except TemplateError as e:
            raise BadRecord(TEMPLATE_ERROR, f"the chat template refused it: {e}") from e

    def encode(self, batch: list[list[tuple[str, bool]]]) -> list[tuple[list[int], list[int]]]:
        """(input_ids, loss_mask) of each rendered conversation; all pieces tokenized in one call."""
        texts = [text for pieces in batch for text, _ in pieces]
        ids_of = iter(self.tok(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"])
        out = []
        for pieces in batch:
            ids, mask = [], []
            for _, by_assistant in pieces:
                piece = next(ids_of)
                ids += piece
                mask += self._reply_mask(piece) if by_assistant else [0] * len(piece)
            out.append((ids, mask))
        return out

    def _reply_mask(self, piece: list[int]) -> list[int]:
        """1 through the reply's last special token (its end-of-turn marker), 0 on what follows it."""
        last = next((k for k in range(len(piece) - 1, -1, -1) if piece[k] in self.special_ids), len(piece) - 1)
        return [1] * (last + 1) + [0] * (len(piece) - last - 1)
