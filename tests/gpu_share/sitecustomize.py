"""Several pytest workers on one GPU: each process sees `MINIVLLM_TEST_GPU_SHARE` x the card's memory
as a card of its own, so every engine it builds sizes its KV cache from that share.

Only for running the suite in parallel on one large GPU: put this folder on PYTHONPATH (Python then
imports this file at start, in every process the tests start too, servers and benchmarks included):

    MINIVLLM_TEST_GPU_SHARE=0.2 PYTHONPATH=.:tests/gpu_share pytest -n 4    (or: make test-shared-gpu)

An engine's budget is gpu_memory_utilization x total (engine/gpu_worker.py): with the total scaled
here, four workers at 0.2 take at most 0.8 of the card together (0.72 at the default utilization 0.9).
The free memory a process sees is its share less what its own allocator holds (never more than the
card has free): an engine measures its weights and activations as the fall in free memory while it
loads, and the other workers' allocations in the meantime must not count as its own.
"""
import os

_share = float(os.environ.get("MINIVLLM_TEST_GPU_SHARE", "0") or 0)
if 0 < _share < 1:
    import torch

    _mem_get_info = torch.cuda.mem_get_info

    def _shared_mem_get_info(device=None):
        free, total = _mem_get_info(device)
        share = int(total * _share)
        return min(free, max(share - torch.cuda.memory_reserved(device), 0)), share

    torch.cuda.mem_get_info = _shared_mem_get_info
