"""Token ids -> text, incrementally: multi-byte characters split over tokens are never mangled,
and the text can be cut at the first of a request's stop strings."""

from __future__ import annotations

import codecs


class TextStream:
    """`feed(tokens)` returns the text that is final so far (with stop strings, the tail that could
    still become the start of one is held back until `flush`); `text` is all of it, cut before
    the first stop string seen, and `hit` says whether one was."""

    def __init__(self, model, stops: list[str] | tuple[str, ...] = ()):
        self.model = model
        self.stops = list(stops)
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.hit = False
        self._given = 0  # characters of `text` already returned

    def feed(self, tokens) -> str:
        if self.hit:
            return ""
        start = max(0, len(self.text) - self._hold)
        self.text += self._dec.decode(b"".join(self.model.piece(t) for t in tokens))
        for s in self.stops:
            i = self.text.find(s, start)
            if i >= 0:
                self.text = self.text[:i]
                self.hit = True
        return self._give(len(self.text) if self.hit else len(self.text) - self._hold)

    @property
    def given(self) -> str:
        """The text returned so far (by `feed` and `flush`)."""
        return self.text[: self._given]

    def flush(self) -> str:
        """The rest: held-back text and bytes of an unfinished character."""
        if not self.hit:
            self.text += self._dec.decode(b"", final=True)
        return self._give(len(self.text))

    def final(self) -> str:
        """All the text (after `flush`)."""
        self.flush()
        return self.text

    def _give(self, upto: int) -> str:
        upto = max(upto, self._given)
        piece = self.text[self._given:upto]
        self._given = upto
        return piece
