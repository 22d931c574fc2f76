"""The quick-start demo runs end to end (a tiny preset, a few tokens) and says what its output is."""
import sys

from minivllm import demo


def test_random_weight_demo(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("MINIVLLM_CACHE", str(tmp_path))  # the demo's checkpoint goes here, not in ~/.cache
    monkeypatch.setattr(sys, "argv", ["minivllm.demo", "--preset", "qwen3-tiny", "--max-tokens", "3"])
    demo.main()
    out = capsys.readouterr().out
    assert "gibberish by design" in out
    assert "60 prompts on qwen3-tiny" in out and "+ 180 output tokens" in out
    assert (tmp_path / "random-qwen3-tiny" / "config.json").is_file()
