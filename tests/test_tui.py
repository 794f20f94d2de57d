"""`edgespec chat`: the Textual UI driven by Pilot on the real embedded model, and the pipe mode."""

import asyncio
import os
import subprocess
import sys

import pytest

from edgespec.sampling import SamplingConfig
from edgespec.frontends.session import ChatSession

textual = pytest.importorskip("textual")
from edgespec.tui.app import ChatApp, PromptInput, Turn  # noqa: E402


def test_core_never_imports_textual():
    code = ("import sys, edgespec, edgespec.frontends.cli, edgespec.engine, edgespec.frontends.session, "
            "edgespec.frontends.bench, edgespec.frontends.batch, edgespec.schedulers.pearl, edgespec.schedulers.multi;"
            "print('textual' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


async def _wait_idle(app, pilot, timeout=120.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while app.busy and loop.time() < end:
        await pilot.pause(0.1)
    assert not app.busy, "reply did not finish"


async def _send(app, pilot, text):
    box = app.query_one(PromptInput)
    box.text = text
    box.focus()
    await pilot.press("enter")
    await pilot.pause(0.05)


def _session(smol, n=48, method="lookahead"):
    return ChatSession(smol, method, SamplingConfig(), n)


def test_conversation_reply_and_stats(smol, tmp_path):
    async def run():
        app = ChatApp(_session(smol), export_dir=tmp_path)
        async with app.run_test(size=(100, 32)) as pilot:
            await _send(app, pilot, "Repeat exactly: red green blue, red green blue.")
            shown = list(app.query(Turn))
            assert shown[0].role == "user" and "red green blue" in shown[0].text  # at once, before the reply
            await _wait_idle(app, pilot)
            turns = list(app.query(Turn))
            assert [t.role for t in turns] == ["user", "assistant"]
            assert turns[1].text.strip()
            assert app.reply_stats.n_generated > 0 and app.session.total.n_generated > 0
            await pilot.press("ctrl+t")  # mark tokens from accepted drafts
            assert app.marked
            await pilot.press("ctrl+e")
            assert app.last_export is not None and "red green blue" in app.last_export.read_text().lower()
            # a second turn uses the conversation so far
            await _send(app, pilot, "Thanks.")
            await _wait_idle(app, pilot)
            assert len(app.session.messages) == 4

    asyncio.run(run())


def test_stop_mid_reply_keeps_partial_text(smol):
    async def run():
        app = ChatApp(_session(smol, n=1500, method="none"))
        async with app.run_test(size=(80, 24)) as pilot:
            await _send(app, pilot, "Count from 1 to 500, one number per line.")
            for _ in range(300):
                await pilot.pause(0.05)
                if app.current is not None and len(app.current.text) > 20:
                    break
            await pilot.press("escape")
            await _wait_idle(app, pilot)
            reply = app.session.messages[-1]
            assert reply["role"] == "assistant" and len(reply["content"]) > 20
            assert app.reply_stats.finish_reason == "interrupted"
            assert app.reply_stats.n_generated < 1500
            assert list(app.query(Turn))[-1].text == reply["content"]

    asyncio.run(run())


def test_switch_drafter_and_clear(smol):
    async def run():
        app = ChatApp(_session(smol, n=16, method="none"))
        async with app.run_test(size=(200, 50)) as pilot:
            seen = {app.session.method}
            for _ in range(3):
                await pilot.press("ctrl+d")
                seen.add(app.session.method)
            assert {"none", "lookahead", "ngram"} <= seen
            await _send(app, pilot, "Hi.")
            await _wait_idle(app, pilot)
            await pilot.press("ctrl+r")  # regenerate the last reply
            await _wait_idle(app, pilot)
            assert [m["role"] for m in app.session.messages] == ["user", "assistant"]
            await pilot.press("ctrl+l")
            assert app.session.messages == [] and not list(app.query(Turn))
            app.query_one(PromptInput).text = "You answer in French."
            app.action_set_system()
            assert app.session.system == "You answer in French."
            app.set_method("ngram")
            assert app.session.method == "ngram" and "ngram" in app.sub_title

    asyncio.run(run())


def test_pipe_mode_reads_lines():
    r = subprocess.run([sys.executable, "-m", "edgespec", "chat", "-m", "smollm2-135m-instruct:q4_0", "-n", "8"],
                       input="Say hi.\n\nName a fruit.\n", capture_output=True, text=True, timeout=300,
                       env={**os.environ})
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\n") >= 2
    assert r.stderr.count("tok/s") == 2
