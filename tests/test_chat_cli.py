"""`minivllm chat` driven through a pseudo-terminal, as a user types into it: greedy answers equal
LLM.chat's for the same conversation, /reset forgets it, Ctrl-C stops an answer and the chat goes on,
/exit, Ctrl-D and Ctrl-C at the prompt leave with code 0.

Every read has a deadline; the child is always killed at the end."""
import fcntl
import os
import select
import signal
import subprocess
import sys
import termios
import time

import pytest

from minivllm import LLM, SamplingParams
from minivllm.entrypoints.chat import make_arg_parser

ENGINE_ARGS = ["--device", "cpu", "--max-model-len", "1024", "--max-num-seqs", "1"]
MAX_TOKENS = 32
PROMPT_MARK = b"\r\n> "  # the chat ends each answer with a newline, then prompts ("\n" is "\r\n" on a terminal)
STARTUP_TIMEOUT = 180.0
ANSWER_TIMEOUT = 60.0


class PtyChat:
    """A `minivllm chat` child whose terminal is a pseudo-terminal: this side types and reads what it
    shows. Echo is off, so that what is read is what the chat wrote."""

    def __init__(self, model_dir: str, args: list[str]):
        self.master, slave = os.openpty()
        attrs = termios.tcgetattr(slave)
        attrs[3] &= ~termios.ECHO  # lflag; ICANON and ISIG stay: lines, and Ctrl-C -> SIGINT
        termios.tcsetattr(slave, termios.TCSANOW, attrs)
        env = {**os.environ, "PYTHONPATH": _package_parent(), "OMP_NUM_THREADS": "1"}
        # (cwd: `python -m` puts the current directory first on sys.path, ahead of PYTHONPATH)
        self.proc = subprocess.Popen([sys.executable, "-m", "minivllm.entrypoints.cli", "chat", model_dir, *args],
                                     stdin=slave, stdout=slave, stderr=slave, env=env, cwd=_package_parent(),
                                     start_new_session=True, preexec_fn=_take_controlling_terminal)
        os.close(slave)
        self.buffer = b""

    def read_until(self, mark: bytes, timeout: float) -> str:
        """What the chat shows up to `mark` (consumed), with the terminal's "\\r\\n" as "\\n"."""
        deadline = time.monotonic() + timeout
        while mark not in self.buffer:
            self._read(deadline, f"{mark!r}")
        head, _, self.buffer = self.buffer.partition(mark)
        return head.replace(b"\r\n", b"\n").decode()

    def read_some(self, timeout: float) -> bytes:
        """Wait for more output (at least one byte)."""
        deadline = time.monotonic() + timeout
        num_bytes = len(self.buffer)
        while len(self.buffer) == num_bytes:
            self._read(deadline, "more output")
        return self.buffer

    def _read(self, deadline: float, what: str):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"the chat did not show {what}; it showed:\n{self.buffer.decode(errors='replace')}")
        ready, _, _ = select.select([self.master], [], [], remaining)
        if ready:
            try:
                data = os.read(self.master, 4096)
            except OSError:  # EIO: the child closed its terminal
                data = b""
            if not data:
                raise EOFError(f"the chat exited ({self.proc.poll()}); it showed:\n{self.buffer.decode(errors='replace')}")
            self.buffer += data

    def type(self, keys: bytes):
        os.write(self.master, keys)

    def ask(self, message: str) -> str:
        self.type(message.encode() + b"\n")
        return self.read_until(PROMPT_MARK, ANSWER_TIMEOUT).removesuffix("\n")

    def close(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        os.close(self.master)


def _package_parent() -> str:
    """The directory of this process's minivllm package: a child run there with it as PYTHONPATH
    imports the same minivllm."""
    return os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["minivllm"].__file__)))


def _take_controlling_terminal():
    """(In the child, after setsid.) Make the pseudo-terminal its controlling terminal: Ctrl-C typed
    there then sends it SIGINT. SIGINT's default action is restored too: a test run started in the
    background of a shell (`cmd &`) hands its children SIGINT ignored, which a terminal's user never has."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


@pytest.fixture
def chat_of(request):
    chats = []

    def start(model_dir: str, args: list[str]) -> PtyChat:
        chats.append(PtyChat(model_dir, args))
        chats[-1].read_until(PROMPT_MARK, STARTUP_TIMEOUT)
        return chats[-1]

    yield start
    for chat in chats:
        chat.close()


def test_chat_answers_resets_and_stops_on_ctrl_c(smollm2_dir, chat_of):
    chat = chat_of(str(smollm2_dir), ENGINE_ARGS + ["--temperature", "0", "--max-tokens", str(MAX_TOKENS)])
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    with LLM(str(smollm2_dir), device="cpu", max_model_len=1024, max_num_seqs=1) as llm:
        def reference(*turns: str) -> str:
            messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]
            return llm.chat(messages, greedy, use_tqdm=False)[0].outputs[0].text

        first, second = "My name is Alice. Please remember it.", "What is my name?"
        answer = chat.ask(first)
        assert answer == reference(first)
        with_history = chat.ask(second)
        assert with_history == reference(first, answer, second)

        chat.type(b"/reset\n")
        assert chat.read_until(PROMPT_MARK, ANSWER_TIMEOUT) == "(the conversation is forgotten)"
        fresh = chat.ask(second)
        assert fresh == reference(second) and fresh != with_history  # the history is gone

        story = "Write a long story about a dragon."
        full = reference(story)
        chat.type(story.encode() + b"\n")
        chat.read_some(ANSWER_TIMEOUT)  # the answer has started
        chat.type(b"\x03")
        stopped = chat.read_until(PROMPT_MARK, ANSWER_TIMEOUT).removesuffix("\n")
        assert full.startswith(stopped) and len(stopped) < len(full), (stopped, full)
        assert chat.proc.poll() is None  # Ctrl-C stopped the answer, not the chat

    chat.type(b"/exit\n")
    assert chat.proc.wait(ANSWER_TIMEOUT) == 0


@pytest.mark.parametrize("keys", [b"\x04", b"\x03"], ids=["ctrl-d", "ctrl-c"])
def test_ctrl_d_or_ctrl_c_at_the_prompt_leaves(qwen3_tiny_dir, chat_of, keys):
    chat = chat_of(qwen3_tiny_dir, ENGINE_ARGS)
    chat.type(keys)
    assert chat.proc.wait(ANSWER_TIMEOUT) == 0


def test_a_message_too_long_for_the_context_is_refused_and_not_kept(qwen3_tiny_dir, chat_of):
    chat = chat_of(qwen3_tiny_dir, ["--device", "cpu", "--max-model-len", "64", "--max-num-seqs", "1",
                                    "--temperature", "0", "--max-tokens", "8"])
    assert chat.ask("hi " * 70) == ("error: with this message the conversation is 148 tokens, and the context holds "
                                    "64: send a shorter one, or /reset")
    with LLM(qwen3_tiny_dir, device="cpu", max_model_len=64, max_num_seqs=1) as llm:
        expected = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0.0, max_tokens=8),
                            use_tqdm=False)[0].outputs[0].text
    assert chat.ask("hi") == expected  # answered as the conversation's first message


def test_the_chat_path_imports_no_http_packages():
    code = ("import sys; import minivllm.entrypoints.cli, minivllm.entrypoints.chat, minivllm.llm; "
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'starlette') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=ANSWER_TIMEOUT,
                         env={**os.environ, "PYTHONPATH": _package_parent()}, cwd=_package_parent(), check=True)
    assert out.stdout.strip() == "[]"


def test_chat_flags(capsys):
    from minivllm.entrypoints.cli import main as cli_main

    with pytest.raises(SystemExit) as exit_info:
        cli_main(["chat", "--help"])
    assert exit_info.value.code == 0 and "--max-num-batched-tokens" in capsys.readouterr().out
    args = make_arg_parser().parse_args(["--model", "m", "--temperature", "0", "--top-k", "5", "--max-tokens", "9",
                                         "--seed", "3", "--max-num-seqs", "2"])
    assert (args.model_option, args.temperature, args.top_p, args.top_k, args.max_tokens) == ("m", 0.0, 1.0, 5, 9)
    assert (args.seed, args.max_num_seqs) == (3, 2)  # the engine flags, as `minivllm serve` has them
