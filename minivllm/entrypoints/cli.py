"""The `minivllm` command: `minivllm serve MODEL_DIR [flags]` starts the OpenAI-compatible server.

vLLM: vllm/entrypoints/cli/main.py (`vllm serve`).
"""
import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] != "serve":
        print("usage: minivllm serve MODEL_DIR [--host HOST] [--port PORT] [--api-key KEY] [engine flags]\n"
              "       minivllm serve --help   (every flag)", file=sys.stderr)
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    from minivllm.entrypoints.openai.api_server import main as serve

    serve(argv[1:])


if __name__ == "__main__":
    main()
