"""Where a completion stops: the stop-token set and stop strings on detokenized text. Engine-neutral: used by
``decode generate``, ``decode bench`` and the server.

Stop set rule (the same everywhere): the tokenizer's eos ∪ every eos id in the target's ``generation_config``
∪ the request's own stop ids. Hugging Face ``generate`` stops at any id of ``generation_config.eos_token_id``
(an int or a list; Llama 3 and Qwen list several), so a decoder that only knows ``tokenizer.eos_token_id``
runs past the others.
"""
from __future__ import annotations

from typing import Any, Iterable, Sequence


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value if v is not None]


def stop_token_ids(tokenizer: Any, target: Any = None, extra: Iterable[int] | None = None) -> list[int]:
    """The sorted stop ids: ``tokenizer.eos_token_id`` ∪ ``target.generation_config.eos_token_id`` (int or list)
    ∪ ``extra``.

    Args:
        tokenizer: a Hugging Face tokenizer, or None.
        target: the target model (its ``generation_config``, when it has one), or None.
        extra: a request's own stop ids.
    """
    ids = set(_ids(getattr(tokenizer, "eos_token_id", None)))
    gen_cfg = getattr(target, "generation_config", None)
    ids.update(_ids(getattr(gen_cfg, "eos_token_id", None)))
    ids.update(_ids(extra))
    return sorted(ids)


class StopStringFilter:
    """Turns a growing list of generated ids into text deltas that never pass a stop string.

    Each :meth:`push` decodes all text ids so far (``skip_special_tokens=True``, ``clean_up_tokenization_spaces=
    False`` so that text only grows), looks for the earliest stop
    string, and returns only text that is safe to show: a suffix that could still grow into a stop string, or
    an incomplete UTF-8 character (decoded as U+FFFD by byte-level tokenizers), is held back until the next
    push or :meth:`flush`. So a stop string that spans tokens, or falls inside one step's accepted draft window,
    is cut exactly where it starts. Ids in ``stop_ids`` end the completion and are not part of its text.

    Cost: one decode of the whole completion per push (O(n) per step), fine for completions of a few thousand
    tokens.
    """

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str] = (), stop_ids: Iterable[int] = ()):
        if any(not s for s in stop_strings):
            raise ValueError("stop strings must be non-empty")
        self.tokenizer = tokenizer
        self.stop_strings = list(stop_strings)
        self.stop_ids = set(stop_ids)
        self.ids: list[int] = []     # text ids (stop ids excluded)
        self.text = ""               # decoded text so far, cut at a stop string once one is found
        self.emitted = 0             # characters of self.text already returned
        self.stopped = False         # a stop string was found
        self._longest = max((len(s) for s in self.stop_strings), default=0)

    def push(self, ids: Sequence[int]) -> str:
        """Add newly generated ids; return the text that may now be shown (possibly ``""``). After a stop string
        is found, :attr:`stopped` is True and later pushes return ``""``."""
        if self.stopped:
            return ""
        self.ids.extend(int(i) for i in ids if int(i) not in self.stop_ids)
        # Without the tokenizer's space cleanup (" 's" -> "'s", " ," -> ","): with it, more ids can rewrite text
        # already shown ("it '" + "s" -> "it's"), and a stream cannot take back what it sent.
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if self.stop_strings:
            start = max(0, self.emitted - self._longest)
            hits = [h for h in (self.text.find(s, start) for s in self.stop_strings) if h >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                return self._take(len(self.text))
        return self._take(len(self.text) - self._held_back())

    def flush(self) -> str:
        """The completion ended: return everything not yet shown (up to a stop string when one was found)."""
        return self._take(len(self.text))

    def _held_back(self) -> int:
        hold = 0
        for s in self.stop_strings:  # the longest suffix of the text that is a proper prefix of a stop string
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        n_bad = len(self.text) - len(self.text.rstrip("\ufffd"))
        return max(hold, n_bad)

    def _take(self, end: int) -> str:
        end = max(end, self.emitted)
        delta, self.emitted = self.text[self.emitted:end], end
        return delta
