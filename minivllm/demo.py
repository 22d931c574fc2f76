"""The quick-start demo: 60 batched chat prompts through the engine, then the throughput.

    python -m minivllm.demo              random-weight Qwen3 (qwen3-0.6b on a GPU, qwen3-small on a CPU)
    python -m minivllm.demo --smollm2    the real SmolLM2-135M-Instruct on a few questions

Random weights produce gibberish text: the point is the engine (batching, paging, throughput).
SmolLM2-135M is a small model and gets some answers wrong; its greedy tokens under minivllm are
transformers' tokens for the same questions (tests/test_engine.py checks it).
"""
import argparse
import os
import time

TOPICS = ["the ocean", "a lighthouse", "prime numbers", "autumn leaves", "a robot learning to paint", "coffee",
          "the moon landing", "a lost key", "bread baking", "a mountain village", "black holes", "a jazz club",
          "the printing press", "honeybees", "a rainy train station", "chess", "volcanoes", "a time traveller",
          "the first computer", "a desert oasis"]
STYLES = ["Write a haiku about {}.", "Explain {} to a ten-year-old.", "Give three surprising facts about {}."]
QUESTIONS = ["What is the capital of France?", "How many legs does a spider have?",
             "Name three primary colors.", "What is 12 times 12?", "Why is the sky blue? Answer in one sentence."]
SMOLLM2_MAX_TOKENS = 48


def demo_prompts() -> list[list[dict]]:
    """60 single-turn chat conversations: 20 topics x 3 styles."""
    return [[{"role": "user", "content": style.format(topic)}] for style in STYLES for topic in TOPICS]


def random_qwen3_dir(preset: str) -> str:
    from minivllm.tools.make_model import make_model
    from minivllm.tools.tokenizer import minivllm_cache_dir

    out = os.path.join(minivllm_cache_dir(), f"random-{preset}")
    make_model(preset, out, seed=0)
    return out


def run_random_demo(args):
    import torch

    from minivllm import LLM, SamplingParams

    on_gpu = torch.cuda.is_available()
    preset = args.preset or ("qwen3-0.6b" if on_gpu else "qwen3-small")
    model_dir = args.model or random_qwen3_dir(preset)
    # 60 prompts never need more than 64 seats; on a CPU that also keeps the KV cache to what they can fill
    llm = LLM(model_dir, max_model_len=1024 if not on_gpu else 4096, max_num_seqs=64)
    max_tokens = args.max_tokens or (128 if on_gpu else 32)
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=max_tokens, ignore_eos=True)
    conversations = demo_prompts()
    start = time.perf_counter()
    outputs = llm.chat(conversations, params)
    seconds = time.perf_counter() - start
    print("\nRandom weights: the text below is gibberish by design; the engine's work is the point.")
    for conv, out in list(zip(conversations, outputs))[:3]:
        completion = out.outputs[0]
        # Random weights often pick ids past the tokenizer's vocab (decoded as ""): show ids too.
        print(f"\n> {conv[0]['content']}\n  text: {completion.text[:160]!r}\n  ids:  {completion.token_ids[:12]}...")
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    num_in = sum(len(o.prompt_token_ids) for o in outputs)
    print(f"\n{len(outputs)} prompts on {preset} ({llm.config.device}, {llm.config.torch_dtype}, "
          f"{llm.config.attention_backend} attention): {num_in} prompt + {num_out} output tokens in {seconds:.1f} s "
          f"= {num_out / seconds:,.0f} output tok/s")


def run_smollm2_demo(args):
    from minivllm import LLM, SamplingParams
    from minivllm.tools.smollm2 import get_smollm2

    llm = LLM(args.model or get_smollm2(), max_model_len=2048, max_num_seqs=len(QUESTIONS))
    outputs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS],
                       SamplingParams(temperature=0.0, max_tokens=SMOLLM2_MAX_TOKENS))
    for question, out in zip(QUESTIONS, outputs):
        print(f"> {question}\n  {out.outputs[0].text.strip()}")
    print("\nSmolLM2-135M-Instruct is a small model (135M parameters): it gets some answers wrong (arithmetic "
          "especially).\nThose are the model's answers, not the engine's: minivllm's greedy tokens for these "
          "questions equal transformers' generate (tests/test_engine.py checks it).")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smollm2", action="store_true", help="run the real SmolLM2-135M-Instruct instead")
    parser.add_argument("--preset", help="make_model preset for the random-weight demo")
    parser.add_argument("--model", help="use this model directory instead of making one")
    parser.add_argument("--max-tokens", type=int, help="new tokens per prompt (default: 128 on a GPU, 32 on a CPU)")
    args = parser.parse_args()
    run_smollm2_demo(args) if args.smollm2 else run_random_demo(args)


if __name__ == "__main__":
    main()
