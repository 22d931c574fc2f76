"""The teaching path: an engine you can read in one sitting, in this order.

    sequence.py          a request's tokens and where its KV lives
    kv_cache_manager.py  paged blocks, reference counts, prefix caching
    scheduler.py         continuous batching under a token budget, preemption by recompute
    attention.py         store this step's K/V, then attend over the paged cache
    sampler.py           greedy, temperature, top-k, top-p
    model_runner.py      scheduled step -> inputs -> forward -> sampled tokens
    engine.py            the loop: schedule, run, update

Everything else in minivllm/engine/ is a layer over these (assembled in engine/assemble.py).
"""
