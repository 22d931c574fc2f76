"""The `minivllm` command: `minivllm serve MODEL_DIR [flags]` starts the OpenAI-compatible server,
`minivllm chat MODEL_DIR [flags]` talks to the model in the terminal.

vLLM: vllm/entrypoints/cli/main.py (`vllm serve`, `vllm chat`).
"""
import sys

USAGE = ("usage: minivllm serve MODEL_DIR [--host HOST] [--port PORT] [--api-key KEY] [engine flags]\n"
         "       minivllm chat MODEL_DIR [--temperature T] [--max-tokens N] [engine flags]\n"
         "       minivllm serve --help, minivllm chat --help   (every flag)")


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    command = argv[0] if argv else None
    if command == "serve":
        from minivllm.entrypoints.openai.api_server import main as serve

        serve(argv[1:])
    elif command == "chat":  # (not through the server module: the chat imports no HTTP packages)
        from minivllm.entrypoints.chat import main as chat

        chat(argv[1:])
    else:
        print(USAGE, file=sys.stderr)
        sys.exit(0 if command in ("-h", "--help") else 2)


if __name__ == "__main__":
    main()
