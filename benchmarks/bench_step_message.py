"""What it costs rank 0 to hand one step's inputs to a worker process, per step, on the CPU.

The message is a decode step's: the integer header of minivllm.engine.executor.encode_step and the
static decode input buffer (input ids, positions, slots, context lengths, order, block tables) of
--batch sequences of --max-blocks blocks. Each transport sends it, the worker reads it into a tensor
and both ranks then all-reduce one number (the step's first collective, so each timed step is a
round trip, as in the engine); the all-reduce alone is timed too and subtracted:

    torch.distributed broadcast  header + payload, gloo (what the engine uses)
    shared memory + spin         payload written into a SharedMemory block, a step counter polled
    shared memory + event        the same block, the worker woken by a multiprocessing.Event (nano-vllm)
    pipe (pickle)                multiprocessing.Pipe send_bytes / recv_bytes

vLLM: vllm/distributed/device_communicators/shm_broadcast.py (its shared-memory MessageQueue).

    python -m benchmarks.bench_step_message [--batch 256 --max-blocks 257 --steps 2000]
"""
import argparse
import datetime
import multiprocessing as mp
import statistics
import time
from multiprocessing import shared_memory

import numpy as np
import torch
import torch.distributed as dist

from benchmarks import common
from minivllm.engine.executor import HEADER_SIZE, StepKind
from minivllm.utils.distributed import Rendezvous

NAME = "bench_step_message"
NUM_VECTORS = 5  # as cuda_graph.DecodeBuffers
HEADER = HEADER_SIZE  # int64 fields
TRANSPORTS = ("none (all-reduce only)", "torch.distributed broadcast", "shared memory + spin",
              "shared memory + event", "pipe (pickle)")


def payload_size(batch, max_blocks):
    return batch * (NUM_VECTORS + max_blocks)


def _ack():
    dist.all_reduce(torch.ones(1))


def _rank0(transport, chan, steps, size, shm):
    payload = torch.arange(size, dtype=torch.int32)  # size 0: the header alone
    header = torch.zeros(HEADER, dtype=torch.int64)
    header[0] = StepKind.STEP  # (the fields' tags and shapes: their values do not change the cost)
    counter = np.ndarray((1,), dtype=np.int64, buffer=shm.buf) if shm else None
    # shared memory carries the header too: [step counter | header | payload]
    data = np.ndarray((2 * HEADER + size,), dtype=np.int32, buffer=shm.buf, offset=8) if shm else None
    message = np.concatenate([header.numpy().view(np.int32), payload.numpy()])
    times = []
    for step in range(steps):
        start = time.perf_counter()
        if transport == "torch.distributed broadcast":
            dist.broadcast(header, src=0)
            if size:
                dist.broadcast(payload, src=0)
        elif transport.startswith("shared memory"):
            data[:] = message
            counter[0] = step + 1
            if transport.endswith("event"):
                chan.set()
        elif transport == "pipe (pickle)":
            chan.send_bytes(message.tobytes())
        _ack()
        times.append(time.perf_counter() - start)
    return times


def _worker(transport, chan, steps, size, shm_name, rendezvous):
    dist.init_process_group("gloo", init_method=rendezvous.init_method, rank=1, world_size=2,
                            timeout=datetime.timedelta(seconds=120))
    shm = shared_memory.SharedMemory(name=shm_name) if shm_name else None
    counter = np.ndarray((1,), dtype=np.int64, buffer=shm.buf) if shm else None
    data = np.ndarray((2 * HEADER + size,), dtype=np.int32, buffer=shm.buf, offset=8) if shm else None
    message = np.zeros(2 * HEADER + size, dtype=np.int32)
    header, payload = torch.zeros(HEADER, dtype=torch.int64), torch.zeros(size, dtype=torch.int32)
    for step in range(steps):
        if transport == "torch.distributed broadcast":
            dist.broadcast(header, src=0)
            if size:
                dist.broadcast(payload, src=0)
        elif transport.startswith("shared memory"):
            if transport.endswith("event"):
                chan.wait()
                chan.clear()
            while counter[0] != step + 1:
                time.sleep(0)
            message[:] = data
        elif transport == "pipe (pickle)":
            raw = chan.recv_bytes()
            message[:] = np.frombuffer(raw, dtype=np.int32)
        _ack()
    del counter, data
    if shm:
        shm.close()
    dist.destroy_process_group()


def measure(transport, steps, size):
    ctx = mp.get_context("spawn")
    rendezvous = Rendezvous.from_env()
    shm = shared_memory.SharedMemory(create=True, size=8 + 4 * (2 * HEADER + size)) if transport.startswith("shared") else None
    if shm:
        np.ndarray((1,), dtype=np.int64, buffer=shm.buf)[0] = 0
    chan_parent = chan_child = None
    if transport == "pipe (pickle)":
        chan_child, chan_parent = ctx.Pipe(duplex=False)
    elif transport.endswith("event"):
        chan_parent = chan_child = ctx.Event()
    worker = ctx.Process(target=_worker, args=(transport, chan_child, steps, size, shm.name if shm else None,
                                               rendezvous), daemon=True)
    worker.start()
    try:
        dist.init_process_group("gloo", init_method=rendezvous.init_method, rank=0, world_size=2,
                                timeout=datetime.timedelta(seconds=120))
        times = _rank0(transport, chan_parent, steps, size, shm)
        dist.destroy_process_group()
        worker.join(60)
    finally:
        if worker.is_alive():
            worker.kill()
        if shm:
            shm.close()
            shm.unlink()
    times = times[steps // 10:]  # the first steps warm up
    return {"median_us": statistics.median(times) * 1e6, "p90_us": sorted(times)[int(0.9 * len(times))] * 1e6}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256, help="sequences in the decode step")
    parser.add_argument("--max-blocks", type=int, default=257, help="block-table columns (max_model_len 4096, block 16)")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--out-dir", type=common.Path, default=common.RESULTS_DIR)
    parser.add_argument("--cpu-smoke", "--tiny", dest="cpu_smoke", action="store_true", help="a few steps, small")
    args = parser.parse_args(argv)
    if args.cpu_smoke:
        args.batch, args.max_blocks, args.steps = 8, 8, 50
    sizes = {"header only": 0, f"header + decode inputs of {args.batch} sequences": payload_size(args.batch, args.max_blocks)}
    results, rows = {}, []
    for label, size in sizes.items():
        print(f"{NAME}: {label}: {HEADER * 8} B + {4 * size / 1024:.0f} KiB, {args.steps} steps", flush=True)
        results[label] = {"payload_bytes": 4 * size}
        for transport in TRANSPORTS:
            results[label][transport] = measure(transport, args.steps, size)
            print(f"  {transport}: median {results[label][transport]['median_us']:.0f} us", flush=True)
        base = results[label][TRANSPORTS[0]]["median_us"]
        rows += [[label if t == TRANSPORTS[0] else "", t, f"{results[label][t]['median_us']:.0f}",
                  f"{results[label][t]['p90_us']:.0f}", f"{results[label][t]['median_us'] - base:+.0f}"]
                 for t in TRANSPORTS]
    payload = {"benchmark": NAME, "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "cpu_count": mp.cpu_count(), "torch": torch.__version__, "options": common.options_dict(args),
               "header_bytes": HEADER * 8, "results": results}
    common.write_json(args.out_dir, NAME, payload)
    common.print_table(["message", "transport", "step round trip median (us)", "p90 (us)", "vs all-reduce only (us)"],
                       rows, title="rank 0 -> 1 worker per step (CPU; a gloo all-reduce of one number acknowledges)")
    return payload


if __name__ == "__main__":
    main()
