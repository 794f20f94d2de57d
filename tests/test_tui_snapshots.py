"""Layout snapshots of `edgespec chat` with a scripted session: no model, fixed events, no blink."""

import pytest

pytest.importorskip("textual")
pytest.importorskip("pytest_textual_snapshot")

from edgespec.events import Stats, StepEvent  # noqa: E402
from edgespec.frontends.session import Reply  # noqa: E402
from edgespec.tui.app import ChatApp, PromptInput  # noqa: E402

WORDS = ["Speculative", " decoding", " drafts", " tokens", " cheaply", ";", " the", " target", " checks",
         " them", " all", " in", " one", " pass", ".", "\n\n", "- ", "lossless", "\n", "- ", "faster"]
STEPS = [(0, 1), (2, 4), (1, 2), (3, 4), (0, 1), (2, 3), (1, 1), (2, 3), (0, 2)]  # (accepted, committed)


class ScriptedSession:
    model_name = "scripted.gguf"
    system = None
    exactness = "strict ≤32 rows"

    def __init__(self):
        self.method = "lookahead"
        self.messages = []
        self.total = Stats()

    def methods(self):
        return ["none", "lookahead", "ngram", "auto"]

    def piece(self, token):
        return WORDS[token]

    def stop(self):
        pass

    def clear(self):
        self.messages.clear()

    def send(self, text, on_event=None):
        self.messages.append({"role": "user", "content": text})
        st, i, text_out, flags = Stats(n_prompt=12, t_prompt=0.05), 0, [], []
        for step, (acc, n) in enumerate(STEPS):
            toks = tuple(range(i, min(i + n, len(WORDS))))
            i += n
            ev = StepEvent(step, 4 if step else 0, acc, 2 if step else 0, toks, tuple(k < acc for k in range(len(toks))),
                           0.001, 0.01, "lookahead", tuple(range(1, acc + 1)), (2, 1, 1) if step else ())
            st.add(ev)
            piece = "".join(WORDS[t] for t in toks)
            text_out.append(piece)
            flags.extend(ev.from_draft)
            if on_event:
                on_event(ev, piece)
        st.t_gen, st.finish_reason = 0.1, "stop"
        reply = Reply("".join(text_out), list(range(i)), flags, st, self.method)
        self.messages.append({"role": "assistant", "content": reply.text})
        self.total = st
        return reply

    def regenerate(self, on_event=None):
        self.messages.pop()
        return self.send(self.messages.pop()["content"], on_event)


async def _converse(pilot):
    app = pilot.app
    box = app.query_one(PromptInput)
    box.text = "What is speculative decoding?"
    await pilot.press("enter")
    for _ in range(100):
        await pilot.pause(0.05)
        if not app.busy:
            break
    await pilot.pause(0.2)


@pytest.mark.parametrize("size", [(80, 24), (200, 50)])
def test_layout_after_a_reply(snap_compare, size):
    assert snap_compare(ChatApp(ScriptedSession(), cursor_blink=False), terminal_size=size, run_before=_converse)


def test_layout_with_marked_drafts(snap_compare):
    async def run_before(pilot):
        await _converse(pilot)
        await pilot.press("ctrl+t")
        await pilot.pause(0.1)

    assert snap_compare(ChatApp(ScriptedSession(), cursor_blink=False), terminal_size=(100, 30), run_before=run_before)
