"""Incremental detokenization and stop strings, on the router (as in vLLM v1, where the
output processor owns both and aborts the engine request on a stop-string match).

Text comes from `tokenizers.decoders.DecodeStream`, which emits a delta only once it
is valid UTF-8 (a multi-byte character split across tokens is held until complete).
While stop strings are set, the last `max(len(stop)) - 1` characters are held back,
since they may be the start of a stop string; they are released on finish.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenizers.decoders import DecodeStream


@dataclass(frozen=True, slots=True)
class Delta:
    text: str                    # new text to send (may be empty)
    stopped: bool = False        # a stop string matched: finish with "stop", send no more


class Detokenizer:
    def __init__(self, tokenizer, prompt_ids: list[int], stop: tuple[str, ...] = ()):
        """`tokenizer`: a transformers fast tokenizer; `prompt_ids` prime the stream so the
        first generated token decodes in context (leading-space handling)."""
        self._tok = tokenizer._tokenizer if hasattr(tokenizer, "_tokenizer") else tokenizer.backend_tokenizer
        # Prime with the prompt's tail so the first token decodes in context, but only up
        # to a character boundary: a prompt ending mid-character (token_ids continuing a
        # cut-off generation) would otherwise make the first delta repeat prompt text.
        window, tail = list(prompt_ids[-8:]), []
        while window and self._tok.decode(window).endswith("\ufffd"):
            tail.insert(0, window.pop())
        self._stream = DecodeStream(ids=window, skip_special_tokens=True)
        for t in tail:
            self._stream.step(self._tok, t)   # pending bytes, completed by the output
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._text = ""              # decoded, not yet sent
        self.sent = ""               # everything sent so far

    def token_text(self, token_id: int) -> str:
        """One token decoded alone, special tokens included (logprobs' "token")."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def step(self, token_id: int) -> Delta:
        piece = self._stream.step(self._tok, token_id)
        if piece:
            self._text += piece
        if self._stop:
            window = self.sent[-self._hold:] if self._hold else ""
            hay = window + self._text
            hits = [i for i in (hay.find(s) for s in self._stop) if i >= 0]
            if hits:
                cut = min(hits) - len(window)
                out, self._text = self._text[:max(cut, 0)], ""
                self.sent += out
                return Delta(out, stopped=True)
        keep = min(self._hold, len(self._text))
        out = self._text[:len(self._text) - keep]
        self._text = self._text[len(self._text) - keep:]
        self.sent += out
        return Delta(out)

    def flush(self) -> str:
        """Release held-back text at the end of the request."""
        out, self._text = self._text, ""
        self.sent += out
        return out
