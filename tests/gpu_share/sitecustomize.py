"""Several pytest workers on one GPU: each process sees `MINIVLLM_TEST_GPU_SHARE` x the card's memory
as the card's total, so every engine it builds sizes its KV cache from that share.

Only for running the suite in parallel on one large GPU: put this folder on PYTHONPATH (Python then
imports this file at start, in every process the tests start too, servers and benchmarks included):

    MINIVLLM_TEST_GPU_SHARE=0.2 PYTHONPATH=.:tests/gpu_share pytest -n 4    (or: make test-shared-gpu)

An engine's budget is gpu_memory_utilization x total (engine/gpu_worker.py): with the total scaled
here, four workers at 0.2 take at most 0.8 of the card together (0.72 at the default utilization 0.9).
"""
import os

_share = float(os.environ.get("MINIVLLM_TEST_GPU_SHARE", "0") or 0)
if 0 < _share < 1:
    import torch

    _mem_get_info = torch.cuda.mem_get_info

    def _shared_mem_get_info(device=None):
        free, total = _mem_get_info(device)
        return free, int(total * _share)

    torch.cuda.mem_get_info = _shared_mem_get_info
