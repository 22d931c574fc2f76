"""`minivllm chat MODEL_DIR`: talk to a model in the terminal, each answer printed as it is generated.

At every turn the whole conversation goes through the model's chat template, and an engine in this
process (`LLM`, stepped here) answers it. /reset forgets the conversation, /exit or Ctrl-D leaves;
Ctrl-C stops an answer (at the prompt, it leaves). vLLM: vllm/entrypoints/cli/openai.py (`vllm chat`,
a client of a running server); mini-sglang's `--shell` runs its engine in-process, as this does.
"""
import argparse
import contextlib
import os
import select
import signal
import sys
import threading

from minivllm.entrypoints.arg_utils import add_engine_args, add_model_arg, engine_kwargs_from_args, resolve_model
from minivllm.sampling_params import RequestOutputKind, SamplingParams

PROMPT = "> "
HELP = "Type a message and Enter. /reset forgets the conversation, /exit or Ctrl-D leaves, Ctrl-C stops an answer."


def make_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="minivllm chat", description="Talk to a model in the terminal.")
    add_model_arg(p)
    s = p.add_argument_group("sampling (SamplingParams' defaults; --seed, among the engine flags, seeds the sampler)")
    s.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=-1, help="-1: every token")
    s.add_argument("--max-tokens", type=int, default=None,
                   help="tokens per answer at most (default: what the context has left)")
    add_engine_args(p)
    return p


@contextlib.contextmanager
def _sigint_sets(event: threading.Event):
    """Within the block, Ctrl-C sets `event` instead of raising KeyboardInterrupt somewhere inside an
    engine step; the caller stops between two steps."""
    event.clear()
    previous = signal.signal(signal.SIGINT, lambda signum, frame: event.set())
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class ChatSession:
    """One conversation: its messages, and each answer streamed from the engine."""

    def __init__(self, llm, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1,
                 max_tokens: int | None = None):
        self.llm = llm
        self.sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k)
        self.max_tokens = max_tokens
        self.messages: list[dict] = []
        self._interrupted = threading.Event()

    def reset(self):
        self.messages.clear()

    def answer(self, text: str, write):
        """Add a user message and stream the model's answer through `write`; Ctrl-C stops it, and what
        was written stays in the conversation. Raises ValueError when the message cannot be answered
        (the conversation no longer fits in the context, a sampling flag is out of range); the message
        is then not kept."""
        self.messages.append({"role": "user", "content": text})
        pieces = []
        with _sigint_sets(self._interrupted):
            try:
                request_id = self._add_request()
            except ValueError:
                self.messages.pop()
                raise
            while self.llm.has_unfinished_requests() and not self._interrupted.is_set():
                for out in self.llm.step():
                    if out.request_id == request_id:  # (not a stopped answer's last step, with async scheduling)
                        pieces.append(out.outputs[0].text)
                        write(pieces[-1])
            self.llm.abort_request(request_id)  # (finished: nothing to do)
        self.messages.append({"role": "assistant", "content": "".join(pieces)})

    def _add_request(self) -> str:
        """Queue the conversation so far, the model's turn next; returns the request's id."""
        prompt = self.llm.get_tokenizer().apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True)
        _, token_ids = self.llm.tokenize(prompt)
        room = self.llm.config.max_model_len - len(token_ids)
        if room < 1:
            raise ValueError(f"with this message the conversation is {len(token_ids)} tokens, and the context "
                             f"holds {self.llm.config.max_model_len}: send a shorter one, or /reset")
        params = SamplingParams(max_tokens=min(room, self.max_tokens or room), output_kind=RequestOutputKind.DELTA,
                                **self.sampling)
        return self.llm.add_request(token_ids, params)


def write(text: str):
    sys.stdout.write(text)
    sys.stdout.flush()


def _signal_pipe() -> int:
    """The read end of a pipe that gets a byte whenever a signal arrives (signal.set_wakeup_fd)."""
    reader, writer = os.pipe()
    os.set_blocking(reader, False)
    os.set_blocking(writer, False)
    signal.set_wakeup_fd(writer)
    return reader


def read_message(signals: int) -> str:
    """input(PROMPT), but a Ctrl-C that comes just as the prompt appears still leaves at once: input()
    would begin its read after that signal was handled, and wait for Enter. Here select() watches the
    terminal and the signal pipe."""
    if not sys.stdin.isatty():  # (lines piped in: no Ctrl-C, and select would miss lines read ahead)
        return input(PROMPT)
    with contextlib.suppress(BlockingIOError):
        os.read(signals, 4096)  # signals handled already (an answer's Ctrl-C)
    write(PROMPT)
    select.select([sys.stdin, signals], [], [])  # a Ctrl-C raises KeyboardInterrupt as this returns
    line = sys.stdin.readline()  # (a terminal hands over one line per read)
    if not line:
        raise EOFError
    return line.removesuffix("\n")


def run(session: ChatSession):
    """Read messages from the terminal and answer them until /exit, Ctrl-D or Ctrl-C at the prompt."""
    signals = _signal_pipe()
    write(HELP + "\n")
    while True:
        try:
            line = read_message(signals)
        except (EOFError, KeyboardInterrupt):
            write("\n")
            return
        if line.strip() == "/exit":
            return
        if line.strip() == "/reset":
            session.reset()
            write("(the conversation is forgotten)\n")
        elif line.strip():
            try:
                session.answer(line, write)
            except ValueError as e:
                write(f"error: {e}")
            write("\n")


def main(argv: list[str] | None = None) -> None:
    parser = make_arg_parser()
    args = resolve_model(parser, parser.parse_args(argv))
    from minivllm import LLM

    engine_kwargs = engine_kwargs_from_args(args)
    engine_kwargs.setdefault("max_num_seqs", 1)  # one conversation (a CPU sizes its KV cache for max_num_seqs)
    with LLM(args.model, **engine_kwargs) as llm:
        run(ChatSession(llm, args.temperature, args.top_p, args.top_k, args.max_tokens))


if __name__ == "__main__":
    main()
