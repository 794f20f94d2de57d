"""`edgespec chat`: a Textual chat UI with live speculative-decoding statistics.

The app takes a ChatSession (core, no Textual) and runs each reply in a worker thread. The
worker only posts messages; step events are merged so the screen refreshes a few times a second
however fast tokens come.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from pathlib import Path

from rich.text import Text
from textual import on, work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Footer, Header, Markdown, Sparkline, Static, TextArea

from edgespec.errors import EdgespecError
from edgespec.events import Stats, StepEvent
from edgespec.frontends.session import ChatSession

REFRESH_S = 0.1


class PromptInput(TextArea):
    """Enter sends; Ctrl+J (or Shift+Enter where the terminal tells them apart) adds a line."""

    class Submitted(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    async def _on_key(self, event) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text.strip()
            if text:
                self.post_message(self.Submitted(text))
                self.app.history.append(text)
                self.app.history_pos = len(self.app.history)
                self.clear()
            return
        if event.key in ("shift+enter", "ctrl+j"):
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        if event.key in ("up", "down") and "\n" not in self.text and self.app.history:
            event.stop()
            event.prevent_default()
            h = self.app.history
            self.app.history_pos = max(0, min(len(h), self.app.history_pos + (-1 if event.key == "up" else 1)))
            self.text = h[self.app.history_pos] if self.app.history_pos < len(h) else ""
            return
        await super()._on_key(event)


class Turn(Vertical):
    """One message of the conversation."""

    DEFAULT_CSS = """
    Turn { height: auto; margin: 0 0 1 0; }
    Turn .who { color: $text-muted; }
    Turn.user .who { color: $accent; }
    Turn Markdown { margin: 0; padding: 0; }
    Turn .marked { height: auto; }
    """

    def __init__(self, role: str, text: str = "") -> None:
        super().__init__(classes=role)
        self.role, self.text = role, text
        self.tokens: list[tuple[str, bool]] = []  # (piece, came from an accepted draft)

    def compose(self) -> ComposeResult:
        yield Static("you" if self.role == "user" else "model", classes="who")
        yield Markdown(self.text)
        yield Static("", classes="marked")

    def show(self, marked: bool) -> None:
        md, plain = self.query_one(Markdown), self.query_one(".marked", Static)
        md.display, plain.display = not marked, marked
        if marked:
            t = Text()
            for piece, drafted in self.tokens:
                t.append(piece, style="bold green" if drafted else "")
            plain.update(t)
        else:
            md.update(self.text)


class StatsPanel(Static):
    DEFAULT_CSS = "StatsPanel { width: 38; height: auto; padding: 0 1; border: round $primary; }"

    def render_stats(self, method: str, st: Stats, total: Stats, rate_now: float) -> None:
        t = Text()
        t.append(f"drafter  {method}\n", style="bold")
        t.append(f"tok/s    now {rate_now:6.1f}   reply {st.tokens_per_s:6.1f}\n")
        acc = f"{100 * st.acceptance_rate:5.1f}%" if st.n_drafted else "    -"
        t.append(f"accept   {acc}   mean len {st.mean_accepted_length:4.2f}\n")
        t.append(f"tokens   {st.n_generated}  steps {st.n_steps}  drafted {st.n_drafted}\n")
        busy = st.t_draft + st.t_verify
        if busy > 0:
            share = st.t_draft / busy
            bar = int(round(20 * share))
            t.append("time     ")
            t.append("█" * bar, style="yellow")
            t.append("█" * (20 - bar), style="blue")
            t.append(f"\n         draft {100 * share:.0f}% / verify {100 * (1 - share):.0f}%\n")
        hist = st.accepted_len_hist
        if sum(hist):
            t.append("tokens per step\n", style="bold")
            top = max(hist)
            for n, c in enumerate(hist):
                if n == 0:  # a last step cut at end-of-generation commits nothing
                    continue
                t.append(f" {n:2d} {'▇' * max(1, round(16 * c / top)) if c else '':16s} {c}\n")
        pos = st.acceptance_by_position
        if pos:
            t.append("accept by position\n", style="bold")
            t.append(" " + " ".join(f"{100 * p:3.0f}" for p in pos[:8]) + "\n")
        t.append(f"\nconversation: {total.n_generated} tokens, ", style="dim")
        t.append(f"{100 * total.acceptance_rate:.0f}% accepted" if total.n_drafted else "no drafts", style="dim")
        self.update(t)


class ChatApp(App):
    TITLE = "edgespec chat"
    CSS = """
    #main { height: 1fr; }
    #log { width: 1fr; padding: 0 1; }
    #side { width: 40; height: 100%; }
    #spark { height: 3; margin: 0 1; }
    #status { height: 1; padding: 0 1; color: $text-muted; }
    PromptInput { height: 5; }
    """
    # priority: the prompt box would otherwise take these keys for cursor moves
    BINDINGS = [
        Binding("escape", "stop", "Stop", priority=True),
        Binding("ctrl+c", "stop_or_quit", "Stop/Quit", priority=True),
        Binding("ctrl+d", "next_drafter", "Drafter", priority=True),
        Binding("ctrl+r", "regenerate", "Regenerate", priority=True),
        Binding("ctrl+l", "clear", "Clear", priority=True),
        Binding("ctrl+t", "toggle_marks", "Mark drafts", priority=True),
        Binding("ctrl+e", "export", "Export", priority=True),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    class Progress(Message):
        def __init__(self, events: list[StepEvent], text: str) -> None:
            super().__init__()
            self.events, self.text = events, text

    class Done(Message):
        def __init__(self, reply=None, error: str | None = None) -> None:
            super().__init__()
            self.reply, self.error = reply, error

    def __init__(self, session: ChatSession, export_dir: str | Path = ".", cursor_blink: bool = True) -> None:
        super().__init__()
        self.cursor_blink = cursor_blink
        self.session = session
        self.export_dir = Path(export_dir)
        self.history: list[str] = []
        self.history_pos = 0
        self.busy = False
        self.marked = False
        self.current: Turn | None = None
        self.reply_stats = Stats()
        self.spark_data: list[float] = []
        self._pending: list[StepEvent] = []
        self._pending_text: list[str] = []
        self._last_flush = 0.0
        self.last_export: Path | None = None

    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            yield VerticalScroll(id="log")
            with Vertical(id="side"):
                yield StatsPanel(id="stats")
                yield Static("acceptance, last steps", id="spark-label")
                yield Sparkline(self.spark_data, id="spark")
        yield Static("", id="status")
        yield PromptInput(id="input", soft_wrap=True, show_line_numbers=False)

        yield Footer()

    def on_mount(self) -> None:
        self.query_one(PromptInput).cursor_blink = self.cursor_blink
        self.sub_title = f"{self.session.model_name} · {self.session.method}"
        self.query_one(PromptInput).focus()
        self._refresh_stats(0.0)
        self.set_status("Enter sends · Ctrl+J new line · Esc stops · Ctrl+D switches the drafter")

    def set_status(self, text: str) -> None:
        self.query_one("#status", Static).update(text)

    # -- sending --------------------------------------------------------------------------

    @on(PromptInput.Submitted)
    def send(self, message: PromptInput.Submitted) -> None:
        if self.busy:
            self.set_status("still answering: Esc stops it")
            return
        log = self.query_one("#log", VerticalScroll)
        log.mount(Turn("user", message.text))
        self._start(lambda on_ev: self.session.send(message.text, on_ev))

    def _start(self, call) -> None:
        self.busy = True
        self.reply_stats = Stats()
        self.spark_data = []
        self.current = Turn("assistant")
        self.query_one("#log", VerticalScroll).mount(self.current)
        self.set_status(f"answering with {self.session.method} …")
        self._generate(call)

    @work(thread=True, exclusive=True)
    def _generate(self, call) -> None:
        def on_event(ev: StepEvent, piece: str) -> None:
            self._pending.append(ev)
            self._pending_text.append(piece)
            now = time.perf_counter()
            if now - self._last_flush >= REFRESH_S:
                self._last_flush = now
                self._flush()

        try:
            reply = call(on_event)
            self._flush()
            self.post_message(self.Done(reply))
        except EdgespecError as e:
            self._flush()
            self.post_message(self.Done(error=str(e)))
        except Exception as e:  # the UI outlives a failed reply; the text so far stays on screen
            self._flush()
            self.post_message(self.Done(error=f"internal error: {type(e).__name__}: {e}"))

    def _flush(self) -> None:
        evs, self._pending = self._pending, []
        txt, self._pending_text = self._pending_text, []
        if evs:
            self.post_message(self.Progress(evs, "".join(txt)))

    def on_chat_app_progress(self, message: Progress) -> None:
        turn = self.current
        if turn is None:
            return
        for ev in message.events:
            self.reply_stats.add(ev)
            if ev.n_drafted:
                self.spark_data.append(ev.n_accept / ev.n_drafted)
        pieces = [self.session.piece(t) for ev in message.events for t in ev.tokens]
        flags = [f for ev in message.events for f in ev.from_draft]
        turn.tokens.extend(zip(pieces, flags))
        turn.text += message.text
        turn.show(self.marked)
        self.query_one("#log", VerticalScroll).scroll_end(animate=False)
        dt = sum(ev.t_draft + ev.t_verify for ev in message.events)
        n = sum(len(ev.tokens) for ev in message.events)
        self._refresh_stats(n / dt if dt > 0 else 0.0)

    def on_chat_app_done(self, message: Done) -> None:
        self.busy = False
        if message.error:
            if self.current is not None and not self.current.text:
                self.current.remove()
            self.set_status(f"error: {message.error} · Ctrl+L clears the conversation")
        else:
            r = message.reply
            if self.current is not None:
                self.current.text = r.text
                self.current.show(self.marked)
            self.reply_stats = r.stats
            state = "stopped" if r.stopped else "done"
            self.set_status(f"{state}: {r.stats.summary()}")
        self.current = None
        self._refresh_stats(0.0)

    def _refresh_stats(self, rate_now: float) -> None:
        self.query_one(StatsPanel).render_stats(self.session.method, self.reply_stats, self.session.total, rate_now)
        spark = self.query_one(Sparkline)
        spark.data = self.spark_data[-60:]
        spark.display = bool(self.spark_data)
        self.query_one("#spark-label", Static).display = bool(self.spark_data)

    # -- actions --------------------------------------------------------------------------

    def action_stop(self) -> None:
        if self.busy:
            self.session.stop()

    def action_stop_or_quit(self) -> None:
        if self.busy:
            self.session.stop()
        else:
            self.exit()

    def action_next_drafter(self) -> None:
        ms = self.session.methods()
        cur = self.session.method
        self.set_method(ms[(ms.index(cur) + 1) % len(ms)] if cur in ms else ms[0])

    def get_system_commands(self, screen):
        yield from super().get_system_commands(screen)
        for m in self.session.methods():
            yield SystemCommand(f"Drafter: {m}", f"Speculate with {m} from the next reply on",
                                lambda m=m: self.set_method(m))
        yield SystemCommand("Set system prompt", "Use the text in the prompt box as the system message",
                            self.action_set_system)
        yield SystemCommand("Export conversation", "Write the conversation to a Markdown file", self.action_export)
        yield SystemCommand("Clear conversation", "Start over with an empty context", self.action_clear)

    def action_set_system(self) -> None:
        box = self.query_one(PromptInput)
        self.session.system = box.text.strip() or None
        box.clear()
        self.set_status(f"system prompt: {self.session.system}" if self.session.system else "system prompt cleared")

    def set_method(self, method: str) -> None:
        if self.busy:
            self.set_status("switch the drafter between replies")
            return
        self.session.method = method
        self.sub_title = f"{self.session.model_name} · {method}"
        self.reply_stats = Stats()
        self._refresh_stats(0.0)
        self.set_status(f"drafter: {method}")

    def action_regenerate(self) -> None:
        if self.busy or not self.session.messages:
            return
        turns = list(self.query(Turn))
        if turns and turns[-1].role == "assistant":
            turns[-1].remove()
        self._start(lambda on_ev: self.session.regenerate(on_ev))

    def action_clear(self) -> None:
        if self.busy:
            return
        self.session.clear()
        self.query_one("#log", VerticalScroll).remove_children()
        self.set_status("conversation cleared")

    def action_toggle_marks(self) -> None:
        self.marked = not self.marked
        for turn in self.query(Turn):
            if turn.role == "assistant":
                turn.show(self.marked)
        self.set_status("green: tokens from accepted drafts" if self.marked else "Markdown view")

    def action_export(self) -> None:
        path = self.export_dir / f"edgespec-chat-{datetime.now():%Y%m%d-%H%M%S}.md"
        lines = [f"# edgespec chat ({self.session.model_name})", ""]
        if self.session.system:
            lines += [f"**system:** {self.session.system}", ""]
        for m in self.session.messages:
            lines += [f"## {m['role']}", "", m["content"], ""]
        try:
            self.export_dir.mkdir(parents=True, exist_ok=True)
            path.write_text("\n".join(lines), encoding="utf-8")
        except OSError as e:
            self.set_status(f"cannot export to {path}: {e.strerror or e}")
            return
        self.last_export = path
        self.set_status(f"exported to {path}")


class _NotifyHandler(logging.Handler):
    """The core's notes (logging) as notifications on the screen, not over it."""

    def __init__(self, app: ChatApp):
        super().__init__(logging.INFO)
        self.app = app

    def emit(self, record: logging.LogRecord) -> None:
        severity = "warning" if record.levelno >= logging.WARNING else "information"
        try:
            self.app.call_from_thread(self.app.notify, record.getMessage(), severity=severity)
        except RuntimeError:  # called from the app's own thread
            self.app.notify(record.getMessage(), severity=severity)


def run_app(session: ChatSession) -> int:
    app = ChatApp(session)
    lg = logging.getLogger("edgespec")
    saved = lg.handlers[:]
    lg.handlers = [_NotifyHandler(app)]
    try:
        app.run()
    finally:
        lg.handlers = saved
    return 0
