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

    :attr:`num_tokens` counts the pushed ids that belong to the completion: all of them until a stop string is
    found, then only up to the id that completed it. A step's accepted window can run a few ids past a stop
    string, and how far depends on γ and on the batch (auto γ), so counting them would make the same seeded
    completion's ``usage.completion_tokens`` depend on the server's load.

    Cost: one decode of the whole completion per push (O(n) per step), fine for completions of a few thousand
    tokens; at a stop string, one more decode per id of that push.
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
        self.num_tokens = 0          # pushed ids that belong to the completion (none past a stop string)
        self._longest = max((len(s) for s in self.stop_strings), default=0)

    def push(self, ids: Sequence[int]) -> str:
        """Add newly generated ids; return the text that may now be shown (possibly ``""``). After a stop string
        is found, :attr:`stopped` is True and later pushes return ``""``."""
        if self.stopped:
            return ""
        new = [int(i) for i in ids]
        before = len(self.ids)
        self.ids.extend(i for i in new if i not in self.stop_ids)
        self.text = self._decode(self.ids)
        if self.stop_strings:
            start = max(0, self.emitted - self._longest)
            hits = [h for h in (self.text.find(s, start) for s in self.stop_strings) if h >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                self.num_tokens += self._ids_to_stop(new, before, start)
                return self._take(len(self.text))
        self.num_tokens += len(new)
        return self._take(len(self.text) - self._held_back())

    def _decode(self, ids: list[int]) -> str:
        # Without the tokenizer's space cleanup (" 's" -> "'s", " ," -> ","): with it, more ids can rewrite text
        # already shown ("it '" + "s" -> "it's"), and a stream cannot take back what it sent.
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def _ids_to_stop(self, new: list[int], before: int, start: int) -> int:
        """How many of the pushed ids ``new`` it took to complete a stop string (the text ids before them are
        ``self.ids[:before]``); the rest ran past it."""
        text_ids = self.ids[:before]
        for k, i in enumerate(new, 1):
            if i in self.stop_ids:
                continue
            text_ids.append(i)
            text = self._decode(text_ids)
            if any(text.find(s, start) >= 0 for s in self.stop_strings):
                return k
        return len(new)

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
