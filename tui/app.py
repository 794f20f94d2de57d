"""`edgespec chat`: a Textual chat UI with live speculative-decoding statistics.

The app takes a ChatSession (core, no Textual) and runs each reply in one generation thread.
That thread only posts messages; step events are merged so the screen updates a few times a
second however fast tokens come. Rendering is incremental, so its cost per update does not grow
with the reply: the Markdown view is a column of segments rendered by rich, of which only the
last is rendered again; the marked-drafts view appends to its last chunk. The interval between
updates follows their measured CPU cost, so the UI thread takes about UI_SHARE of one core (its
CPU time per second of the reply is shown as "ui" in the stats panel), leaving the cores to
llama.cpp.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from functools import partial
from pathlib import Path

from rich.markdown import Markdown as RichMarkdown
from rich.text import Text
from textual import on
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import Footer, Header, Markdown, Sparkline, Static, TextArea

from edgespec.errors import EdgespecError
from edgespec.events import Stats, StepEvent
from edgespec.frontends.session import ChatSession

REFRESH_S = 0.1  # shortest interval between screen updates while a reply streams
REFRESH_MAX_S = 1.0
# Of one core, what the UI thread may take while a reply streams: the interval between updates
# is the measured CPU cost of one update divided by this. On a machine whose cores llama.cpp
# keeps busy, every percent the UI takes is a percent of decoding lost (or more: a preempted
# compute thread stalls the others at the next barrier).
UI_SHARE = 0.05
CHUNK_CHARS = 800  # both views start a new segment past this many characters (at a line or block end)
PANEL_WIDTH = 34  # characters inside the stats panel's border and padding


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


def split_segment(text: str, size: int) -> tuple[str, str] | None:
    """Where a streaming Markdown reply can be cut into a finished segment and the rest: after
    a blank line followed by unindented text (a block boundary), once the segment has `size`
    characters; inside a code fence past 2x that, the fence closed and reopened; anywhere at a
    line end past 4x. Never after the last line, which may still grow. None: not yet."""
    if len(text) < size:
        return None
    lines = text.splitlines(keepends=True)
    fence = None  # the opening line of the fence we are in
    off = 0
    for i, line in enumerate(lines[:-1]):
        bare = line.lstrip(" ")
        if bare.startswith(("```", "~~~")) and len(line) - len(bare) <= 3:
            fence = None if fence else bare.rstrip("\n")
        off += len(line)
        if off < size or not line.endswith("\n"):
            continue
        starts_block = lines[i + 1][:1] not in (" ", "\t", "\n")
        if fence is None:
            if starts_block and (line.strip() == "" or off >= 4 * size):
                return text[:off], text[off:]
        elif off >= 2 * size:
            marker = fence[: len(fence) - len(fence.lstrip(fence[0]))]
            return text[:off] + marker + "\n", fence + "\n" + text[off:]
    return None


class Turn(Vertical):
    """One message of the conversation. A reply is shown in segments of Markdown rendered by
    rich, each a widget: finished segments are rendered once, only the last one again as text
    comes (Textual's Markdown widget streams too, but it makes every block a widget, and
    Textual lays all of them out again on every refresh: 0.3 s per refresh at 1,600 tokens)."""

    DEFAULT_CSS = """
    Turn { height: auto; margin: 0 0 1 0; }
    Turn .who { color: $text-muted; }
    Turn.user .who { color: $accent; }
    Turn Markdown { margin: 0; padding: 0; }
    Turn .md, Turn .marked { height: auto; }
    Turn .md Static, Turn .marked Static { height: auto; }
    """

    def __init__(self, role: str, text: str = "") -> None:
        super().__init__(classes=role)
        self.role, self.text = role, text
        self.tokens: list[tuple[str, bool]] = []  # (piece, came from an accepted draft)
        self.marked: bool | None = None  # the view on screen (None: not shown yet)
        self.segments: list[str] = []  # the Markdown view's finished segments
        self._live = ""  # its last segment, still growing
        self._shown = ""  # text already cut into segments
        self._n_mounted = 0  # finished segments that have their widget
        self._chunk: Text | None = None  # the marked view's last chunk
        self._n_marked = 0  # tokens already in the marked view

    def compose(self) -> ComposeResult:
        yield Static("you" if self.role == "user" else "model", classes="who")
        if self.role == "user":
            yield Markdown(self.text)
        else:
            yield Vertical(classes="md")
            yield Vertical(classes="marked")

    @property
    def markdown_source(self) -> str:
        """What the Markdown view shows, as Markdown (the segments put together)."""
        return "".join(self.segments) + self._live

    async def show(self, marked: bool) -> None:
        """Bring the view up to date, rendering only what is new; a hidden view catches up when
        it is shown again (a few segments or chunks, however long the reply)."""
        md, box = self.query_one(".md", Vertical), self.query_one(".marked", Vertical)
        if marked != self.marked:
            md.display, box.display = not marked, marked
            self.marked = marked
        if self.text != self._shown:
            if not self.text.startswith(self._shown):  # cannot happen today: redraw from scratch
                await md.remove_children()
                self.segments, self._live, self._shown, self._n_mounted = [], "", "", 0
            self._live += self.text[len(self._shown):]
            self._shown = self.text
            while (cut := split_segment(self._live, CHUNK_CHARS)) is not None:
                done, self._live = cut
                self.segments.append(done)
        if marked:
            await self._append_marked(box)
        else:
            await self._render_markdown(md)

    async def _render_markdown(self, md: Vertical) -> None:
        """Segments finished since the last render get their widget (the live one becomes the
        first of them), and the live segment is rendered again."""
        if not md.children:
            await md.mount(Static(""))
        while self._n_mounted < len(self.segments):
            md.children[-1].update(RichMarkdown(self.segments[self._n_mounted]))
            self._n_mounted += 1
            await md.mount(Static(""))
        md.children[-1].update(RichMarkdown(self._live))

    async def _append_marked(self, box: Vertical) -> None:
        new = self.tokens[self._n_marked:]
        if not new:
            return
        self._n_marked = len(self.tokens)
        for piece, drafted in new:
            if self._chunk is None:
                self._chunk = Text()
                await box.mount(Static(self._chunk))
            self._chunk.append(piece, style="bold green" if drafted else "")
            if len(self._chunk) >= CHUNK_CHARS and piece.endswith("\n") or len(self._chunk) >= 2 * CHUNK_CHARS:
                if piece.endswith("\n"):  # the next chunk starts on its own line anyway
                    self._chunk.right_crop(1)
                box.children[-1].update(self._chunk)
                self._chunk = None
        if self._chunk is not None:
            box.children[-1].update(self._chunk)


class StatsPanel(Static):
    DEFAULT_CSS = "StatsPanel { width: 38; height: auto; padding: 0 1; border: round $primary; }"

    def render_stats(self, method: str, st: Stats, total: Stats, rate_now: float, exactness: str = "",
                     ui_share: float | None = None, compact: bool = False, draft: str = "") -> None:
        """Every line fits PANEL_WIDTH characters whatever the numbers; `compact` (a short
        terminal) puts the histogram of tokens per step on one line. `draft`: the draft model
        loaded ("[vocab] name": paired by vocabulary)."""
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append(f"drafter  {method}\n", style="bold")
        if draft:
            t.append(f"draft    {draft}\n")
        if exactness:  # the policy in force: strict (greedy identical) or batched (near-ties may differ)
            t.append(f"exact    {exactness}\n")
        t.append(f"tok/s    now {_num(rate_now)}  reply {_num(st.tokens_per_s)}\n")
        acc = f"{100 * st.acceptance_rate:.0f}%" if st.n_drafted else "-"
        t.append(f"accept   {acc:>4}  mean len {st.mean_accepted_length:.2f}\n")
        t.append(f"tokens   {st.n_generated}  steps {st.n_steps}\n")
        t.append(f"drafted  {st.n_drafted}  accepted {st.n_accept}\n")
        if st.by_source:  # which source drafted, and the plain steps its accepted tokens saved
            srcs = sorted(st.by_source.items(), key=lambda kv: -kv[1][2])
            if compact:
                line = "saved    " + "  ".join(f"{name} {acc}" for name, (_, _, acc) in srcs)
                t.append(line[:PANEL_WIDTH] + "\n")
            else:
                t.append("source     saved steps  drafted\n", style="bold")
                for name, (_, drafted, acc) in srcs[:4]:
                    t.append(f" {name[:12]:<12} {acc:>9}  {drafted:>7}\n")
        if st.n_prompt_cached:  # a conversation's turn read only what it added (KV reuse)
            t.append(f"prompt   {st.n_prompt_eval} read  {st.n_prompt_cached} cached\n")
        busy = st.t_draft + st.t_verify
        if busy > 0:
            share = st.t_draft / busy
            bar = int(round(20 * share))
            t.append("time     ")
            t.append("█" * bar, style="yellow")
            t.append("█" * (20 - bar), style="blue")
            ui = "" if ui_share is None else f" ui {100 * ui_share:.0f}%"
            t.append(f"\n draft {100 * share:.0f}% verify {100 * (1 - share):.0f}%{ui}\n")
        hist = st.accepted_len_hist
        if sum(hist):
            top = max(hist)
            if compact:
                last = max(n for n, c in enumerate(hist) if c)
                blocks = "".join(" ▁▂▃▄▅▆▇█"[min(8, -(-8 * hist[n] // top))] for n in range(1, last + 1))
                t.append(f"per step 1 {blocks[:PANEL_WIDTH - 15]} {last}\n")
            else:
                t.append("tokens per step\n", style="bold")
                width = len(str(top))
                for n, c in enumerate(hist):
                    if n == 0:  # none: every step yields a token, the end of generation included
                        continue
                    t.append(f" {n:2d} {'▇' * max(1, round(16 * c / top)) if c else '':16s} {c:>{width}}\n")
        pos = st.acceptance_by_position
        if pos:
            t.append("accept by position\n" if not compact else "by pos ", style="bold")
            t.append((" " if not compact else "") + " ".join(f"{100 * p:3.0f}" for p in pos[:8 if not compact else 6])
                     + "\n")
        t.append(f"total    {total.n_generated} tokens", style="dim")
        if total.n_drafted:
            t.append(f", {100 * total.acceptance_rate:.0f}% acc.", style="dim")
        self.update(t)


def _num(x: float) -> str:
    """A rate in six characters at most."""
    return f"{x:6.1f}" if x < 1000 else f"{x:6.0f}"


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
        self._exactness: str | None = None  # the session's exactness policy, read once
        self.refresh_s = REFRESH_S  # interval between screen updates, adapted to the UI's load
        self._t0 = (0.0, 0.0)  # (wall, UI thread CPU) when the reply started
        self._window = (0.0, 0.0)  # the same at the last update
        self.ui_share: float | None = None  # UI thread CPU seconds per second of this reply
        self._cost: float | None = None  # UI thread CPU seconds per screen update (average)

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

    def on_unmount(self) -> None:
        if self.busy:  # quitting mid-reply: end it, so the generation thread is free at once
            self.session.stop()

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
        self._t0 = self._window = (time.perf_counter(), time.thread_time())
        self.ui_share = None
        self._generate(call)

    def _generate(self, call) -> None:
        _generation_thread().submit(self._generate_body, call)

    def _generate_body(self, call) -> None:
        """In the generation thread: the reply, posted to the UI as merged Progress messages."""
        def on_event(ev: StepEvent, piece: str) -> None:
            self._pending.append(ev)
            self._pending_text.append(piece)
            now = time.perf_counter()
            if now - self._last_flush >= self.refresh_s:
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

    def _measure_ui(self) -> None:
        """The UI thread's CPU time per second of this reply (`ui_share`), and the interval
        between updates: the CPU one update costs (everything the UI thread did since the last
        one: handling it, layout, rendering), averaged, divided by UI_SHARE."""
        wall, cpu = time.perf_counter(), time.thread_time()
        if wall - self._t0[0] >= 1.0:  # a share over less than a second says little
            self.ui_share = (cpu - self._t0[1]) / (wall - self._t0[0])
        per_update = cpu - self._window[1]
        self._window = (wall, cpu)
        self._cost = per_update if self._cost is None else 0.7 * self._cost + 0.3 * per_update
        self.refresh_s = min(REFRESH_MAX_S, max(REFRESH_S, self._cost / UI_SHARE))

    async def on_chat_app_progress(self, message: Progress) -> None:
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
        await turn.show(self.marked)
        self.query_one("#log", VerticalScroll).scroll_end(animate=False)
        dt = sum(ev.t_draft + ev.t_verify for ev in message.events)
        n = sum(len(ev.tokens) for ev in message.events)
        self._measure_ui()
        self._refresh_stats(n / dt if dt > 0 else 0.0)

    async def on_chat_app_done(self, message: Done) -> None:
        if message.error:
            if self.current is not None and not self.current.text:
                self.current.remove()
            self.set_status(f"error: {message.error} · Ctrl+L clears the conversation")
        else:
            r = message.reply
            if self.current is not None:
                self.current.text = r.text
                await self.current.show(self.marked)
            self.reply_stats = r.stats
            state = "stopped" if r.stopped else "done"
            self.set_status(f"{state}: {r.stats.summary()}")
        self._measure_ui()
        self.current = None
        self._refresh_stats(0.0)
        self.busy = False  # last: the reply is on screen and in the stats

    def _refresh_stats(self, rate_now: float) -> None:
        if self._exactness is None:
            self._exactness = getattr(self.session, "exactness", "")
        self.query_one(StatsPanel).render_stats(self.session.method, self.reply_stats, self.session.total, rate_now,
                                                self._exactness, self.ui_share, compact=self.size.height < 40,
                                                draft=getattr(self.session, "draft_note", ""))
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

    async def action_toggle_marks(self) -> None:
        self.marked = not self.marked
        for turn in self.query(Turn):
            if turn.role == "assistant":
                await turn.show(self.marked)
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


_GEN = None


def _generation_thread():
    """The one thread that runs replies, for the life of the process: llama.cpp's OpenMP
    compute threads belong to the thread that starts a decode, so a thread per reply would
    start (and spin up) a new team of them for every reply."""
    global _GEN
    if _GEN is None:
        from concurrent.futures import ThreadPoolExecutor

        _GEN = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgespec-generate")
    return _GEN


class _NotifyHandler(logging.Handler):
    """The core's notes (logging) as notifications on the screen, not over it."""

    def __init__(self, app: ChatApp):
        super().__init__(logging.INFO)
        self.app = app

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        total = getattr(record, "total", None)
        if total is not None:  # measured progress (a cost curve measured again between turns): the status line
            left = float(total) - float(record.done)
            show = partial(self.app.set_status, text + (f" · about {left:.0f} s left" if left > 0 else ""))
        else:
            show = partial(self.app.notify, text, severity="warning" if record.levelno >= logging.WARNING else "information")
        try:
            self.app.call_from_thread(show)
        except RuntimeError:  # called from the app's own thread
            show()


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
